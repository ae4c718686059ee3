"""GRPO of the post model with TRL's GRPOTrainer, checked against hand computations on a pico world model:
group advantages with and without std scaling, the per-token pooled loss, zero gradient from groups whose
rewards are all equal, the k3 KL term and its gradient; a run's checkpoints, step log and plot; resume."""

import json

import polars as pl
import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

import graftlab.tasks as tasks
from graftlab.errors import GraftlabError
from graftlab.tasks import EMPTY_THINK, arith, chat_completion
from graftlab.train.grpo import GrpoConfig, _Clock, grpo_dataset, make_reward, make_trainer, train_grpo
from graftlab.train.problems import rl_problems
from graftlab.train.resume import Resume

COLUMNS = {"step", "loss", "reward", "accuracy", "entropy", "response_len", "repeated_rate", "sample_s", "update_s"}
COLUMNS |= {"response_tokens", "flat_groups"}
RUN = dict(lr=1e-2, steps=3, save_steps=(2, 3), batch_size=2, generations=3, max_new_tokens=8)


def problems(count=4):
    rows = [
        dict(p, completion=chat_completion(p["thinking"], p["answer"]))
        for p in arith.sample_problems("mul", count, "test", 0)
    ]
    return rl_problems(pl.DataFrame(rows).select("id", "task", "prompt", "completion"))


def graded_by(monkeypatch, grade):
    """Every problem graded by `grade(turn, answer)`: a random pico model is never right, so a test that
    needs rewards to vary decides them itself."""
    task = tasks.Task("fake", prompt=str, grade=grade, reference=str)
    monkeypatch.setattr(tasks, "get_task", lambda name: task)


def parity(turn, answer):
    # About half the samples of a random model: groups of 4 mix rewards 7 times in 8.
    return sum(map(ord, turn)) % 2 == 0


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"generations": 1}, "generations"),
        ({"epsilon": 0}, "epsilon"),
        ({"beta": -0.1}, "beta"),
        ({"lr": 0}, "lr"),
        ({"updates_per_batch": 0}, "updates_per_batch"),
        ({"scale_rewards": "yes"}, "scale_rewards"),
        ({"save_steps": (5,)}, "save_steps"),
        ({"micro_batch_size": 3}, "does not divide"),
    ],
)
def test_bad_config_is_a_clear_error_naming_the_key(kwargs, message):
    with pytest.raises(GraftlabError, match=message):
        GrpoConfig(**({"lr": 1e-3, "steps": 2, "batch_size": 2, "generations": 2} | kwargs))


def test_prompts_are_formatted_and_turns_graded_as_each_task_does(world_pico):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(world_pico)
    rows = [
        {"prompt": "2*3=", "answer": "6", "task": "mul"},
        {"prompt": "Where was Ada born?", "answer": "Paris", "task": "knowledge"},
    ]
    data = grpo_dataset(tok, rows, GrpoConfig(lr=1e-3, steps=1, batch_size=2, generations=2))
    prompts = {r["task"]: r["prompt"] for r in data}
    assert prompts["knowledge"].endswith(EMPTY_THINK) and not prompts["mul"].endswith(EMPTY_THINK)
    clock = _Clock()
    reward = make_reward(tok, clock, generations=2)
    # The exact ids, special tokens kept: an arithmetic turn thinks, a knowledge answer follows the
    # pre-filled empty think block, which grading puts back in front.
    texts = ["<think>\n2*3=6\n</think>\n\n6<|im_end|>", "<think>\n2*3=7\n</think>\n\n7<|im_end|>"]
    texts += ["Paris.<|im_end|>", "Rome<|im_end|>"]
    ids = [tok(t, add_special_tokens=False)["input_ids"] for t in texts]
    got = reward(
        prompts=None,
        completions=None,
        completion_ids=ids,
        answer=["6", "6", "Paris", "Paris"],
        task=["mul", "mul", "knowledge", "knowledge"],
    )
    assert got == [1.0, 0.0, 1.0, 0.0]
    assert clock.batch["accuracy"] == 0.5 and clock.batch["flat_groups"] == 0.0
    assert clock.batch["response_tokens"] == sum(map(len, ids))


