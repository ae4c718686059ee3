"""SDPO: siblings as demonstrations, never the rollout itself; masking; the answer-only mask; the loss against
an independent computation; the importance-weight clip; a teacher that gets no gradient; a whole run."""

import json

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from graftlab.errors import GraftlabError
from graftlab.sampling import response_logits
from graftlab.tasks import TASKS, THINK_CLOSE, Task, chat_completion, extract_answer
from graftlab.train.divergence import generalized_divergence
from graftlab.train.sdpo import (
    Rollout,
    Sdpo,
    SdpoConfig,
    answer_mask,
    demonstrations,
    feedback_message,
    train_sdpo,
)


@pytest.fixture(scope="module")
def pair(world_pico):
    tok = AutoTokenizer.from_pretrained(world_pico)
    load = lambda: AutoModelForCausalLM.from_pretrained(world_pico, dtype=torch.float32)  # noqa: E731
    return tok, load


def sdpo(pair, **cfg) -> Sdpo:
    tok, load = pair
    student, teacher = load(), load()
    with torch.no_grad():  # a teacher that differs from the student, so the loss is not zero
        for p in teacher.parameters():
            p.add_(0.05 * torch.randn_like(p))
    return Sdpo(student, teacher, tok, SdpoConfig(**({"lr": 1e-2, "steps": 4} | cfg)))


def test_a_rollout_is_never_its_own_demonstration():
    # Only rollout 1 succeeded: it has no sibling to learn from; every other rollout learns from it.
    assert demonstrations(["a", "b", "c"], [False, True, False]) == ["b", None, "b"]
    # Two successes: each takes the first successful rollout other than itself.
    assert demonstrations(["a", "b", "c", "d"], [True, False, True, False]) == ["c", "a", "a", "a"]
    assert demonstrations(["a", "b"], [False, False]) == [None, None]


def test_the_answer_mask_covers_the_tokens_after_the_last_think_close():
    close = 7
    assert answer_mask([1, close, 2, 3], close) == [0, 0, 1, 1]
    assert answer_mask([close, 1, close, 2], close) == [0, 0, 0, 1]
    assert answer_mask([1, 2, 3], close) == [0, 0, 0]  # thinking never closed: no answer
    assert answer_mask([1, 2, 3], None) == [1, 1, 1]  # a task without a think block: all answer


def group(pair, tokens: str, correct_texts: dict[int, str], feedback=False, thinking="strip"):
    """The rollouts of one problem whose samples are given as texts (4 of them), through Sdpo._group."""
    tok, _ = pair
    run = sdpo(pair, tokens=tokens, thinking=thinking, feedback=feedback)
    texts = [chat_completion("1+1=2", str(i)) for i in range(4)]
    for i, t in correct_texts.items():
        texts[i] = t
    prompt = tok("2+3=", add_special_tokens=False)["input_ids"]
    samples = [(prompt, tok(t, add_special_tokens=False)["input_ids"]) for t in texts]
    task = TASKS["arith"]
    return run, run._group({"prompt": "2+3=", "answer": "5"}, task, samples)


def test_group_masks_rollouts_without_a_successful_sibling_and_prompts_the_others(pair):
    tok, _ = pair
    run, rollouts = group(pair, "answer", {2: chat_completion("2+3=5", "5")})
    assert [r.correct for r in rollouts] == [False, False, True, False]
    # The successful rollout has no successful sibling: masked out, zero tokens distilled.
    assert rollouts[2].teacher_prompt is None and sum(rollouts[2].mask) == 0
    for i in (0, 1, 3):
        reprompt = tok.decode(rollouts[i].teacher_prompt)
        assert "A correct solution:\n5" in reprompt  # the sibling's answer, thinking stripped
        assert "2+3=5" not in reprompt.split("2+3=", 1)[1]  # the sibling's thinking is not shown
        assert reprompt.rstrip().endswith("Correctly solve the original question.<|im_end|>\n<|im_start|>assistant")
        # Answer tokens only: what follows </think>.
        close = rollouts[i].response.index(tok.convert_tokens_to_ids(THINK_CLOSE))
        assert rollouts[i].mask == [0] * (close + 1) + [1] * (len(rollouts[i].response) - close - 1)


