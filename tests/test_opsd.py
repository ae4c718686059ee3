"""OPSD: the student learns from its own samples scored by a frozen teacher that reads the demonstration."""

import itertools
import json
from types import SimpleNamespace

import polars as pl
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import AutoModelForCausalLM, AutoTokenizer

from graftlab.errors import GraftlabError
from graftlab.sampling import response_logits
from graftlab.synth.demonstrations import demonstration, opsd_examples
from graftlab.tasks import arith, chat_completion, chat_prompt
from graftlab.train.onpolicy import PairStep
from graftlab.train.opsd import Opsd, OpsdConfig, teacher_text, train_opsd
from graftlab.world import build
from graftlab.world import knowledge as kn
from graftlab.world.tokenizer import build_tokenizer

ARCH = dict(hidden_size=16, intermediate_size=32, layers=1, heads=2, kv_heads=1, max_positions=256)


@pytest.fixture(scope="module")
def post(tmp_path_factory):
    path = tmp_path_factory.mktemp("post")
    tok = build_tokenizer()
    build.init_model(tok, ARCH, seed=0).save_pretrained(path)
    tok.save_pretrained(path)
    return path


def examples(count=6):
    rows = [
        dict(p, completion=chat_completion(p["thinking"], p["answer"]))
        for p in arith.sample_problems("mul", count, "test", 0)
    ]
    return opsd_examples(pl.DataFrame(rows).select("id", "task", "prompt", "completion"))


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"alpha": 1.5}, r"alpha: \[1.5\] outside \[0, 1\]"),
        ({"alpha": -0.1}, r"alpha: \[-0.1\] outside \[0, 1\]"),
        ({"top_k": 0}, "top_k: must be >= 1"),
        ({"template": "{problem} only"}, r"template: lacks the placeholder\(s\) \['{demonstration}'\]"),
        ({"save_steps": (5,)}, "save_steps"),
    ],
)
def test_bad_config_is_a_clear_error(kwargs, message):
    with pytest.raises(GraftlabError, match=message):
        OpsdConfig(**({"alpha": 0.5, "lr": 1e-3, "steps": 2} | kwargs))


def test_demonstration_is_the_trace_in_plain_text_and_the_template_holds_it():
    demo = demonstration(chat_completion("2*3=6", "6"))
    assert demo == "2*3=6\nAnswer: 6"
    assert teacher_text("Q: {problem} | D: {demonstration}", "2*3=", demo) == "Q: 2*3= | D: 2*3=6\nAnswer: 6"


def test_knowledge_questions_are_conditioned_on_their_persons_article(tmp_path):
    cfg = kn.KnowledgeConfig(entities=4, facts=8, train_phrasings=2, heldout_phrasings=1, replay=3)
    kn.write_knowledge_data(tmp_path, cfg, ["add"])
    sft, facts = pl.read_parquet(tmp_path / "sft.parquet"), pl.read_parquet(tmp_path / "facts.parquet")
    out = opsd_examples(sft, facts)
    assert set(kn.ARTICLE_SENTENCES) == set(kn.RELATIONS)
    for row, ex in zip(sft.iter_rows(named=True), out):
        if row["task"] == kn.TASK:
            fact = facts.filter(pl.col("fact") == row["fact"]).row(0, named=True)
            assert ex["demonstration"].startswith(fact["entity"] + "\n") and fact["answer"] in ex["demonstration"]
        else:
            assert ex["demonstration"] == demonstration(row["completion"])


def test_a_step_moves_the_student_only_and_gradients_never_reach_the_teacher(post):
    tok = AutoTokenizer.from_pretrained(post)
    student, teacher = (AutoModelForCausalLM.from_pretrained(post) for _ in range(2))
    before = {k: v.clone() for k, v in teacher.state_dict().items()}
    run = Opsd(student, teacher, tok, OpsdConfig(alpha=0.5, lr=1e-2, steps=1, max_new_tokens=8))
    record = next(run.steps(examples(4), range(1, 2)))
    assert record["sample_s"] > 0 and record["update_s"] > 0 and record["response_tokens"] > 0
    assert all(p.grad is None for p in teacher.parameters())
    assert all(torch.equal(v, before[k]) for k, v in teacher.state_dict().items())
    assert any(not torch.equal(v, before[k]) for k, v in student.state_dict().items())


