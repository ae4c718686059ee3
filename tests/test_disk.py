"""graftlab.planning.disk: the disk a finished run uses per rule, read from Snakemake's records of its outputs, and the
most the temporary grafts held at once, read from their jobs' timings."""

import base64
import json
from pathlib import Path

from graftlab.planning.disk import TEMP_GRAFTS, graft_peak, human, usage


def record(workdir: Path, output: str, rule: str, name_max: int = 255) -> None:
    """Snakemake's record of `output`: its path in URL-safe base64 as the file name, a long name cut into
    directories of name_max - 1 characters, all but the last prefixed with '@'."""
    b64 = base64.urlsafe_b64encode(output.encode()).decode()
    parts = [b64[i : i + name_max - 1] for i in range(0, len(b64), name_max - 1)]
    path = workdir / ".snakemake" / "metadata" / Path(*["@" + p for p in parts[:-1]], parts[-1])
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"rule": rule, "record_format_version": 6}))


def write(path: Path, size: int) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(b"x" * size)


def test_each_existing_output_is_charged_to_the_rule_that_wrote_it(tmp_path):
    write(tmp_path / "results/e/sft/post/lr~1/epoch~1/model.safetensors", 3000)
    write(tmp_path / "results/e/sft/post/lr~1/epoch~2/model.safetensors", 3000)
    write(tmp_path / "results/e/eval/post/metrics.json", 10)
    long = "results/e/eval/" + "/".join(["deep~" + "x" * 40] * 6) + "/metrics.json"  # > 255 in base64
    write(tmp_path / long, 20)
    record(tmp_path, "results/e/sft/post/lr~1", "sft")
    record(tmp_path, "results/e/eval/post/metrics.json", "evaluate")
    record(tmp_path, long, "evaluate")
    record(tmp_path, "results/e/graft/gone/model", "graft")  # a temp() output since deleted: nothing
    (tmp_path / ".snakemake/metadata/not-base64!").write_text("{}")  # not a record
    assert usage(tmp_path) == [
        {"rule": "sft", "outputs": 1, "bytes": 6000},
        {"rule": "evaluate", "outputs": 2, "bytes": 30},
    ]


def test_the_grafts_peak_is_the_most_on_disk_at_one_moment(tmp_path):
    spans = {"a": (0.0, 10.0, 100), "b": (5.0, 15.0, 200), "c": (10.0, 20.0, 50), "d": (30.0, 31.0, 400)}
    for name, (written, deleted, size) in spans.items():
        out = tmp_path / f"results/e/graft/{name}/seconds.json"
        out.parent.mkdir(parents=True)
        seconds = {"graft_s": 1.0, "model_written_at": written, "model_deleted_at": deleted, "model_bytes": size}
        out.write_text(json.dumps(seconds))
    # a and b overlap (300 bytes); c starts as a is deleted, so a deletion at the same moment counts first;
    # d is the largest but alone.
    assert graft_peak(tmp_path) == (2, 400)
    assert usage(tmp_path)[-1] == {"rule": TEMP_GRAFTS, "outputs": 2, "bytes": 400}


def test_sizes_read_in_their_unit():
    assert [human(n) for n in (999, 4_200_000, 16e9, 1.2e12)] == ["999 B", "4.2 MB", "16 GB", "1.2 TB"]