def test_sdpo_cot_distils_every_token_and_feedback_names_the_answer(pair):
    tok, _ = pair
    run, rollouts = group(pair, "all", {0: chat_completion("2+3=5", "5")}, feedback=True)
    assert all(r.mask == [1] * len(r.response) for r in rollouts[1:])
    reprompt = tok.decode(rollouts[1].teacher_prompt)
    assert "Feedback on your answer: Your final answer 1 is incorrect." in reprompt
    assert feedback_message(None, False).startswith("Your response never closed")


@pytest.mark.parametrize("tokens", ["answer", "all"])
def test_keep_shows_the_siblings_thinking_and_strip_its_answer_alone(pair, tokens):
    tok, _ = pair
    sibling = chat_completion("2+3=5 carry 0", "5")
    for thinking, shows in (("strip", False), ("keep", True)):
        _, rollouts = group(pair, tokens, {2: sibling, 3: sibling}, thinking=thinking)
        reprompt = tok.decode(rollouts[0].teacher_prompt)
        assert "A correct solution:\n" in reprompt and ("carry 0" in reprompt) == shows, thinking
        assert (THINK_CLOSE in reprompt.split("A correct solution:")[1]) == shows


@pytest.mark.parametrize("tokens", ["answer", "all"])
@pytest.mark.parametrize("thinking", ["strip", "keep"])
def test_without_a_think_block_every_density_is_the_same(pair, tokens, thinking):
    """A task without thinking (knowledge, an Instruct model) samples no think block: whatever the switches,
    every response token is distilled and the teacher reads the same demonstration, so `sdpo` and
    `sdpo_cot` are one method there (the paper's Instruct-model equivalence)."""
    tok, _ = pair
    plain = Task("plain", prompt=str, grade=lambda turn, answer: turn.endswith(answer), reference=str, thinking=False)
    prompt = tok("2+3=", add_special_tokens=False)["input_ids"]
    samples = [(prompt, tok(t, add_special_tokens=False)["input_ids"]) for t in ("4", "5", "5 ok", "6")]

    def rollouts(**switches):
        return sdpo(pair, **switches)._group({"prompt": "2+3=", "answer": "5"}, plain, samples)

    got, reference = rollouts(tokens=tokens, thinking=thinking), rollouts(tokens="all", thinking="strip")
    assert [r.mask for r in got] == [r.mask for r in reference]
    assert [r.teacher_prompt for r in got] == [r.teacher_prompt for r in reference]
    taught = [r for r in got if r.teacher_prompt is not None]
    assert taught and all(r.mask == [1] * len(r.response) for r in taught)


def rollouts_for(pair, n=4, masked=(1,)):
    """Rollouts with made-up responses, some masked out (no teacher prompt)."""
    tok, _ = pair
    out = []
    for i in range(n):
        prompt = tok(f"{i}+1=", add_special_tokens=False)["input_ids"]
        response = tok(chat_completion("x", str(i + 10)), add_special_tokens=False)["input_ids"]
        teacher = None if i in masked else tok(f"{i}+1= hint {i + 1}", add_special_tokens=False)["input_ids"]
        mask = [0] * len(response) if teacher is None else [0, 0] + [1] * (len(response) - 2)
        out.append(Rollout(prompt, response, "", False, teacher, mask, 3))
    return out


