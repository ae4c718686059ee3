"""Grafting and the model-directory I/O under it: exact arithmetic, dtypes, shard layouts, refusals."""

from __future__ import annotations

import json
import shutil
import struct
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import build_pico_model, graft_args
from safetensors.torch import load_file, save_file

from graftlab.commands.cli import main
from graftlab.errors import GraftlabError
from graftlab.graft import graft
from graftlab.io.atomic import atomic_dir
from graftlab.io.fetch import copy_model_files
from graftlab.io.provenance import write_provenance
from graftlab.io.safetensors_io import SafetensorsWriter, read_header, tensor_index


def load_model(model_dir: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a model directory, read independently of graftlab's reader."""
    tensors: dict[str, torch.Tensor] = {}
    for file in sorted(model_dir.glob("*.safetensors")):
        tensors.update(load_file(file))
    return tensors


def expected_graft(post: Path, donor: Path, tuned: Path, lam: float) -> dict[str, torch.Tensor]:
    """post + lam * (tuned - donor) in fp32, not yet cast."""
    p, d, t = load_model(post), load_model(donor), load_model(tuned)
    return {name: p[name].float() + lam * (t[name].float() - d[name].float()) for name in p}


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    bits_a, bits_b = (t.reshape(-1).view(torch.uint8) for t in (a, b))
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(bits_a, bits_b)


@pytest.fixture(scope="module")
def fp32_trio(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, Path]:
    root = tmp_path_factory.mktemp("fp32")
    post = build_pico_model(root / "post", seed=1)
    donor = build_pico_model(root / "donor", seed=2)
    tuned = build_pico_model(root / "tuned", seed=3, base=donor, noise=0.01)
    return post, donor, tuned


@pytest.fixture(scope="module")
def bf16_trio(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, Path]:
    root = tmp_path_factory.mktemp("bf16")
    post = build_pico_model(root / "post", seed=4, dtype=torch.bfloat16)
    donor = build_pico_model(root / "donor", seed=5, dtype=torch.bfloat16)
    tuned = build_pico_model(root / "tuned", seed=6, dtype=torch.bfloat16, base=donor, noise=0.01)
    return post, donor, tuned


@pytest.mark.parametrize("lam", [0.5, 1.0, 2.0])
def test_graft_is_post_plus_scaled_delta_in_fp32(fp32_trio, tmp_path, lam):
    out = tmp_path / "out"
    counts = graft(*fp32_trio, lam, out)
    got, want = load_model(out), expected_graft(*fp32_trio, lam)
    assert got.keys() == want.keys() and len(got) == counts["tensors"] == counts["tensors_grafted"]
    for name, tensor in want.items():
        assert got[name].dtype == torch.float32
        torch.testing.assert_close(got[name], tensor, rtol=0, atol=1e-6, msg=name)
    assert any(not torch.equal(got[n], load_model(fp32_trio[0])[n]) for n in got)  # the update landed


def test_scale_zero_reproduces_post_bit_for_bit(bf16_trio, tmp_path):
    # Plant -0.0 in post: post + 0 * delta would turn it into +0.0, so only a true copy passes.
    post_dir = tmp_path / "post"
    shutil.copytree(bf16_trio[0], post_dir)
    post = load_file(post_dir / "model.safetensors")
    for tensor in post.values():
        tensor.view(-1)[0] = -0.0
    save_file(post, post_dir / "model.safetensors", metadata={"format": "pt"})
    graft(post_dir, *bf16_trio[1:], 0.0, tmp_path / "out")
    got = load_model(tmp_path / "out")
    assert got.keys() == post.keys()
    assert all(same_bits(got[n], post[n]) for n in post)


def test_bf16_output_is_fp32_result_cast_to_bf16(bf16_trio, tmp_path):
    graft(*bf16_trio, 0.75, tmp_path / "out")
    got = load_model(tmp_path / "out")
    for name, tensor in expected_graft(*bf16_trio, 0.75).items():
        assert same_bits(got[name], tensor.to(torch.bfloat16)), name


def test_row_blocks_give_the_same_bits_as_whole_tensors(bf16_trio, tmp_path):
    graft(*bf16_trio, 1.5, tmp_path / "whole")
    graft(*bf16_trio, 1.5, tmp_path / "rows", chunk_bytes=100)  # a few rows per block, ragged tail
    whole, rows = load_model(tmp_path / "whole"), load_model(tmp_path / "rows")
    assert all(same_bits(whole[n], rows[n]) for n in whole)


def test_inputs_with_different_shard_layouts(pico_model, tmp_path):
    post = pico_model("post", seed=1)
    donor = pico_model("donor", seed=2, max_shard_size="4KB")
    tuned = pico_model("tuned", seed=3, base=donor, noise=0.01, max_shard_size="9KB")
    assert len(set(tensor_index(post).values())) == 1
    assert 1 < len(set(tensor_index(tuned).values())) < len(set(tensor_index(donor).values()))
    graft(post, donor, tuned, 1.0, tmp_path / "out")
    got = load_model(tmp_path / "out")
    for name, tensor in expected_graft(post, donor, tuned, 1.0).items():
        torch.testing.assert_close(got[name], tensor, rtol=0, atol=1e-6, msg=name)


def test_output_loads_in_transformers_with_post_config_and_provenance(fp32_trio, tmp_path):
    from transformers import AutoModelForCausalLM

    out = tmp_path / "out"
    graft(*fp32_trio, 0.5, out)
    assert json.loads((out / "config.json").read_text()) == json.loads((fp32_trio[0] / "config.json").read_text())
    model = AutoModelForCausalLM.from_pretrained(out)
    want = expected_graft(*fp32_trio, 0.5)
    for name, param in model.state_dict().items():
        torch.testing.assert_close(param, want[name], rtol=0, atol=1e-6, msg=name)
    record = json.loads((out / "graftlab.json").read_text())
    assert record["inputs"]["donor_tuned"] == str(fp32_trio[2].resolve())
    assert record["params"] == {"scale": 0.5, "projection": "identity"}
    assert record["counts"]["tensors"] == len(want) and record["counts"]["shards"] == 1
    assert record["versions"]["torch"] == torch.__version__
    assert not list(tmp_path.glob(".out.*"))  # no temporary sibling left


def test_sharded_output_has_index_and_loads(fp32_trio, tmp_path):
    from transformers import AutoModelForCausalLM

    out = tmp_path / "out"
    counts = graft(*fp32_trio, 1.0, out, max_shard_bytes=8 << 10)
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert counts["shards"] == len(set(index["weight_map"].values())) > 1
    assert index["metadata"]["total_size"] == counts["bytes"]
    assert not (out / "model.safetensors").exists()
    model = AutoModelForCausalLM.from_pretrained(out)
    want = expected_graft(*fp32_trio, 1.0)
    for name, param in model.state_dict().items():
        torch.testing.assert_close(param, want[name], rtol=0, atol=1e-6, msg=name)


def test_merge_is_donor_equal_to_post(fp32_trio, tmp_path):
    post, _, _ = fp32_trio
    post_tuned = build_pico_model(tmp_path / "post_tuned", seed=7, base=post, noise=0.01)
    graft(post, post, post_tuned, 0.75, tmp_path / "out")
    got = load_model(tmp_path / "out")
    for name, tensor in expected_graft(post, post, post_tuned, 0.75).items():
        torch.testing.assert_close(got[name], tensor, rtol=0, atol=1e-6, msg=name)


def test_projection_receives_whole_tensors(fp32_trio, tmp_path):
    post = load_model(fp32_trio[0])
    seen = {}

    def zero(name: str, delta: torch.Tensor) -> torch.Tensor:
        seen[name] = tuple(delta.shape)
        return torch.zeros_like(delta)

    graft(*fp32_trio, 2.0, tmp_path / "out", chunk_bytes=64, project=zero)
    assert seen == {name: tuple(t.shape) for name, t in post.items()}
    got = load_model(tmp_path / "out")
    assert all(torch.equal(got[n], post[n]) for n in post)


def test_projection_runs_with_the_callers_threads_which_are_restored(fp32_trio, tmp_path):
    # The elementwise work runs on one thread; a projection (matrix products) must not be starved.
    previous = torch.get_num_threads()
    seen = set()

    def identity(name: str, delta: torch.Tensor) -> torch.Tensor:
        seen.add(torch.get_num_threads())
        return delta

    torch.set_num_threads(2)
    try:
        graft(*fp32_trio, 1.0, tmp_path / "out", project=identity)
        assert seen == {2} and torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(previous)


def run_cli(capsys, *args: str) -> tuple[int, str]:
    capsys.readouterr()  # drop what building the fixtures printed (progress bars)
    code = main(["graft", *args])
    return code, capsys.readouterr().err


def assert_one_line_error(code: int, err: str, *words: str, status: int = 1) -> None:
    assert code == status  # 2: the command line refused; 1: the data
    assert err.count("\n") == 1 and err.startswith("graftlab: error: "), err
    for word in words:
        assert word in err, err


def test_cli_grafts(capsys, fp32_trio, tmp_path):
    assert main(["graft", *graft_args(*fp32_trio, "1.0", tmp_path / "out")]) == 0
    assert "wrote" in capsys.readouterr().out
    assert (tmp_path / "out" / "model.safetensors").is_file()


def test_cli_refuses_negative_scale(capsys, fp32_trio, tmp_path):
    code, err = run_cli(capsys, *graft_args(*fp32_trio, "-0.5", tmp_path / "out"))
    assert_one_line_error(code, err, "--scale: must be >= 0", status=2)
    assert not (tmp_path / "out").exists()


def test_cli_refuses_missing_model(capsys, fp32_trio, tmp_path):
    missing = tmp_path / "no-such-model"
    code, err = run_cli(capsys, *graft_args(fp32_trio[0], missing, fp32_trio[2], "1", tmp_path / "out"))
    assert_one_line_error(code, err, str(missing))
    assert not (tmp_path / "out").exists()


def test_cli_refuses_different_hidden_size(capsys, fp32_trio, pico_model, tmp_path):
    wide = pico_model("wide", hidden_size=24)
    code, err = run_cli(capsys, *graft_args(fp32_trio[0], wide, fp32_trio[2], "1", tmp_path / "out"))
    assert_one_line_error(code, err, "donor", str(wide), "shape difference", "model.embed_tokens.weight [32, 24]")
    assert "donor_tuned" not in err  # only the model that differs is reported
    assert not (tmp_path / "out").exists()


def test_cli_refuses_different_vocabulary(capsys, fp32_trio, pico_model, tmp_path):
    big_vocab = pico_model("big_vocab", vocab_size=40)
    code, err = run_cli(capsys, *graft_args(*fp32_trio[:2], big_vocab, "1", tmp_path / "out"))
    assert_one_line_error(code, err, "donor_tuned", "vocabulary size 40", "lm_head.weight [40, 16]")
    assert not (tmp_path / "out").exists()


def test_vocabulary_named_from_shapes_when_configs_agree(fp32_trio, pico_model, tmp_path):
    big_vocab = pico_model("big_vocab", vocab_size=40)
    (big_vocab / "config.json").write_text((fp32_trio[1] / "config.json").read_text())
    with pytest.raises(GraftlabError, match="vocabulary differs: lm_head.weight has 40 rows vs post's 32"):
        graft(fp32_trio[0], big_vocab, fp32_trio[2], 1.0, tmp_path / "out")


def test_output_may_not_overwrite_an_input(fp32_trio):
    with pytest.raises(GraftlabError, match="is the post model .*: writing it would replace that input"):
        graft(*fp32_trio, 1.0, fp32_trio[0])


def test_python_m_graftlab_prints_no_traceback(fp32_trio, tmp_path):
    args = graft_args(*fp32_trio, "nan", tmp_path / "out")
    done = subprocess.run([sys.executable, "-m", "graftlab", "graft", *args], capture_output=True, text=True)
    assert done.returncode == 2
    assert done.stderr == "graftlab: error: argument --scale: must be finite, got 'nan'\n"
    assert not (tmp_path / "out").exists()


def test_writer_round_trip_in_row_blocks(tmp_path):
    tensors = {
        "w": torch.randn(5, 3, dtype=torch.float32),
        "b": torch.randn(7, dtype=torch.bfloat16),
        "ids": torch.arange(4, dtype=torch.int64).reshape(2, 2),
        "scalar": torch.tensor(3.5, dtype=torch.float16),
    }
    path = tmp_path / "x.safetensors"
    with SafetensorsWriter(path, [(n, t.dtype, t.shape) for n, t in tensors.items()]) as writer:
        writer.write("w", tensors["w"][:2])
        writer.write("w", tensors["w"][2:])
        for name in ("b", "ids", "scalar"):
            writer.write(name, tensors[name])
    loaded = load_file(path)
    assert loaded.keys() == tensors.keys()
    assert all(same_bits(loaded[n], t) for n, t in tensors.items())
    header = read_header(path)
    assert header["__metadata__"] == {"format": "pt"} and header["b"]["dtype"] == "BF16"
    assert struct.unpack("<Q", path.read_bytes()[:8])[0] % 8 == 0


def test_writer_refuses_what_was_not_declared(tmp_path):
    specs = [("a", torch.float32, (2, 2)), ("b", torch.bfloat16, (3,))]
    with SafetensorsWriter(tmp_path / "x.safetensors", specs) as writer:
        with pytest.raises(GraftlabError, match="tensor a has dtype F16, declared F32"):
            writer.write("a", torch.zeros(2, 2, dtype=torch.float16))
        with pytest.raises(GraftlabError, match="expected tensor a next, got b"):
            writer.write("b", torch.zeros(3, dtype=torch.bfloat16))
        with pytest.raises(GraftlabError, match=r"block of shape \[3, 2\] does not fit"):
            writer.write("a", torch.zeros(3, 2))
        writer.write("a", torch.zeros(2, 2))
        with pytest.raises(GraftlabError, match="tensor b was declared but not written"):
            writer.close()


def test_atomic_dir_leaves_nothing_on_error_and_replaces_on_success(tmp_path):
    out = tmp_path / "out"
    with pytest.raises(RuntimeError):
        with atomic_dir(out) as tmp:
            (tmp / "half-written").write_text("x")
            raise RuntimeError("interrupted")
    assert list(tmp_path.iterdir()) == []
    out.mkdir()
    (out / "old").write_text("old")
    with atomic_dir(out) as tmp:
        assert tmp.parent == tmp_path and not tmp.name.startswith("out")
        (tmp / "new").write_text("new")
    assert [p.name for p in tmp_path.iterdir()] == ["out"]
    assert [p.name for p in out.iterdir()] == ["new"]


def test_atomic_file_leaves_nothing_on_error_and_replaces_on_success(tmp_path):
    from graftlab.io.atomic import atomic_file

    out = tmp_path / "sub" / "table.parquet"
    with pytest.raises(RuntimeError):
        with atomic_file(out) as tmp:
            tmp.write_text("half")
            raise RuntimeError("interrupted")
    assert list((tmp_path / "sub").iterdir()) == []
    for text in ("first", "second"):
        with atomic_file(out) as tmp:
            assert tmp.parent == out.parent and tmp.name != out.name
            tmp.write_text(text)
    assert [p.name for p in out.parent.iterdir()] == ["table.parquet"] and out.read_text() == "second"


def test_copy_model_files_skips_weights_provenance_and_trainer_state(tmp_path):
    src, dst = tmp_path / "src", tmp_path / "dst"
    src.mkdir(), dst.mkdir()
    keep = [
        "config.json",
        "generation_config.json",
        "tokenizer.json",
        "tokenizer_config.json",
        "chat_template.jinja",
    ]
    skip = [
        "model.safetensors",
        "model-00001-of-00002.safetensors",
        "model.safetensors.index.json",
        "graftlab.json",
        "optimizer.pt",
        "scheduler.pt",
        "rng_state.pth",
        "trainer_state.json",
        "training_args.bin",
        "pytorch_model.bin",
    ]
    for name in keep + skip:
        (src / name).write_text(name)
    (src / "checkpoint-10").mkdir()
    assert copy_model_files(src, dst) == sorted(keep)
    assert sorted(p.name for p in dst.iterdir()) == sorted(keep)


def test_provenance_record(tmp_path):
    path = write_provenance(tmp_path, {"post": tmp_path / "p"}, {"scale": 1.0}, {"counts": {"tensors": 3}})
    record = json.loads(path.read_text())
    assert record["inputs"] == {"post": str(tmp_path / "p")} and record["params"] == {"scale": 1.0}
    assert set(record["versions"]) == {"python", "torch", "transformers", "safetensors", "graftlab"}
    assert record["versions"]["graftlab"] == "0.1.0" and record["counts"] == {"tensors": 3}
    assert "git_revision" in record and record["created_utc"].endswith("+00:00")


def test_tensor_index_names_what_is_missing(tmp_path):
    with pytest.raises(GraftlabError, match="model directory not found: .*nowhere"):
        tensor_index(tmp_path / "nowhere")
    with pytest.raises(GraftlabError, match="no model.safetensors or model.safetensors.index.json in"):
        tensor_index(tmp_path)


def test_integer_buffers_are_copied_from_post(tmp_path):
    def model(name: str, seed: int) -> Path:
        torch.manual_seed(seed)
        tensors = {"w": torch.randn(6, 4), "ids": torch.randint(0, 1000, (6,))}
        (tmp_path / name).mkdir()
        save_file(tensors, tmp_path / name / "model.safetensors", metadata={"format": "pt"})
        (tmp_path / name / "config.json").write_text("{}")  # graft refuses a directory without one
        return tmp_path / name

    post, donor, tuned = model("post", 0), model("donor", 1), model("tuned", 2)
    counts = graft(post, donor, tuned, 1.0, tmp_path / "out", chunk_bytes=32)
    got, want = load_model(tmp_path / "out"), expected_graft(post, donor, tuned, 1.0)
    assert counts["tensors_grafted"] == 1
    assert same_bits(got["ids"], load_model(post)["ids"])
    torch.testing.assert_close(got["w"], want["w"], rtol=0, atol=1e-6)


def test_scalars_empty_tensors_and_mixed_dtypes_in_row_blocks(tmp_path):
    # The graft reads raw bytes at header offsets itself: every dtype width, a 0-d and an empty tensor
    # must land exactly where safetensors put them.
    def model(name: str, seed: int) -> Path:
        g = torch.Generator().manual_seed(seed)
        tensors = {
            "scalar": torch.randn((), generator=g),
            "empty": torch.empty(0, 3),
            "half": torch.randn(5, 3, generator=g).half(),
            "mask": torch.rand(4, generator=g) > 0.5,
            "bf16": torch.randn(7, 5, generator=g).bfloat16(),
            "double": torch.randn(3, 2, generator=g).double(),
        }
        (tmp_path / name).mkdir()
        save_file(tensors, tmp_path / name / "model.safetensors", metadata={"format": "pt"})
        (tmp_path / name / "config.json").write_text("{}")  # graft refuses a directory without one
        return tmp_path / name

    post, donor, tuned = model("post", 0), model("donor", 1), model("tuned", 2)
    graft(post, donor, tuned, 0.7, tmp_path / "out", chunk_bytes=16)
    got, want, stored = load_model(tmp_path / "out"), expected_graft(post, donor, tuned, 0.7), load_model(post)
    assert same_bits(got["mask"], stored["mask"])
    for name in ("scalar", "empty", "half", "bf16", "double"):
        assert same_bits(got[name], want[name].to(stored[name].dtype)), name


def write_raw_safetensors(path: Path, header: dict, data: bytes) -> None:
    raw = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + data)