@pytest.mark.parametrize("correct", [True, False], ids=["all-correct", "all-wrong"])
def test_groups_with_equal_rewards_have_zero_advantage_and_leave_the_weights_unchanged(
    world_pico, tmp_path, monkeypatch, correct
):
    graded_by(monkeypatch, lambda turn, answer: correct)
    cfg = GrpoConfig(lr=1e-1, steps=2, batch_size=2, generations=3, max_new_tokens=6)
    trainer = make_trainer(world_pico, problems(), cfg, tmp_path / "trainer")
    before = {k: v.clone() for k, v in trainer.model.state_dict().items()}
    trainer.train()
    assert all(a == 0.0 for b in trainer.clock.batches for a in b["advantages"])
    after = trainer.model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)  # bit for bit: the gradient was exactly 0
    assert [h["loss"] for h in trainer.state.log_history if "grpo/sample_s" in h] == [0.0, 0.0]


@pytest.mark.parametrize("scale", [True, False], ids=["std-scaled", "mean-centred"])
def test_advantages_and_the_token_pooled_loss_match_a_hand_computation(world_pico, tmp_path, monkeypatch, scale):
    graded_by(monkeypatch, parity)
    cfg = GrpoConfig(lr=1e-2, steps=1, batch_size=3, generations=4, max_new_tokens=8, scale_rewards=scale, seed=1)
    trainer = make_trainer(world_pico, problems(), cfg, tmp_path / "trainer")
    before = trainer.model.lm_head.weight.detach().clone()
    trainer.train()
    [batch] = trainer.clock.batches
    rewards = torch.tensor(batch["rewards"], dtype=torch.float64).view(-1, 4)
    assert 0 < rewards.sum() < rewards.numel()  # the seed gives mixed groups: something to learn from
    centred = rewards - rewards.mean(1, keepdim=True)
    # TRL's group std is the sample std (Bessel-corrected), with 1e-4 added.
    expected = centred / (rewards.std(1, keepdim=True) + 1e-4) if scale else centred
    assert batch["advantages"] == pytest.approx(expected.view(-1).tolist(), rel=1e-5, abs=1e-6)
    # On-policy the ratio is 1, so the loss is -A per token, pooled over all the batch's response tokens.
    adv, tokens = torch.tensor(batch["advantages"], dtype=torch.float64), torch.tensor(batch["tokens"])
    [row] = [h for h in trainer.state.log_history if "grpo/sample_s" in h]
    assert row["loss"] == pytest.approx(-(adv * tokens).sum().item() / tokens.sum().item(), rel=1e-4, abs=1e-6)
    assert not torch.equal(before, trainer.model.lm_head.weight)  # mixed groups do move the policy