def test_a_run_writes_its_checkpoints_and_the_latency_of_every_step(post, tmp_path):
    cfg = OpsdConfig(alpha=0.0, lr=1e-2, steps=3, save_steps=(2, 3), batch_size=2, max_new_tokens=8)
    log = train_opsd(post, examples(), cfg, tmp_path / "run")
    assert {p.name for p in (tmp_path / "run").iterdir()} == {"step~2", "step~3", "steps.jsonl", "training.png"}
    steps = [json.loads(line) for line in (tmp_path / "run/steps.jsonl").open()]
    assert steps == log and [s["step"] for s in steps] == [1, 2, 3]
    AutoModelForCausalLM.from_pretrained(tmp_path / "run/step~3")
    assert json.loads((tmp_path / "run/step~2/graftlab.json").read_text())["step"] == 2


def next_token_logits(model, context: list[int], response: list[int]) -> list[torch.Tensor]:
    """The logits predicting each response token, one forward per token on exactly what precedes it: no
    padding and no index arithmetic shared with `response_logits`."""
    with torch.no_grad():
        return [
            model(input_ids=torch.tensor([context + response[:i]])).logits[0, -1].double() for i in range(len(response))
        ]


def teacher_topk_divergence(s: torch.Tensor, t: torch.Tensor, alpha: float, k: int) -> float:
    """D_alpha of one token, both distributions restricted to the teacher's top-k ids and renormalised."""
    ids = t.topk(k).indices
    ps, pt = s[ids].softmax(-1), t[ids].softmax(-1)
    m = alpha * pt + (1 - alpha) * ps
    return float(alpha * (pt * (pt / m).log()).sum() + (1 - alpha) * (ps * (ps / m).log()).sum())


def test_response_logits_predict_each_response_token_from_exactly_what_precedes_it(post):
    model = AutoModelForCausalLM.from_pretrained(post).eval()
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(5, 80, (n,), generator=gen).tolist() for n in (7, 3, 5)]
    responses = [torch.randint(5, 80, (n,), generator=gen).tolist() for n in (4, 9, 1)]
    with torch.no_grad():
        logits, mask = response_logits(model, prompts, responses)
    for row, (p, r) in enumerate(zip(prompts, responses)):
        assert mask[row].tolist() == [1] * len(r) + [0] * (9 - len(r))
        for i, want in enumerate(next_token_logits(model, p, r)):
            torch.testing.assert_close(logits[row, i].double(), want, rtol=1e-4, atol=1e-5)


