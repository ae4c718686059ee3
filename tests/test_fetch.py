"""Fetching model references into resources/models/: a local directory copied file by file, a hub id
downloaded at a pinned commit (faked here: tests never reach the hub), and every failure leaving nothing
behind at the output."""

import json
import shutil
from pathlib import Path
from types import SimpleNamespace

import huggingface_hub
import pytest
import torch
from huggingface_hub.utils import filter_repo_objects
from transformers import AutoModelForCausalLM, AutoTokenizer

from graftlab.errors import GraftlabError
from graftlab.io import fetch
from graftlab.io.fetch import fetch_model
from graftlab.world.tokenizer import build_tokenizer

TOK = build_tokenizer()
COMMIT = "0123456789abcdef0123456789abcdef01234567"


@pytest.fixture
def source(pico_model) -> Path:
    """A sharded pico model with the tiny tokenizer, plus files a fetch must leave behind."""
    src = pico_model("src", max_shard_size="20KB", vocab_size=len(TOK))
    TOK.save_pretrained(src)
    (src / "optimizer.pt").write_bytes(b"state")
    (src / "pytorch_model.bin").write_bytes(b"pickle")
    (src / "graftlab.json").write_text("{}")
    (src / "checkpoint-1").mkdir()
    shutil.copy(next(src.glob("*.safetensors")), src / "checkpoint-1")
    return src


def model_files(src: Path) -> set[str]:
    extras = {"optimizer.pt", "pytorch_model.bin", "graftlab.json", "checkpoint-1"}
    return {p.name for p in src.iterdir()} - extras


def assert_same_model(fetched: Path, src: Path) -> None:
    a = AutoModelForCausalLM.from_pretrained(fetched).state_dict()
    b = AutoModelForCausalLM.from_pretrained(src).state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    tok = AutoTokenizer.from_pretrained(fetched)
    text = "<|im_start|>user\n12*3=?<|im_end|>\n<think>\n</think>"
    assert tok(text)["input_ids"] == TOK(text)["input_ids"]
    assert tok.chat_template == TOK.chat_template


def assert_nothing_left(out: Path) -> None:
    assert not out.exists()
    assert not [p for p in out.parent.iterdir() if p.name.startswith(f".{out.name}")]


def test_local_fetch_copies_exactly_the_model_files(source, tmp_path):
    assert len(list(source.glob("model-*.safetensors"))) > 1  # the index and its shards travel together
    out = fetch_model(str(source), tmp_path / "models" / "pico")
    assert {p.name for p in out.iterdir()} == model_files(source) | {"graftlab.json"}
    assert_same_model(out, source)
    record = json.loads((out / "graftlab.json").read_text())
    assert record["inputs"] == {"source": str(source), "revision": None, "commit": None}


@pytest.mark.parametrize("missing", ["/no/such/model", "./no-such-model", "~/no-such-model-here"])
def test_missing_local_path_is_an_error_and_never_sent_to_the_hub(missing, tmp_path, monkeypatch):
    monkeypatch.setattr(fetch, "_download", lambda *a: pytest.fail("a path-like source reached the hub"))
    with pytest.raises(GraftlabError, match=r"no such directory"):
        fetch_model(missing, tmp_path / "m")
    assert_nothing_left(tmp_path / "m")


def test_revision_with_a_local_source_is_an_error(source, tmp_path):
    with pytest.raises(GraftlabError, match=r"revision 'v1' pins hub ids only"):
        fetch_model(str(source), tmp_path / "m", revision="v1")
    assert_nothing_left(tmp_path / "m")


def test_a_directory_without_safetensors_weights_is_refused_listing_what_is_there(source, tmp_path):
    for shard in source.glob("model*"):
        shard.unlink()
    with pytest.raises(GraftlabError, match=r"needs config.json and safetensors weights.*'config.json'"):
        fetch_model(str(source), tmp_path / "m")
    assert_nothing_left(tmp_path / "m")


def test_an_index_naming_a_missing_shard_is_refused(source, tmp_path):
    next(source.glob("model-*.safetensors")).unlink()
    with pytest.raises(GraftlabError, match=rf"^model {source}: shard .* does not exist"):
        fetch_model(str(source), tmp_path / "m")
    assert_nothing_left(tmp_path / "m")