@pytest.mark.parametrize(("top_k", "k"), [(10, 10), (100, 84)])  # 100 is clamped to the vocabulary, 84
def test_the_loss_is_the_pooled_divergence_over_distilled_tokens_of_unmasked_rollouts(pair, top_k, k):
    run = sdpo(pair, micro_batch_size=2, batch_size=2, generations=2, top_k=top_k)
    rollouts = rollouts_for(pair)
    taught = [r for r in rollouts if r.teacher_prompt is not None]
    with torch.no_grad():
        s, _ = response_logits(run.student, [r.prompt for r in taught], [r.response for r in taught])
        t, _ = response_logits(run.teacher, [r.teacher_prompt for r in taught], [r.response for r in taught])
        mask = torch.zeros(s.shape[:2])
        for i, r in enumerate(taught):
            mask[i, : len(r.mask)] = torch.tensor(r.mask, dtype=torch.float)
        expected = generalized_divergence(s, t, mask, 0.5, "student_topk_tail", k).item()
    out = run.update(rollouts, None)
    assert out["loss"] == pytest.approx(expected, rel=1e-5)
    assert out["js"] == pytest.approx(expected, rel=1e-5)  # alpha 0.5: the loss is the JS
    assert out["distilled_tokens"] == int(mask.sum())


def test_masked_rollouts_get_zero_loss_and_an_all_masked_update_changes_nothing(pair):
    # The masked rollout's response changes: the loss and its gradient do not.
    a, b = sdpo(pair), sdpo(pair)
    b.teacher.load_state_dict(a.teacher.state_dict())
    ra = rollouts_for(pair)
    rb = list(ra)
    rb[1] = ra[1]._replace(response=ra[1].response[::-1])
    la, lb = a.update(ra, None)["loss"], b.update(rb, None)["loss"]
    assert la == pytest.approx(lb, rel=1e-6)
    for p, q in zip(a.student.parameters(), b.student.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-7)
    # Every rollout masked: no step at all.
    c = sdpo(pair)
    before = [p.clone() for p in c.student.parameters()]
    out = c.update(rollouts_for(pair, masked=(0, 1, 2, 3)), None)
    assert out["loss"] == 0 and out["js"] is None
    assert all(torch.equal(p, q) for p, q in zip(before, c.student.parameters()))


def test_the_importance_weight_is_clipped_on_reused_batches(pair):
    run = sdpo(pair)
    rollouts = rollouts_for(pair, masked=())
    now = run.sampled_logprobs(rollouts)
    plain = sdpo(pair)
    plain.teacher.load_state_dict(run.teacher.state_dict())
    base = plain.update(rollouts, None)["loss"]
    # Sampled 5x less likely than now: the ratio 5 is clipped to 2, the loss doubles.
    assert run.update(rollouts, [lp - torch.log(torch.tensor(5.0)) for lp in now])["loss"] == pytest.approx(
        2 * base, rel=1e-5
    )
    # Sampled 2x more likely: the ratio 0.5 is not clipped.
    again = sdpo(pair)
    again.teacher.load_state_dict(run.teacher.state_dict())
    half = again.update(rollouts, [lp + torch.log(torch.tensor(2.0)) for lp in now])["loss"]
    assert half == pytest.approx(0.5 * base, rel=1e-5)