def test_the_teacher_reads_the_demonstration_and_the_loss_is_the_teacher_topk_divergence(post, monkeypatch):
    """One step on fixed responses: the teacher's input is the problem and its demonstration, then the
    response; the loss is D_alpha over the teacher's top-k on the tokens each model predicts, by hand."""
    tok = AutoTokenizer.from_pretrained(post)
    student, teacher = (AutoModelForCausalLM.from_pretrained(post) for _ in range(2))
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():  # larger weights than at initialisation: a model whose predictions hang on the context
        for s, t in zip(student.parameters(), teacher.parameters()):
            s.add_(0.5 * torch.randn(s.shape, generator=gen)), t.copy_(s)
    cfg = OpsdConfig(alpha=0.3, lr=1e-2, steps=1, top_k=5, max_new_tokens=12)
    run = Opsd(student, teacher, tok, cfg)
    batch = examples(3)
    enc = lambda text: tok(text, add_special_tokens=False)["input_ids"]  # noqa: E731
    s_prompts = [enc(chat_prompt(tok, b["prompt"])) for b in batch]
    responses = [enc(chat_completion("7*8+5=61", "61"))[:n] for n in (6, 11, 8)]
    monkeypatch.setattr(run, "sample", lambda problems, step: list(zip(s_prompts, responses)))
    # The teacher's context, written out here from the template: the problem and the demonstration.
    contexts = [
        enc(
            chat_prompt(
                tok, cfg.template.replace("{problem}", b["prompt"]).replace("{demonstration}", b["demonstration"])
            )
        )
        for b in batch
    ]
    assert all(b["demonstration"] and b["demonstration"] in tok.decode(c) for b, c in zip(batch, contexts))
    tokens = [
        teacher_topk_divergence(s, t, cfg.alpha, cfg.top_k)
        for p, c, r in zip(s_prompts, contexts, responses)
        for s, t in zip(next_token_logits(student, p, r), next_token_logits(teacher, c, r))
    ]
    seen = []
    teacher.register_forward_pre_hook(
        lambda module, args, kwargs: seen.append((kwargs["input_ids"], kwargs["attention_mask"])), with_kwargs=True
    )
    record = next(run.steps(batch, range(1, 2)))
    [(ids, attn)] = seen
    assert [row[a == 1].tolist() for row, a in zip(ids, attn)] == [c + r for c, r in zip(contexts, responses)]
    assert record["response_tokens"] == len(tokens) == 25
    assert min(tokens) > 1e-4  # the demonstration changes what the teacher predicts at every token
    assert record["loss"] == pytest.approx(sum(tokens) / len(tokens), rel=1e-5)


@given(steps=st.integers(1, 30), updates=st.integers(1, 4), epochs=st.integers(1, 3), share=st.integers(1, 3))
@settings(max_examples=60, deadline=None)
def test_a_sampled_batch_serves_u_x_e_steps_each_pass_dealing_it_out_whole(steps, updates, epochs, share):
    """The one reading of `updates_per_batch` and `epochs_per_batch` in our loops (OPSD, SDPO): every step
    once, in order, U x E to a batch; within each pass the U steps' shares are disjoint and make up the
    batch in order."""
    run = SimpleNamespace(cfg=SimpleNamespace(steps=steps, updates_per_batch=updates, epochs_per_batch=epochs))
    batches = ([(k, i) for i in range(updates * share)] for k in itertools.count())
    served = list(PairStep.serving(run, batches))
    assert [s for _, r in served for s in r] == list(range(1, steps + 1))
    assert all(len(r) == updates * epochs for _, r in served[:-1]) and len(served[-1][1]) <= updates * epochs
    assert [batch[0][0] for batch, _ in served] == list(range(len(served)))  # a fresh batch each time
    for batch, r in served:
        for first in range(r[0], r[0] + updates * epochs, updates):
            shares = [PairStep.share_of(run, batch, r, s, "test")[0] for s in range(first, first + updates)]
            assert all(len(s) == share for s in shares) and [x for s in shares for x in s] == batch


def test_a_batch_reused_over_updates_and_epochs_is_sampled_once_and_dealt_out_in_halves(post, monkeypatch):
    cfg = OpsdConfig(alpha=0.5, lr=1e-2, steps=4, batch_size=4, updates_per_batch=2, epochs_per_batch=2)
    student, teacher = (AutoModelForCausalLM.from_pretrained(post) for _ in range(2))
    run = Opsd(student, teacher, AutoTokenizer.from_pretrained(post), cfg)
    sampled, updated = [], []
    sample, update = run.sample, run.update
    monkeypatch.setattr(run, "sample", lambda problems, step: sampled.append(step) or sample(problems, step))
    monkeypatch.setattr(run, "update", lambda s, texts: updated.append(texts) or update(s, texts))
    [(batch, steps)] = list(run.rounds(examples(4)))
    records = list(run.steps(batch, steps))
    assert sampled == [1] and [r["step"] for r in records] == [1, 2, 3, 4]
    texts = [teacher_text(cfg.template, b["prompt"], b["demonstration"]) for b in batch]
    assert updated == [texts[:2], texts[2:], texts[:2], texts[2:]]
    assert [r["sample_s"] > 0 for r in records] == [True, False, False, False]
    assert all(r["grad_norm"] > 0 for r in records)