@pytest.mark.parametrize(
    ("offsets", "data", "message"),
    [
        ([0, 12], bytes(16), r"tensor w spans bytes 0-12, but F32 \[2, 2\] needs 16"),
        ([0, 16], bytes(10), r"tensor w ends at byte 16 of a 10-byte data section \(truncated\?\)"),
    ],
)
def test_corrupt_or_truncated_shard_is_refused_before_writing(tmp_path, offsets, data, message):
    bad = tmp_path / "bad"
    bad.mkdir()
    header = {"w": {"dtype": "F32", "shape": [2, 2], "data_offsets": offsets}}
    write_raw_safetensors(bad / "model.safetensors", header, data)
    with pytest.raises(GraftlabError, match=message):
        graft(bad, bad, bad, 1.0, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_a_grafts_fingerprint_names_its_inputs_and_settings(tmp_path, pico_model):
    """The key a graft job's samples are kept under (it is made anew each attempt): the same arguments give
    the same key; any other input, scale, mask, rho or mask setting another; an unmasked graft reads no Fisher."""
    from graftlab.graft import graft_fingerprint

    post, donor, tuned = pico_model("post"), pico_model("donor"), pico_model("tuned")
    fisher = tmp_path / "fisher"
    fisher.mkdir()
    (fisher / "fisher.safetensors").write_bytes(b"x")
    base = graft_fingerprint(post, donor, tuned, 0.5)
    assert graft_fingerprint(post, donor, tuned, "0.5", "none", fisher, "0") == base
    others = [
        graft_fingerprint(post, donor, tuned, 1.0),
        graft_fingerprint(donor, post, tuned, 0.5),
        graft_fingerprint(post, donor, tuned, 0.5, "diag", fisher, 0.1),
        graft_fingerprint(post, donor, tuned, 0.5, "diag", fisher, 0.2),
        graft_fingerprint(post, donor, tuned, 0.5, "diag", fisher, 0.1, scope="tensor"),
    ]
    assert len({base, *others}) == 1 + len(others)