@pytest.mark.parametrize("shift", [-0.3, 0.0, 0.4])  # sampled less likely, as likely, more likely than now
def test_the_importance_weight_scales_the_gradient_but_is_not_differentiated(pair, shift):
    """On a reused batch the per-token loss is w d, w = pi_now / pi_sampled clipped: the gradient must be
    w grad d with w a constant, as the official code detaches it (differentiating w too gives the same loss
    value and another gradient). Checked against autograd on the formula with w computed apart."""
    from graftlab.train.divergence import token_divergence

    run = sdpo(pair)
    rollouts = rollouts_for(pair, masked=())
    sampled = [lp + shift for lp in run.sampled_logprobs(rollouts)]
    total = sum(sum(r.mask) for r in rollouts)
    run.student.zero_grad(set_to_none=True)
    run._micro_step(rollouts, sampled, total, {"loss": 0.0, "entropy_sum": 0.0, "tokens": 0, "js_sum": 0.0})
    got = [p.grad.clone() for p in run.student.parameters()]

    s_logits, _ = response_logits(run.student, [r.prompt for r in rollouts], [r.response for r in rollouts])
    with torch.no_grad():
        t_logits, _ = response_logits(run.teacher, [r.teacher_prompt for r in rollouts], [r.response for r in rollouts])
        width = t_logits.shape[1]
        logp = torch.log_softmax(s_logits[:, :width].float(), -1)
        weight = torch.zeros(len(rollouts), width)
        mask = torch.zeros(len(rollouts), width)
        for i, r in enumerate(rollouts):
            n = len(r.response)
            now = logp[i, torch.arange(n), torch.tensor(r.response)]
            weight[i, :n] = torch.exp(now - sampled[i][:n]).clamp(max=run.cfg.is_clip)
            mask[i, :n] = torch.tensor(r.mask, dtype=torch.float)
    d = token_divergence(s_logits[:, :width], t_logits, run.cfg.alpha, "student_topk_tail", run.k)
    expected = torch.autograd.grad((d * weight * mask).sum() / total, list(run.student.parameters()), allow_unused=True)
    assert not torch.allclose(weight[mask.bool()], torch.ones(int(mask.sum()))) or shift == 0.0
    for g, e in zip(got, expected):
        torch.testing.assert_close(g, torch.zeros_like(g) if e is None else e, rtol=1e-4, atol=1e-7)


def test_the_teacher_gets_no_gradient_and_a_frozen_teacher_stays(pair):
    run = sdpo(pair)
    before = {k: v.clone() for k, v in run.teacher.state_dict().items()}
    run.update(rollouts_for(pair), None)
    assert all(p.grad is None and not p.requires_grad for p in run.teacher.parameters())
    assert any(p.grad is not None for p in run.student.parameters())
    assert all(torch.equal(before[k], v) for k, v in run.teacher.state_dict().items())


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"teacher": "ema:2"}, "teacher schedule"),
        ({"alpha": 1.5}, "alpha"),
        ({"generations": 1}, "generations"),
        ({"updates_per_batch": 3}, "does not divide"),
        ({"template": "{prompt}{solution}"}, r"lacks the placeholder\(s\) \['{feedback}'\]"),
        ({"save_steps": (9,)}, "save_steps"),
    ],
)
def test_bad_config_is_a_clear_error(kwargs, message):
    with pytest.raises(GraftlabError, match=message):
        SdpoConfig(**({"lr": 1e-3, "steps": 4, "batch_size": 2, "generations": 4} | kwargs))


def test_a_run_writes_checkpoints_its_step_log_and_curves(world_pico, tmp_path, monkeypatch):
    # A verifier an untrained model passes about half the time: a response with an even number of
    # characters is "correct", so groups have successes and failures.
    coin = Task("coin", prompt=str, grade=lambda completion, answer: len(completion) % 2 == 0, reference=str)
    monkeypatch.setitem(TASKS, "coin", coin)
    problems = [{"prompt": f"{i}+{i}=", "answer": str(2 * i), "task": "coin"} for i in range(6)]
    cfg = SdpoConfig(
        lr=1e-3,
        steps=4,
        teacher="ema:0.5",
        batch_size=2,
        generations=4,
        updates_per_batch=2,
        save_steps=(2, 4),
    )
    log = train_sdpo(world_pico, problems, cfg, tmp_path / "run")
    assert {p.name for p in (tmp_path / "run").iterdir()} == {"step~2", "step~4", "steps.jsonl", "training.png"}
    lines = [json.loads(x) for x in (tmp_path / "run" / "steps.jsonl").open()]
    assert lines == log and [s["step"] for s in lines] == [1, 2, 3, 4]
    for key in (
        "loss",
        "reward",
        "masked_share",
        "entropy",
        "js",
        "response_len",
        "repeated_rate",
        "sample_s",
        "update_s",
    ):
        assert key in lines[0]
    assert lines[0]["sample_s"] > 0 and lines[1]["sample_s"] == 0  # the second update reuses the batch
    assert 0 < sum(s["masked_share"] for s in lines) / 4 < 1
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "run" / "step~4")
    post = AutoModelForCausalLM.from_pretrained(world_pico)
    assert any(not torch.equal(a, b) for a, b in zip(model.parameters(), post.parameters()))


