"""The import structure: no module imports another that imports it back (imports inside functions count),
and parsing the workflow stays light."""

import ast
import re
import subprocess
import sys
from pathlib import Path

import numpy as np

from graftlab.io.safetensors_io import SafetensorsWriter

REPO = Path(__file__).resolve().parents[1]
SRC = REPO / "src"


def module_name(path: Path) -> str:
    parts = path.relative_to(SRC).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph() -> dict[str, set[str]]:
    """Every graftlab module and the graftlab modules it imports anywhere in its body."""
    modules = {module_name(p): p for p in SRC.rglob("*.py")}
    graph = {}
    for name, path in modules.items():
        edges = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                # `from pkg import sub` imports the submodule when there is one, else a name of pkg.
                targets = [
                    f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in modules else node.module
                    for a in node.names
                ]
            else:
                continue
            edges |= {t for t in targets if t in modules and t != name}
        graph[name] = edges
    return graph


def test_no_import_cycle_counting_imports_inside_functions():
    graph, state, cycles = import_graph(), {}, []

    def visit(node, stack):
        state[node] = "open"
        for nxt in sorted(graph[node]):
            if state.get(nxt) == "open":
                cycles.append(stack[stack.index(nxt) :] + [nxt])
            elif nxt not in state:
                visit(nxt, stack + [nxt])
        state[node] = "done"

    for node in sorted(graph):
        if node not in state:
            visit(node, [node])
    assert len(graph) > 40 and not cycles, cycles


def test_no_folder_imports_a_folder_that_imports_it_back():
    """The layers: folding each module into its top-level package (or top-level module), no two import
    each other, directly or round a loop."""
    top = lambda m: ".".join(m.split(".")[:2])  # noqa: E731
    folded: dict[str, set[str]] = {}
    for m, targets in import_graph().items():
        folded.setdefault(top(m), set()).update(top(t) for t in targets if top(t) != top(m))
    reach = {node: set(edges) for node, edges in folded.items()}
    changed = True
    while changed:  # transitive closure: a few dozen nodes
        changed = False
        for seen in reach.values():
            more = set().union(*(reach.get(n, set()) for n in seen)) - seen
            if more:
                seen |= more
                changed = True
    loops = sorted(node for node, seen in reach.items() if node in seen)
    assert len(folded) > 10 and not loops, {n: sorted(folded[n] & {m for m in loops if n in reach[m]}) for n in loops}


def test_the_top_level_holds_few_modules():
    """The package reads as layers: io, planning, commands, methods and the domain folders; only a few
    modules stay at the top."""
    modules = [p.stem for p in (SRC / "graftlab").glob("*.py") if p.stem not in ("__init__", "__main__")]
    assert len(modules) <= 8, sorted(modules)


def test_the_modules_the_workflow_imports_leave_torch_out():
    """Every `snakemake` call, a dry-run included, parses rules/common.smk: it must not pay for torch."""
    imported = re.findall(r"^from (graftlab[\w.]*) import", (REPO / "rules" / "common.smk").read_text(), re.M)
    assert {"graftlab.planning.config", "graftlab.planning.layout", "graftlab.fisher"} <= set(imported)
    code = f"import sys; import {', '.join(imported)}; print(sorted({{'torch', 'transformers'}} & set(sys.modules)))"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "[]"


def test_identity_graft_from_the_command_line_leaves_torch_out(tmp_path):
    """`graftlab graft` without a mask computes with numpy: importing torch would be most of its start-up."""
    rng = np.random.default_rng(0)
    dirs = []
    for role in ("post", "donor", "tuned"):
        (tmp_path / role).mkdir()
        with SafetensorsWriter(
            tmp_path / role / "model.safetensors", [("w", "BF16", (4, 3)), ("ids", "I64", (2,))]
        ) as w:
            w.write_bytes("w", (4, 3), rng.integers(0x3C00, 0x4000, 12, dtype=np.uint16))
            w.write_bytes("ids", (2,), np.arange(2, dtype=np.int64))
        (tmp_path / role / "config.json").write_text('{"model_type": "toy"}')  # graft refuses a dir without one
        dirs.append(str(tmp_path / role))
    code = (
        "import sys; from graftlab.commands.cli import main; "
        f"code = main(['graft', '--post', {dirs[0]!r}, '--donor', {dirs[1]!r}, '--donor-tuned', {dirs[2]!r}, "
        f"'--scale', '0.5', '--out', {str(tmp_path / 'out')!r}]); "
        "print(code, sorted({'torch', 'transformers'} & set(sys.modules)))"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.strip().splitlines()[-1] == "0 []", done.stdout + done.stderr
    assert (tmp_path / "out" / "model.safetensors").is_file()


def test_the_sensitivity_update_job_leaves_torch_out(tmp_path):
    """The workflow runs one `sensitivity_update` job per update (75 in the default run): its script, run as
    Snakemake runs it, computes a bf16 model's row with numpy, never importing torch, transformers or the
    plotting side (matplotlib)."""
    script = REPO / "workflow_scripts" / "sensitivity_update.py"
    assert "from graftlab.analysis.sensitivity_shares import" in script.read_text()
    rng = np.random.default_rng(0)
    names = [("model.embed_tokens.weight", (8, 4)), ("model.layers.0.mlp.up_proj.weight", (4, 4))]
    for role in ("post", "sft"):
        (tmp_path / role).mkdir()
        with SafetensorsWriter(tmp_path / role / "model.safetensors", [(n, "BF16", s) for n, s in names]) as w:
            for name, shape in names:
                w.write_bytes(name, shape, rng.integers(0x3C00, 0x4000, shape, dtype=np.uint16))
    (tmp_path / "fisher").mkdir()
    with SafetensorsWriter(tmp_path / "fisher" / "diag.safetensors", [(n, "F32", s) for n, s in names]) as w:
        for name, shape in names:
            w.write_bytes(name, shape, rng.random(shape, dtype=np.float32))
    out = tmp_path / "share.parquet"
    code = (
        "import runpy, sys; from types import SimpleNamespace as N; "
        f"job = N(input=N(fisher={str(tmp_path / 'fisher')!r}, post={str(tmp_path / 'post')!r}), "
        f"params=N(run='sft/post/lr~1e-3/epoch~2', model={str(tmp_path / 'sft')!r}, top=0.1), "
        f"output=[{str(out)!r}], log=[{str(tmp_path / 'job.log')!r}], threads=2); "
        f"runpy.run_path({str(script)!r}, init_globals={{'snakemake': job}}); "
        "print(sorted({'torch', 'transformers', 'matplotlib'} & set(sys.modules)))"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0 and done.stdout.strip() == "[]", done.stdout + done.stderr
    assert out.is_file()