@pytest.mark.parametrize("updates, epochs", [(4, 1), (2, 2), (1, 1)])
def test_each_optimizer_step_trains_on_its_own_share_of_one_sampled_batch(
    world_pico, tmp_path, monkeypatch, updates, epochs
):
    """`updates_per_batch: U` is U optimizer steps a pass over a sampled batch, each on a distinct 1/U of its
    completions, and `epochs_per_batch: E` passes: one generation per U x E steps. Each completion is tagged
    when sampled and the tags every micro-batch's loss reads are gathered by optimizer step."""
    graded_by(monkeypatch, parity)
    steps, completions = 8, 8
    cfg = GrpoConfig(
        lr=1e-2, steps=steps, batch_size=2, generations=4, max_new_tokens=6, micro_batch_size=1,
        updates_per_batch=updates, epochs_per_batch=epochs,
    )  # fmt: skip
    trainer = make_trainer(world_pico, problems(), cfg, tmp_path / "trainer")
    sampled, trained = [], {}
    generate, loss = trainer._generate_and_score_completions, trainer.compute_loss

    def tagged(inputs):
        out = generate(inputs)
        out["tag"] = torch.arange(len(sampled) * completions, (len(sampled) + 1) * completions)
        sampled.append(out["tag"].tolist())
        return out

    def read(model, inputs, *args, **kwargs):
        trained.setdefault(trainer.state.global_step, []).extend(inputs["tag"].tolist())
        return loss(model, inputs, *args, **kwargs)

    monkeypatch.setattr(trainer, "_generate_and_score_completions", tagged)
    monkeypatch.setattr(trainer, "compute_loss", read)
    trainer.train()
    per = updates * epochs
    assert len(sampled) == steps // per  # one generation per U x E optimizer steps
    assert sorted(trained) == list(range(steps))
    for step, tags in trained.items():
        batch = sampled[step // per]
        assert len(tags) == completions // updates and set(tags) <= set(batch)
        passing = range(step - step % updates, step - step % updates + updates)  # this pass's U steps
        if step % updates == 0:  # a pass's shares: disjoint, together the whole batch
            shares = [trained[s] for s in passing]
            assert sorted(t for share in shares for t in share) == sorted(batch)


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_the_reference_is_kept_in_bf16_where_the_run_computes_in_bf16(world_pico, tmp_path, precision):
    """The reference is only read: bf16 beside a bf16-autocast policy, whose master weights stay fp32."""
    from graftlab.train.precision import Precision

    cfg = GrpoConfig(lr=1e-3, steps=1, batch_size=1, generations=2, beta=0.5)
    trainer = make_trainer(world_pico, problems(), cfg, tmp_path / "trainer", precision=Precision(precision, "test"))
    assert trainer.model.dtype == torch.float32
    assert trainer.ref_model.dtype == (torch.bfloat16 if precision == "bf16" else torch.float32)


def test_the_kl_term_is_k3_weighted_by_the_importance_ratio(world_pico, tmp_path):
    cfg = GrpoConfig(lr=1e-3, steps=1, batch_size=1, generations=2, beta=0.5)
    trainer = make_trainer(world_pico, problems(), cfg, tmp_path / "trainer")
    assert trainer.ref_model is not None  # beta > 0 loads the post model as the reference
    model = trainer.model.train()
    with torch.no_grad():  # a policy that has moved away from the reference
        for p in model.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=torch.Generator().manual_seed(0)))
    gen = torch.Generator().manual_seed(1)
    prompt = torch.randint(0, 80, (2, 5), generator=gen)
    completion = torch.randint(0, 80, (2, 4), generator=gen)
    mask = torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0]])
    ref = AutoModelForCausalLM.from_pretrained(world_pico, dtype=torch.float32)

    def logps(net):
        logits = net(input_ids=torch.cat([prompt, completion], 1)).logits[:, 4:-1]
        return logits.log_softmax(-1).gather(-1, completion[..., None]).squeeze(-1)

    with torch.no_grad():
        ref_logp = logps(ref)
    inputs = {
        "prompt_ids": prompt,
        "prompt_mask": torch.ones_like(prompt),
        "completion_ids": completion,
        "completion_mask": mask,
        "advantages": torch.zeros(2),  # the KL term alone
        "ref_per_token_logps": ref_logp,
        "num_items_in_batch": mask.sum(),
    }
    trainer.current_gradient_accumulation_steps = 1
    loss = trainer.compute_loss(model, inputs)
    grads = torch.autograd.grad(loss, list(model.parameters()))
    logp = logps(model)
    k3 = torch.exp(ref_logp - logp) - (ref_logp - logp) - 1
    assert loss.item() == pytest.approx((0.5 * (k3 * mask).sum() / mask.sum()).item(), rel=1e-5)
    assert loss.item() > 1e-4
    # Its gradient is k3's times the ratio pi / pi_old (1 in value, not in gradient): (logp - ref) grad logp.
    hand = 0.5 * (k3 * torch.exp(logp - logp.detach()) * mask).sum() / mask.sum()
    for got, want in zip(grads, torch.autograd.grad(hand, list(model.parameters()), retain_graph=True)):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-7)
    # k3 alone would give (1 - ref / pi) grad logp, the forward KL's gradient: another direction.
    plain = torch.autograd.grad(0.5 * (k3 * mask).sum() / mask.sum(), list(model.parameters()))
    assert any(not torch.allclose(p, g, atol=1e-6) for p, g in zip(plain, grads))