def test_rollouts_are_sampled_by_vllm_with_the_students_current_weights(vllm_world, monkeypatch):
    from tests.test_sampling_vllm import ENGINE, FAKE, calls

    for key in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.setenv(key, "x")
        monkeypatch.delenv(key)
    monkeypatch.syspath_prepend(str(FAKE))
    import sys

    sys.modules.pop("vllm", None)
    import vllm

    vllm.CALLS.clear()
    monkeypatch.setattr(vllm, "RESPOND", vllm._default_response)
    try:
        tok = AutoTokenizer.from_pretrained(vllm_world)
        student, teacher = (AutoModelForCausalLM.from_pretrained(vllm_world) for _ in range(2))
        cfg = SdpoConfig(lr=1e-2, steps=2, batch_size=2, generations=2, max_new_tokens=8, backend=ENGINE)
        run = Sdpo(student, teacher, tok, cfg)
        problems = [{"prompt": p, "answer": "1", "task": "arith"} for p in ("3*4=", "5*6=")]
        sums = []
        for step in (1, 2):
            sums.append({n: float(p.detach().double().sum()) for n, p in student.named_parameters()})
            rollouts = run.sample(problems, step)
            assert len(rollouts) == 4
            with torch.no_grad():  # stands in for an update: the engine must see the new weights
                next(student.parameters()).add_(1.0)
        assert [name for name, _ in vllm.CALLS] == ["init"] + ["reload_weights", "reset_prefix_cache", "generate"] * 2
        assert calls(vllm, "reload_weights") == sums
        assert all(g["params"].n == 2 for g in calls(vllm, "generate"))  # G rollouts of each problem
    finally:
        sys.modules.pop("vllm", None)


@pytest.fixture(scope="module")
def vllm_world(tmp_path_factory):
    from graftlab.world import build
    from graftlab.world.tokenizer import build_tokenizer

    root = tmp_path_factory.mktemp("sdpo-vllm")
    tok = build_tokenizer()
    build.init_model(
        tok, dict(hidden_size=16, intermediate_size=32, layers=1, heads=2, kv_heads=1, max_positions=128), seed=0
    ).save_pretrained(root)
    tok.save_pretrained(root)
    return root


# A run as its own process, saving its state after every step and SIGKILLing itself after the save of
# step `kill_at`: a preemption with no cleanup of any kind.
KILLED = """
import json, os, signal, sys
from pathlib import Path
from graftlab.tasks import TASKS, Task
from graftlab.train import resume as rs
from graftlab.train.sdpo import SdpoConfig, train_sdpo

model, out, state_dir, cfg, kill_at = sys.argv[1:]
TASKS["coin"] = Task("coin", prompt=str, grade=lambda c, a: len(c) % 2 == 0, reference=str)
save_state = rs.save_state

def save(r, state):
    save_state(r, state)
    if state["step"] == int(kill_at):
        os.kill(os.getpid(), signal.SIGKILL)

rs.save_state = save
problems = [{"prompt": f"{i}+{i}=", "answer": "0", "task": "coin"} for i in range(6)]
train_sdpo(model, problems, SdpoConfig(**json.loads(cfg)), out, resume=rs.Resume(Path(state_dir), 0))
"""


