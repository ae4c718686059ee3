"""Build the tiny world: benchmarks, pretraining corpus, the donor ladder and the post model.

Every model is an ordinary Hugging Face directory (Qwen3ForCausalLM + the character tokenizer), so the
rest of the pipeline treats the tiny world exactly as it treats Qwen3 or OLMo checkpoints.
"""

import math
import random
from pathlib import Path

import polars as pl

from graftlab.streams import stream
from graftlab.tasks import arith, chat_completion, chat_prompt


def write_problems(problems: list[dict], path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    pl.DataFrame(problems).write_parquet(path)


def make_benchmarks(tasks: list[str], count: int, seed: int, out_dir: Path) -> None:
    """One held-out problem set per old task; post-training never sees these problems."""
    for task in tasks:
        write_problems(arith.sample_problems(task, count, "benchmark", seed), out_dir / f"{task}.parquet")


def make_candidates(task: str, count: int, seed: int, out: Path) -> None:
    """The pool of new-task problems that mining filters."""
    write_problems(arith.sample_problems(task, count, "candidates", seed), out)


def chat_turns(problems: list[dict], template_tokenizer) -> str:
    """Solved problems as chat turns with their thinking, one after another."""
    return "\n".join(
        chat_prompt(template_tokenizer, p["prompt"]) + chat_completion(p["thinking"], p["answer"]) for p in problems
    )


def chat_document(tasks: list[str], problems: int, rng: random.Random, template_tokenizer) -> str:
    """`problems` solved problems of `tasks` as chat turns with their thinking: the format post-training
    teaches, seen already in pretraining as in a mid-training mixture."""
    drawn = []
    for _ in range(problems):
        task = rng.choice(tasks)
        drawn.append(arith.problem(task, *arith.operands(task, rng)))
    return chat_turns(drawn, template_tokenizer)


def exposure_problems(task: str, count: int, seed: int, candidates: Path) -> list[dict]:
    """The `count` distinct new-task problems the pretraining corpus shows solved (`corpus.new_task_share`).
    None is a mining candidate, so none is a problem SFT trains on or the new-task benchmark holds."""
    held_out = set(pl.read_parquet(candidates, columns=["id"])["id"])
    room = arith.distinct_problems(task) - len(held_out)
    if count > room:
        raise ValueError(
            f"corpus: new_task_problems {count} exceeds the {room} {task} problems outside the "
            f"{len(held_out)} mining candidates (world.candidates)"
        )
    return arith.sample_problems(task, count, "exposure", seed, exclude=held_out)


def make_corpus(
    tasks: list[str],
    documents: int,
    lines_per_doc: int,
    seed: int,
    out: Path,
    chat_share: float = 0.0,
    chat_tasks: list[str] = (),
    new_task_share: float = 0.0,
    exposure: list[dict] = (),
    families: list[str] = (),
) -> None:
    """Documents of bare facts of `tasks`, one per line. A `chat_share` of them instead hold chat-format
    solved problems of `chat_tasks` and of the pretraining-only `families` (`arith.FAMILIES`), and a
    `new_task_share` chat-format solved problems drawn from `exposure` (see `exposure_problems`); a chat
    document holds a quarter as many problems as a document has lines (each is about four lines long)."""
    if not 0 <= chat_share <= 1 or (chat_share > 0 and not chat_tasks):
        raise ValueError(f"corpus: chat_share {chat_share} must lie in [0, 1] and needs chat tasks")
    if families and chat_share == 0:
        raise ValueError(f"corpus: families {list(families)} live in the chat documents and need chat_share > 0")
    if not 0 <= new_task_share <= 1 - chat_share or (new_task_share > 0 and not exposure):
        raise ValueError(f"corpus: new_task_share {new_task_share} must lie in [0, 1 - chat_share] and needs problems")
    rng = stream("corpus", seed)
    tok = None
    if chat_share > 0 or new_task_share > 0:
        from graftlab.world.tokenizer import build_tokenizer  # transformers: only when chat is asked for

        tok = build_tokenizer()
    per_doc = max(1, lines_per_doc // 4)
    docs = []
    for _ in range(documents):
        # One draw decides a document's kind; without new_task_share the draws are those of a corpus
        # built before the option existed, so such worlds keep their corpus.
        kind = rng.random() if chat_share > 0 or new_task_share > 0 else 1.0
        if kind < new_task_share:
            docs.append(chat_turns([rng.choice(exposure) for _ in range(per_doc)], tok))
        elif kind < new_task_share + chat_share:
            docs.append(chat_document([*chat_tasks, *families], per_doc, rng, tok))
        else:
            docs.append("\n".join(arith.corpus_line(rng.choice(tasks), rng) for _ in range(lines_per_doc)))
    out.parent.mkdir(parents=True, exist_ok=True)
    pl.DataFrame({"text": docs}).write_parquet(out)


def init_model(tokenizer, arch: dict, seed: int):
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(seed)
    config = Qwen3Config(
        vocab_size=len(tokenizer),
        hidden_size=arch["hidden_size"],
        intermediate_size=arch["intermediate_size"],
        num_hidden_layers=arch["layers"],
        num_attention_heads=arch["heads"],
        num_key_value_heads=arch["kv_heads"],
        head_dim=arch["hidden_size"] // arch["heads"],
        max_position_embeddings=arch["max_positions"],
        tie_word_embeddings=True,
        bos_token_id=None,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    return Qwen3ForCausalLM(config)


def pack(token_lists: list[list[int]], block: int, sep: int) -> list[dict]:
    """Concatenate documents (separated by `sep`) and cut fixed-length blocks, as LM pretraining does."""
    stream = [t for ids in token_lists for t in ids + [sep]]
    return [{"input_ids": stream[i : i + block]} for i in range(0, len(stream) - block + 1, block)]


def sft_rows(tokenizer, problems: list[dict]) -> list[dict]:
    """Chat-formatted SFT examples (prompt masked out of the loss) from problems with expert thinking."""
    from graftlab.train.sft import encode_traces

    completions = [chat_completion(p["thinking"], p["answer"]) for p in problems]
    return encode_traces(tokenizer, [p["prompt"] for p in problems], completions)


def posttrain_problems(tasks: list[str], per_task: int, seed: int, benchmark_dir: Path) -> list[dict]:
    problems = []
    for task in tasks:
        held_out = set(pl.read_parquet(benchmark_dir / f"{task}.parquet")["id"])
        problems += arith.sample_problems(task, per_task, "posttrain", seed, exclude=held_out)
    stream("posttrain-order", seed).shuffle(problems)
    return problems


def pretrain(
    tokenizer_dir,
    corpus,
    arch: dict,
    cfg: dict,
    ladder_dir: Path,
    init_dir: Path,
    seed: int,
    threads: int,
    precision: str = "auto",
) -> None:
    """Pretrain from scratch; keep the checkpoints at `cfg["ladder"]` steps as the donor ladder,
    `ladder_dir/step~N`, and the model before any step as `init_dir` (the drift diagnostics measure how
    far pretraining moved it). Each directory appears whole or not at all."""
    from transformers import AutoTokenizer

    from graftlab.io.atomic import atomic_dir
    from graftlab.io.provenance import write_provenance
    from graftlab.train.sft import TrainConfig, finetune

    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    texts = pl.read_parquet(corpus)["text"].to_list()
    blocks = pack(tok(texts, add_special_tokens=False)["input_ids"], cfg["block"], tok.pad_token_id)
    train_cfg = TrainConfig(
        lr=cfg["lr"],
        batch_size=cfg["batch_size"],
        steps=cfg["steps"],
        save_steps=tuple(cfg["ladder"]),
        seed=seed,
        threads=threads,
        precision=precision,
    )
    model = init_model(tok, arch, seed)
    # Saved before training, which changes the model in place: the only moment these weights exist.
    with atomic_dir(init_dir) as tmp:
        model.save_pretrained(tmp)
        tok.save_pretrained(tmp)
        write_provenance(
            tmp, {"model": "initialised from scratch", "tokenizer": str(tokenizer_dir)}, {"arch": arch, "seed": seed}
        )
    with atomic_dir(ladder_dir) as tmp:
        finetune(tokenizer_dir, blocks, train_cfg, [tmp / f"step~{s}" for s in cfg["ladder"]], model=model, data=corpus)


def posttrain(
    base_dir,
    benchmark_dir: Path,
    tasks: list[str],
    cfg: dict,
    out: Path,
    ladder_dir: Path,
    seed: int,
    threads: int,
    precision: str = "auto",
) -> None:
    """SFT of the base model on the old tasks, with thinking traces, in the chat format: the post model at
    `out`, and in `ladder_dir` a checkpoint `post~N` at each step N of `cfg["ladder"]` (the directory is
    written whole, empty when the ladder is)."""
    from transformers import AutoTokenizer

    from graftlab.io.atomic import atomic_dir
    from graftlab.train.sft import TrainConfig, finetune

    tok = AutoTokenizer.from_pretrained(base_dir)
    rows = sft_rows(tok, posttrain_problems(tasks, cfg["examples_per_task"], seed, benchmark_dir))
    # A fixed step count (whole epochs); the ladder's checkpoints along the way, the post model at the end.
    steps = cfg["epochs"] * math.ceil(len(rows) / cfg["batch_size"])
    late = [s for s in cfg["ladder"] if s >= steps]
    if late:
        raise ValueError(f"posttrain.ladder: steps {late} are not before post-training's last step {steps}")
    train_cfg = TrainConfig(
        lr=cfg["lr"],
        batch_size=cfg["batch_size"],
        steps=steps,
        save_steps=(*cfg["ladder"], steps),
        seed=seed,
        threads=threads,
        precision=precision,
    )
    with atomic_dir(ladder_dir) as tmp:
        targets = [tmp / f"post~{s}" for s in cfg["ladder"]] + [out]
        finetune(base_dir, rows, train_cfg, targets, data=f"old tasks {tasks}")