@pytest.fixture(scope="module")
def reference_run(world_pico, tmp_path_factory):
    out = tmp_path_factory.mktemp("grpo") / "run"
    with pytest.MonkeyPatch.context() as monkeypatch:
        graded_by(monkeypatch, parity)  # rewards that vary, so the weights move and resuming has a path to follow
        return out, train_grpo(world_pico, problems(), GrpoConfig(**RUN), out)


def test_a_run_writes_loadable_checkpoints_its_step_log_and_plot(reference_run):
    out, log = reference_run
    assert {p.name for p in out.parent.iterdir()} == {"run"}  # no scratch directory left beside it
    assert {p.name for p in out.iterdir()} == {"step~2", "step~3", "steps.jsonl", "training.png"}
    steps = [json.loads(line) for line in (out / "steps.jsonl").open()]
    assert steps == log and [s["step"] for s in steps] == [1, 2, 3]
    assert all(COLUMNS <= set(s) for s in steps)
    assert all(s["response_tokens"] == s["response_len"] * 6 and s["sample_s"] > 0 for s in steps)
    AutoModelForCausalLM.from_pretrained(out / "step~3")
    assert {"tokenizer.json", "config.json", "model.safetensors"} <= {p.name for p in (out / "step~2").iterdir()}
    record = json.loads((out / "step~2/graftlab.json").read_text())
    assert record["step"] == 2 and record["params"]["generations"] == 3
    assert (out / "training.png").read_bytes()[:4] == b"\x89PNG"
    assert any(0 < s["reward"] < 1 for s in steps)


class Preempted(Exception):
    pass


def test_a_run_stopped_after_a_trainer_checkpoint_resumes_to_the_same_weights(
    reference_run, world_pico, tmp_path, monkeypatch
):
    from graftlab.train import resume as rs

    make = rs.trainer_callback

    def failing(resume):
        cb = make(resume)
        on_save = cb.on_save

        def save(args, state, control, **kw):
            on_save(args, state, control, **kw)
            if state.global_step == 2:
                raise Preempted

        cb.on_save = save
        return cb

    graded_by(monkeypatch, parity)
    state = tmp_path / "resume"
    monkeypatch.setattr(rs, "trainer_callback", failing)
    with pytest.raises(Preempted):
        train_grpo(world_pico, problems(), GrpoConfig(**RUN), tmp_path / "run", resume=Resume(state, 0))
    assert not (tmp_path / "run").exists() and (state / "checkpoint-2" / "optimizer.pt").exists()
    monkeypatch.setattr(rs, "trainer_callback", make)
    log = train_grpo(world_pico, problems(), GrpoConfig(**RUN), tmp_path / "run", resume=Resume(state, 0))
    assert [s["step"] for s in log] == [1, 2, 3] and not state.exists()
    reference, _ = reference_run
    post = load_file(world_pico / "model.safetensors")
    moved = load_file(reference / "step~3" / "model.safetensors")
    assert not all(torch.equal(post[k], moved[k]) for k in post)
    for step in ("step~2", "step~3"):
        want, got = (
            load_file(reference / step / "model.safetensors"),
            load_file(tmp_path / "run" / step / "model.safetensors"),
        )
        assert all(torch.equal(want[k], got[k]) for k in want)
