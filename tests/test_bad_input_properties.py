"""The bad-input rule for any command line, not the listed cases (tests/test_bad_input.py): `graftlab`
either writes a whole output and exits 0, or exits non-zero with one line on stderr, no traceback, and
its output absent. Hypothesis draws the numbers of every numeric flag (NaN, infinities, zero, negatives,
fractions where a count is due, words) and mangles sound command lines (a flag dropped, a value replaced,
an unknown flag added); each example runs the command in-process on pico models.
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

import polars as pl
import pytest
from conftest import build_pico_model, graft_args
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from graftlab.commands.cli import ASSUMED, main
from graftlab.fisher import write_fisher

REPO = Path(__file__).resolve().parents[1]

# What a user types where a number is due: any float as Python spells it ('nan', 'inf', '1e+300', '-0.0'),
# whole numbers around zero, and short words of number-like characters.
VALUES = st.one_of(
    st.floats(allow_nan=True, allow_infinity=True).map(repr),
    st.integers(min_value=-3, max_value=300).map(str),
    st.text(alphabet="0123456789.-+eEnaif", min_size=1, max_size=6),
)
EXAMPLES = settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


@pytest.fixture(scope="module")
def world(tmp_path_factory, world_pico) -> dict[str, Path]:
    """A graft trio, a Fisher of the post model and its rollouts, and SFT data for the world's pico model."""
    root = tmp_path_factory.mktemp("properties")
    made = {"post": build_pico_model(root / "post", seed=1), "donor": build_pico_model(root / "donor", seed=2)}
    made["tuned"] = build_pico_model(root / "tuned", seed=3, base=made["donor"], noise=0.01)
    made["rollouts"] = root / "rollouts.parquet"
    pl.DataFrame({"prompt_ids": [[1, 2, 3]] * 4, "completion_ids": [[4, 5]] * 4}).write_parquet(made["rollouts"])
    made["fisher"] = root / "fisher"
    write_fisher("diag", made["post"], made["rollouts"], made["fisher"])
    made["sft_data"] = root / "sft.parquet"
    pl.DataFrame({"prompt": ["1+1=", "2+2="], "completion": ["2", "4"]}).write_parquet(made["sft_data"])
    made["world"] = world_pico
    return made


def _sound(command: str, m: dict[str, Path], out: Path) -> list[str]:
    """A command line of `command` that writes `out`."""
    return {
        "graft": ["graft", *graft_args(m["post"], m["donor"], m["tuned"], "0.5", out)],
        "masked": ["graft", *graft_args(m["post"], m["donor"], m["tuned"], "0.5", out), "--mask", "diag"]
        + ["--fisher", str(m["fisher"]), "--rho", "0.5"],
        "fisher": ["fisher", "--model", str(m["post"]), "--rollouts", str(m["rollouts"]), "--out", str(out)],
        "kfac": ["fisher", "--model", str(m["post"]), "--rollouts", str(m["rollouts"]), "--out", str(out)]
        + ["--kind", "kfac"],
        "drift": ["drift", "--base", str(m["post"]), "--model", str(m["tuned"]), "--out", str(out)],
        "sft": ["sft", "--model", str(m["world"]), "--data", str(m["sft_data"]), "--lr", "1e-3", "--steps", "1"]
        + ["--batch-size", "2", "--out", str(out)],
        "plan": ["plan", "--configfile", str(REPO / "config.yaml"), "--disk-free", "1e6"],
    }[command]


NUMERIC = {
    "graft": ["--scale", "--chunk-mb", "--threads"],
    "masked": ["--rho", "--scale"],
    "fisher": ["--batch-size", "--threads"],
    "kfac": ["--max-dim", "--batch-size"],
    "drift": ["--k", "--share", "--threads"],
    "sft": ["--lr", "--steps", "--batch-size", "--micro-batch-size", "--seed", "--threads"],
    "plan": ["--" + name.replace("_", "-") for name in ASSUMED] + ["--disk-free"],
}


def _holds_the_rule(argv: list[str], out: Path, capsys) -> None:
    """Exit 0 with a whole output, or non-zero with one line, no traceback and no output."""
    capsys.readouterr()
    status = main(argv)
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("graftlab: error: ")]
    if status == 0:
        assert not lines, err
        assert argv[0] == "plan" or (out / "graftlab.json").is_file() or (out / "drift.parquet").is_file(), argv
    else:
        assert status in (1, 2) and len(lines) == 1 and err.endswith(lines[0] + "\n"), err
        assert "Traceback" not in err, err
        assert not out.exists(), argv
    assert not list(out.parent.glob(f".{out.name}*")), "a temporary sibling of the output was left behind"


def _scratch(tmp_path: Path, monkeypatch) -> Path:
    """A fresh output path; the working directory a scratch one, so a relative path drawn lands there."""
    monkeypatch.chdir(tmp_path)
    return Path(tempfile.mkdtemp(dir=tmp_path)) / "out"


@pytest.mark.parametrize("command", list(NUMERIC))
@EXAMPLES
@given(data=st.data())
def test_any_number_in_any_numeric_flag_is_a_whole_output_or_one_line(
    world, tmp_path, monkeypatch, capsys, command, data
):
    out = _scratch(tmp_path, monkeypatch)
    flags = data.draw(st.lists(st.sampled_from(NUMERIC[command]), min_size=1, max_size=3, unique=True))
    values = [data.draw(VALUES, label=flag) for flag in flags]
    argv = _sound(command, world, out) + [f"{flag}={value}" for flag, value in zip(flags, values)]
    _holds_the_rule(argv, out, capsys)
    shutil.rmtree(out.parent)


@pytest.mark.parametrize("command", ["graft", "masked", "fisher", "drift", "sft", "plan"])
@EXAMPLES
@given(data=st.data())
def test_any_mangled_command_line_is_a_whole_output_or_one_line(world, tmp_path, monkeypatch, capsys, command, data):
    out = _scratch(tmp_path, monkeypatch)
    argv = _sound(command, world, out)
    flags = [i for i, word in enumerate(argv) if word.startswith("--")]
    how = data.draw(st.sampled_from(["drop", "replace", "add"]))
    if how == "drop":  # a flag left out, with its value when it has one
        i = data.draw(st.sampled_from(flags))
        argv = argv[:i] + argv[i + (1 if i + 1 == len(argv) or argv[i + 1].startswith("--") else 2) :]
    elif how == "replace":  # any word but the command and the output given another: a path, a number, a choice
        i = data.draw(st.sampled_from([i for i in range(1, len(argv)) if argv[i] != str(out)]))
        argv[i] = data.draw(st.one_of(VALUES, st.sampled_from([str(out), str(world["post"]), "", "-", "--"])))
    else:  # a flag nobody defined, or one of another command
        extra = st.sampled_from(["--lamda", "--kind", "--mask", "--epochs", "--fisher", "--allow-nonfinite"])
        argv = argv + [data.draw(extra), data.draw(VALUES)]
    _holds_the_rule(argv, out, capsys)
    shutil.rmtree(out.parent)