@pytest.mark.workflow  # a real process killed, or several at once: the slow tier
def test_a_killed_run_resumes_with_its_ema_teacher_and_ends_on_the_same_weights(world_pico, tmp_path, monkeypatch):
    import subprocess
    import sys

    from safetensors.torch import load_file

    cfg = dict(lr=1e-2, steps=4, teacher="ema:0.5", batch_size=2, generations=4, save_steps=[4])
    coin = Task("coin", prompt=str, grade=lambda c, a: len(c) % 2 == 0, reference=str)
    monkeypatch.setitem(TASKS, "coin", coin)
    problems = [{"prompt": f"{i}+{i}=", "answer": "0", "task": "coin"} for i in range(6)]
    reference = train_sdpo(world_pico, problems, SdpoConfig(**(cfg | {"save_steps": (4,)})), tmp_path / "reference")
    args = [str(world_pico), str(tmp_path / "run"), str(tmp_path / "state"), json.dumps(cfg)]
    run = lambda kill: subprocess.run([sys.executable, "-c", KILLED, *args, str(kill)], capture_output=True, text=True)  # noqa: E731
    assert run(2).returncode < 0 and not (tmp_path / "run").exists()
    rerun = run(0)
    assert rerun.returncode == 0, rerun.stderr[-2000:]
    assert "resume: SDPO continues after step 2" in rerun.stdout
    log = [json.loads(x) for x in (tmp_path / "run" / "steps.jsonl").open()]
    assert [s["loss"] for s in log] == [s["loss"] for s in reference]  # steps 3-4 read the restored teacher
    a, b = (
        load_file(tmp_path / "reference/step~4/model.safetensors"),
        load_file(tmp_path / "run/step~4/model.safetensors"),
    )
    assert all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.workflow
def test_the_smoke_run_trains_grpo_and_sdpo_and_reports_them(smoke):
    import polars as pl

    results = smoke / "results" / "expert"
    summary = pl.read_parquet(results / "summary.parquet")
    rows = summary.filter(pl.col("method").is_in(["grpo", "sdpo", "sdpo_cot"]))
    assert sorted(rows["method"].to_list()) == ["grpo", "sdpo", "sdpo", "sdpo", "sdpo_cot"]
    assert set(rows.filter(pl.col("method") == "sdpo")["teacher"]) == {"frozen", "ema:0.05", "refresh:0.5"}
    assert rows["step"].to_list() == ["2"] * 5 and rows["new"].is_not_null().all()
    for run in ("grpo/post/lr~1e-3", "sdpo/post/teacher~refresh:0.5/lr~1e-3", "sdpo_cot/post/teacher~ema:0.05/lr~1e-3"):
        assert (results / run / "training.png").stat().st_size > 0
        assert len((results / run / "steps.jsonl").read_text().splitlines()) == 2
    gain = pl.read_parquet(results / "gain_forgetting.parquet")
    assert {"grpo", "sdpo", "sdpo_cot"} <= set(gain["method"]) and (results / "gain_forgetting.png").exists()
    latency = pl.read_parquet(results / "latency_steps.parquet")
    assert {"GRPO", "SDPO", "SDPO-CoT"} <= set(latency["what"])
    sensitivity = pl.read_parquet(results / "sensitivity.parquet")
    assert {"grpo", "sdpo", "sdpo_cot"} <= set(sensitivity["method"])


