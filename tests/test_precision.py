"""Training precision is decided from the config and the hardware, set explicitly in every trainer's
arguments and written to the job's log."""

import polars as pl
import pytest
import torch

from graftlab.tasks import arith
from graftlab.train import precision as prec
from graftlab.train.precision import Precision, choose, native_bf16_flags
from graftlab.world import build
from graftlab.world.tokenizer import build_tokenizer

ARCH = dict(hidden_size=16, intermediate_size=32, layers=1, heads=2, kv_heads=1, max_positions=256)
AVX2 = "processor\t: 0\nflags\t\t: fpu sse2 avx avx2 fma\n"
AVX512_BF16 = "processor\t: 0\nflags\t\t: fpu sse2 avx avx2 avx512f avx512_bf16\n"
AMX = "processor\t: 0\nflags\t\t: fpu avx2 avx512f amx_bf16 amx_tile\n"
ARM = "processor\t: 0\nFeatures\t: fp asimd bf16\n"


def cpuinfo(tmp_path, text):
    path = tmp_path / "cpuinfo"
    path.write_text(text)
    return path


@pytest.mark.parametrize(
    "text, setting, name, reason",
    [
        (AVX2, "auto", "fp32", "cpu without native bf16"),
        (AVX2, "bf16", "fp32", "cpu without native bf16"),
        (AVX512_BF16, "auto", "fp32", "auto means fp32 even with native bf16"),
        (AVX512_BF16, "bf16", "bf16", "native bf16 (avx512_bf16)"),
        (AMX, "bf16", "bf16", "native bf16 (amx_bf16)"),
        (AMX, "fp32", "fp32", "asked for fp32"),
        (ARM, "bf16", "fp32", "cpu flags unreadable"),
    ],
)
def test_a_cpu_trains_in_bf16_only_when_native_and_asked_for(tmp_path, text, setting, name, reason):
    choice = choose(setting, cuda=False, cpuinfo=cpuinfo(tmp_path, text))
    assert choice.name == name and reason in choice.reason


def test_unreadable_cpuinfo_means_fp32(tmp_path):
    assert native_bf16_flags(tmp_path / "absent") is None
    choice = choose("bf16", cuda=False, cpuinfo=tmp_path / "absent")
    assert choice == Precision("fp32", "cpu flags unreadable")


@pytest.mark.parametrize(
    "setting, cuda_bf16, name",
    [("auto", True, "bf16"), ("bf16", True, "bf16"), ("fp32", True, "fp32"), ("auto", False, "fp32")],
)
def test_a_gpu_with_bf16_autocasts_unless_fp32_is_asked_for(tmp_path, setting, cuda_bf16, name):
    # The CPU's flags play no part on a GPU.
    assert choose(setting, cuda=True, cuda_bf16=cuda_bf16, cpuinfo=cpuinfo(tmp_path, AVX2)).name == name


def test_a_gpu_that_only_emulates_bf16_trains_in_fp32(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda including_emulation=True: including_emulation)
    assert choose("auto") == Precision("fp32", "cuda without bf16")


def test_unknown_setting_is_an_error():
    with pytest.raises(ValueError, match="precision must be one of"):
        choose("fp16", cuda=False)


def test_trainer_kwargs_set_both_flags_and_the_log_line_names_the_reason():
    fp32 = Precision("fp32", "cpu without native bf16")
    assert fp32.trainer_kwargs() == {"bf16": False, "fp16": False}
    assert Precision("bf16", "x").trainer_kwargs() == {"bf16": True, "fp16": False}
    assert fp32.log_line() == "precision: fp32 (cpu without native bf16)"


@pytest.fixture
def avx2_cpu(tmp_path, monkeypatch):
    """A CPU without native bf16 and no GPU, whatever this machine has."""
    monkeypatch.setattr(prec, "CPUINFO", cpuinfo(tmp_path, AVX2))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    path = tmp_path_factory.mktemp("pico")
    tok = build_tokenizer()
    build.init_model(tok, ARCH, seed=0).save_pretrained(path)
    tok.save_pretrained(path)
    return path


PROBLEMS = [arith.problem("mul", a, b) for a, b in ((12, 7), (34, 5), (56, 3), (78, 9))]


def sft_rows():
    return build.sft_rows(build_tokenizer(), PROBLEMS)


def test_sft_config_sets_bf16_false_on_a_cpu_without_native_bf16(avx2_cpu, model, tmp_path, monkeypatch):
    import trl

    from graftlab.train.sft import TrainConfig, train

    seen = {}

    class Stop(Exception):
        pass

    def capture(*, args, **_):
        seen["args"] = args
        raise Stop

    monkeypatch.setattr(trl, "SFTTrainer", capture)
    # TRL's own default would be bf16 = True: the config must override it, not leave it unset.
    assert trl.SFTConfig(output_dir=str(tmp_path), use_cpu=True).bf16 is True
    with pytest.raises(Stop):
        train(None, build_tokenizer(), sft_rows(), tmp_path / "work", TrainConfig(lr=1e-3, batch_size=2, steps=1))
    assert seen["args"].bf16 is False and seen["args"].fp16 is False