def test_a_nan_weight_is_refused_where_the_model_enters_the_workflow(source, tmp_path):
    from safetensors.torch import load_file, save_file

    shard = next(source.glob("model-*.safetensors"))
    weights = load_file(shard)
    name = sorted(n for n, t in weights.items() if t.is_floating_point())[0]
    weights[name].view(-1)[0] = float("nan")
    save_file(weights, shard, metadata={"format": "pt"})
    with pytest.raises(GraftlabError, match=rf"^model {source}: weights .*: tensor {name} holds 1 NaN or Inf"):
        fetch_model(str(source), tmp_path / "m")
    assert_nothing_left(tmp_path / "m")


def test_hub_id_offline_is_an_error_naming_source_and_revision(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    # huggingface_hub reads the variable once, at import: set what it actually consults too.
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(GraftlabError, match=r"^model 'Qwen/Qwen3-0.6B' at revision v2: cannot fetch .*Offline") as err:
        fetch_model("Qwen/Qwen3-0.6B", tmp_path / "m", revision="v2")
    assert "\n" not in str(err.value)
    assert_nothing_left(tmp_path / "m")


def test_invalid_hub_id_is_an_error(tmp_path):
    with pytest.raises(GraftlabError, match=r"^model 'a/b/c' at revision main: cannot fetch .*HFValidationError"):
        fetch_model("a/b/c", tmp_path / "m")
    assert_nothing_left(tmp_path / "m")


def test_hub_download_pins_the_resolved_commit_and_fetches_only_model_files(source, tmp_path, monkeypatch):
    calls = {}

    class FakeApi:
        def repo_info(self, repo_id, revision=None):
            calls["repo_info"] = (repo_id, revision)
            return SimpleNamespace(sha=COMMIT)

    def fake_snapshot_download(repo_id, revision, local_dir, allow_patterns, ignore_patterns):
        # The hub's own pattern filter over the repo's files, as snapshot_download applies it.
        files = [str(p.relative_to(source)) for p in source.rglob("*") if p.is_file()]
        calls["snapshot"] = (repo_id, revision)
        for name in filter_repo_objects(files, allow_patterns=allow_patterns, ignore_patterns=ignore_patterns):
            shutil.copy(source / name, Path(local_dir) / name)
        (Path(local_dir) / ".cache" / "huggingface").mkdir(parents=True)
        return str(local_dir)

    monkeypatch.setattr(huggingface_hub, "HfApi", FakeApi)
    monkeypatch.setattr(huggingface_hub, "snapshot_download", fake_snapshot_download)
    out = fetch_model("org/pico", tmp_path / "m", revision="main")
    assert calls == {"repo_info": ("org/pico", "main"), "snapshot": ("org/pico", COMMIT)}
    assert {p.name for p in out.iterdir()} == model_files(source) | {"graftlab.json"}
    assert_same_model(out, source)
    record = json.loads((out / "graftlab.json").read_text())
    assert record["inputs"] == {"source": "org/pico", "revision": "main", "commit": COMMIT}


def test_rope_scaling_copied_from_the_post_model_and_recorded(pico_model, tmp_path):
    donor = pico_model("donor", max_position_embeddings=64)
    post = pico_model("post", max_position_embeddings=256)
    cfg = json.loads((post / "config.json").read_text())
    cfg["rope_scaling"] = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}
    (post / "config.json").write_text(json.dumps(cfg))
    out = fetch_model(str(donor), tmp_path / "m", rope_from=post)
    got = json.loads((out / "config.json").read_text())
    assert got["rope_scaling"] == cfg["rope_scaling"] and got["max_position_embeddings"] == 256
    record = json.loads((out / "graftlab.json").read_text())["params"]["rope_from"]
    assert record["model"] == str(post)
    assert record["max_position_embeddings"] == [64, 256]
    assert record["rope_scaling"][1]["rope_type"] == "yarn"
    assert AutoModelForCausalLM.from_pretrained(out).config.rope_scaling["rope_type"] == "yarn"


def test_fetch_rules_alone_reach_the_hub():
    env = {"HF_HUB_OFFLINE": "0"}
    fetch.hub_offline(env)
    assert env == {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    fetch.hub_online(env)
    assert env == {}
    from tests.conftest import REPO

    rules = (REPO / "rules" / "models.smk").read_text() + (REPO / "rules" / "data.smk").read_text()
    assert "localrules:\n    fetch_model," in rules and "localrules:\n    dataset," in rules
    assert "hub_offline()" in (REPO / "rules" / "common.smk").read_text()
    for script in ("fetch_model.py", "dataset.py"):
        text = (REPO / "workflow_scripts" / script).read_text()
        assert text.index("hub_online()") < text.index("job_log")