def test_each_rollouts_teacher_reads_its_first_successful_siblings_answer_never_its_own(pair):
    """Five rollouts with five different answers, a verifier that accepts three of them: each reprompt
    holds the answer of the first successful rollout other than itself, thinking stripped, and no other
    rollout's answer, its own included."""
    tok, _ = pair
    run = sdpo(pair)
    accepted = {"11", "13", "14"}
    task = Task("picky", prompt=str, grade=lambda turn, answer: extract_answer(turn) in accepted, reference=str)
    texts = [chat_completion(f"think {i}", str(10 + i)) for i in range(5)]
    prompt = tok("2+3=", add_special_tokens=False)["input_ids"]
    samples = [(prompt, tok(t, add_special_tokens=False)["input_ids"]) for t in texts]
    rollouts = run._group({"prompt": "2+3=", "answer": "5"}, task, samples)
    assert [r.correct for r in rollouts] == [False, True, False, True, True]
    # Written out: rollout i's demonstration is the first j != i with a success.
    expected = ["11", "13", "11", "11", "11"]
    for i, (r, demo) in enumerate(zip(rollouts, expected)):
        reprompt = tok.decode(r.teacher_prompt)
        shown = [a for a in map(str, range(10, 15)) if f"A correct solution:\n{a}" in reprompt]
        assert shown == [demo], i
        assert "think" not in reprompt and str(10 + i) not in reprompt.replace(f"solution:\n{demo}", "")


@pytest.mark.parametrize(
    ("schedule", "steps", "updates"),
    # frozen: test_the_teacher_gets_no_gradient_and_a_frozen_teacher_stays
    [("ema:0.25", 3, 1), ("ema:0.25", 4, 2), ("refresh:0.5", 4, 1), ("refresh:0.5:0.5", 4, 1), ("refresh:0.25", 4, 2)],
)
def test_the_teacher_a_run_hands_on_follows_its_schedule_at_the_right_steps(
    world_pico, tmp_path, monkeypatch, schedule, steps, updates
):
    """The teacher a run writes, by hand from the student's checkpoint after each sampled batch's last step
    (U = `updates` steps a batch): ema:R, theta_T <- (1 - R) theta_T + R theta_S once a batch;
    refresh:G(:gamma), theta_T <- gamma theta_S + (1 - gamma) theta_T after a batch holding a multiple of
    round(G x steps) below the last step, frozen in between."""
    from safetensors.torch import load_file

    # Without a think block every rollout has a final answer, so every success can be a sibling's demonstration.
    coin = Task("coin", prompt=str, grade=lambda turn, answer: len(turn) % 2 == 0, reference=str, thinking=False)
    monkeypatch.setitem(TASKS, "coin", coin)
    problems = [{"prompt": f"{i}+{i}=", "answer": str(2 * i), "task": "coin"} for i in range(4)]
    cfg = SdpoConfig(
        lr=1e-2,
        steps=steps,
        teacher=schedule,
        batch_size=2,
        generations=4,
        max_new_tokens=12,
        updates_per_batch=updates,
        save_steps=tuple(range(1, steps + 1)),
    )
    train_sdpo(world_pico, problems, cfg, tmp_path / "run", keep_teacher=True)
    weights = lambda path: {k: v.double() for k, v in load_file(path / "model.safetensors").items()}  # noqa: E731
    post = weights(world_pico)
    students = [weights(tmp_path / "run" / f"step~{s}") for s in range(1, steps + 1)]
    # Every step moved the student (each had a rollout with a successful sibling): a schedule applied at
    # the wrong step would show.
    for before, after in zip([post, *students], students):
        assert any(not torch.equal(before[k], after[k]) for k in post)
    teacher = dict(post)
    gamma = float(schedule.split(":")[2]) if schedule.count(":") == 2 else 1.0
    every = round(float(schedule.split(":")[1]) * steps)
    for step, student in enumerate(students, start=1):
        if step % updates:
            continue  # mid-batch: the teacher waits for the batch's last step
        if schedule.startswith("ema:"):
            teacher = {k: 0.75 * teacher[k] + 0.25 * student[k] for k in teacher}
        elif any(s % every == 0 and s < steps for s in range(step - updates + 1, step + 1)):
            teacher = {k: gamma * student[k] + (1 - gamma) * teacher[k] for k in teacher}
    got = weights(tmp_path / "run" / "teacher")
    assert got.keys() == post.keys()
    for k in post:
        torch.testing.assert_close(got[k], teacher[k], rtol=0, atol=1e-6, msg=k)