def test_grpo_config_sets_both_flags(tmp_path):
    from graftlab.synth.pedagogical import TeacherConfig, _grpo_args

    args = _grpo_args(TeacherConfig(group_size=2, prompts_per_step=1), tmp_path, Precision("fp32", "test"))
    assert args.bf16 is False and args.fp16 is False


def test_a_short_sft_run_logs_its_precision(avx2_cpu, model, tmp_path, capfd):
    from graftlab.train.sft import TrainConfig, finetune

    cfg = TrainConfig(lr=1e-3, batch_size=2, steps=2, save_steps=(2,))
    finetune(model, sft_rows(), cfg, [tmp_path / "out"])
    assert "precision: fp32 (cpu without native bf16)" in capfd.readouterr().out.splitlines()
    assert (tmp_path / "out" / "config.json").exists()


@pytest.mark.parametrize("name, dtype", [("fp32", torch.float32), ("bf16", torch.bfloat16)])
def test_opsd_computes_its_logits_in_the_chosen_precision_over_fp32_weights(model, monkeypatch, name, dtype):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    import graftlab.train.divergence as div
    from graftlab.synth.demonstrations import opsd_examples
    from graftlab.tasks import chat_completion
    from graftlab.train.opsd import Opsd, OpsdConfig

    seen, real = [], div.generalized_divergence

    def spy(student_logits, teacher_logits, *args):
        seen.append((student_logits.dtype, teacher_logits.dtype))
        return real(student_logits, teacher_logits, *args)

    monkeypatch.setattr(div, "generalized_divergence", spy)
    rows = [dict(p, completion=chat_completion(p["thinking"], p["answer"])) for p in PROBLEMS[:2]]
    batch = opsd_examples(pl.DataFrame(rows).select("id", "task", "prompt", "completion"))
    student, teacher = (AutoModelForCausalLM.from_pretrained(model) for _ in range(2))
    cfg = OpsdConfig(alpha=0.5, lr=1e-3, steps=1, batch_size=2, max_new_tokens=4)
    run = Opsd(student, teacher, AutoTokenizer.from_pretrained(model), cfg, Precision(name, "test"))
    record = next(run.steps(batch, range(1, 2)))
    assert seen == [(dtype, dtype)] and record["loss"] == record["loss"]  # not NaN
    assert all(p.dtype == torch.float32 for p in student.parameters())


@pytest.mark.parametrize("setting, saved", [("auto", torch.bfloat16), ("float32", torch.float32)])
def test_sft_trains_fp32_weights_from_a_bf16_checkpoint(avx2_cpu, model, tmp_path, setting, saved):
    """The master weights are fp32 whatever the checkpoint stores: written as fp32, the trained weights hold
    values no bf16 number has (an update far below bf16's spacing survives); `auto` writes them back in the
    checkpoint's bf16, and graftlab.json records that."""
    import json

    from transformers import AutoModelForCausalLM

    from graftlab.train.sft import TrainConfig, finetune

    AutoModelForCausalLM.from_pretrained(model).to(torch.bfloat16).save_pretrained(tmp_path / "bf16")
    build_tokenizer().save_pretrained(tmp_path / "bf16")
    # Three steps: the first, in warm-up, is at learning rate 0.
    cfg = TrainConfig(lr=1e-3, batch_size=2, steps=3, save_steps=(3,), save_dtype=setting)
    finetune(tmp_path / "bf16", sft_rows(), cfg, [tmp_path / "out"])
    tuned = AutoModelForCausalLM.from_pretrained(tmp_path / "out", dtype="auto")
    assert all(p.dtype == saved for p in tuned.parameters())
    assert json.loads((tmp_path / "out" / "graftlab.json").read_text())["save_dtype"] == str(saved).split(".")[1]
    if saved == torch.float32:
        assert any(not torch.equal(p, p.bfloat16().float()) for p in tuned.parameters())


def test_sft_under_bf16_autocast_keeps_fp32_master_weights(model, tmp_path, monkeypatch, capfd):
    """bf16 forced whatever the CPU (emulated bf16 is slow, not wrong): the Trainer autocasts but never
    casts the model, so the trained weights written as fp32 hold values that bf16 cannot."""
    from safetensors.torch import load_file

    from graftlab.train.sft import TrainConfig, finetune

    monkeypatch.setattr(prec, "choose", lambda setting: Precision("bf16", "forced by the test"))
    cfg = TrainConfig(lr=1e-3, batch_size=2, steps=3, save_steps=(3,), precision="bf16", save_dtype="float32")
    finetune(model, sft_rows(), cfg, [tmp_path / "out"])
    assert "precision: bf16 (forced by the test)" in capfd.readouterr().out
    weights = load_file(tmp_path / "out" / "model.safetensors")
    assert {w.dtype for w in weights.values()} == {torch.float32}
    off_grid = sum((w != w.bfloat16().float()).sum().item() for w in weights.values())
    assert off_grid > 0.9 * sum(w.numel() for w in weights.values())
