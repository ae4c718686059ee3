"""The ``graftlab`` command, for use outside Snakemake.

Subcommands import their machinery only when they run, so ``graftlab --help`` never pays for torch.
Every user-facing failure is one line on stderr, never a traceback: exit status 2 for the command line (a
flag, an output that is an input: `graftlab.errors.UsageError`), 1 for the data the files hold.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from collections.abc import Sequence
from pathlib import Path

from graftlab.commands import inspect as inspect_cli  # its parser only: polars and Snakemake load when it runs
from graftlab.commands import sft as sft_cli  # its parser only: training loads when `graftlab sft` runs
from graftlab.commands.refusal import Parser, refused, run
from graftlab.errors import UsageError
from graftlab.fisher import FISHERS, KINDS  # names only: the kinds' modules (torch) load when one runs
from graftlab.io.gates import flag, output, threads  # standard library only
from graftlab.planning.config_args import add_config_args, snakemake_config_args  # standard library only


def _set_threads(threads: int | None) -> None:
    if threads is not None:
        import torch

        # Rules run several jobs side by side; two torch processes with 2 threads each
        # on 2 cores ran 7x slower than one.
        torch.set_num_threads(threads)


def _cmd_graft(args: argparse.Namespace) -> None:
    from graftlab.graft import graft

    if args.mask == "none" and (args.fisher, args.rho, args.mask_scope, args.mask_score) != (None,) * 4:
        raise UsageError("--fisher, --rho, --mask-scope and --mask-score only mean something with --mask; give --mask")
    if args.mask != "none" and args.fisher is None:
        raise UsageError(f"--mask {args.mask} needs --fisher DIR")
    inputs = {"--post": args.post, "--donor": args.donor, "--donor-tuned": args.donor_tuned, "--fisher": args.fisher}
    output(args.out, inputs)
    project = None
    if args.mask != "none":
        # Only masks use torch (the identity graft is numpy's, and importing torch costs seconds).
        _set_threads(args.threads)
        from graftlab.fisher import make_mask

        # The flags given only: make_mask holds the defaults of scope and score.
        given = {"scope": args.mask_scope, "score": args.mask_score}
        options = {name: value for name, value in given.items() if value is not None}
        project = make_mask(args.mask, args.fisher, args.post, args.donor, args.donor_tuned, args.rho or 0.0, **options)
    counts = graft(
        args.post,
        args.donor,
        args.donor_tuned,
        args.scale,
        args.out,
        chunk_bytes=args.chunk_mb << 20,
        project=project,
        threads=args.threads,
        allow_nonfinite=args.allow_nonfinite,
    )
    print(f"graftlab: wrote {args.out} ({counts['tensors']} tensors, {counts['parameters']:,} parameters)")


def _add_graft(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "graft",
        help="write post + scale * (donor_tuned - donor); merging is --donor equal to --post",
        description="Graft a donor's fine-tuning update onto a post-trained model: "
        "theta = post + scale * (donor_tuned - donor), computed in fp32 and cast to post's dtype.",
    )
    p.add_argument("--post", required=True, help="post-trained model directory (receives the update)")
    p.add_argument("--donor", required=True, help="donor model directory, before fine-tuning")
    p.add_argument("--donor-tuned", required=True, help="donor model directory, after fine-tuning")
    p.add_argument("--scale", required=True, type=flag(low=0), help="lambda, the update's scale (>= 0)")
    p.add_argument("--out", required=True, help="output model directory (written atomically)")
    p.add_argument(
        "--chunk-mb",
        type=flag(low=0, integer=True),
        default=4,
        help="fp32 row-block size for large tensors (MiB); cache-sized is fastest",
    )
    p.add_argument(
        "--threads",
        type=threads(),
        default=None,
        help="threads computing an unmasked graft (default 1, the fastest measured), "
        "or torch threads of a --mask (default: torch's choice)",
    )
    p.add_argument(
        "--allow-nonfinite",
        action="store_true",
        help="graft inputs holding NaN or Inf (refused by default: they would poison the output)",
    )
    p.add_argument("--fisher", help="directory with the post model's retention Fisher ({diag,kfac}.safetensors)")
    p.add_argument(
        "--mask",
        choices=["none", *KINDS],
        default="none",
        help="zero the most Fisher-sensitive entries (diag) or Kronecker eigen-directions (kfac)",
    )
    p.add_argument(
        "--rho", type=flag(low=0, high=1), help="fraction of entries / directions to zero, in [0, 1] (default 0)"
    )
    p.add_argument(
        "--mask-scope", choices=["global", "tensor"], help="rank over all parameters (the default) or per tensor"
    )
    p.add_argument(
        "--mask-score",
        choices=["fisher_delta", "fisher"],
        help="rank by F*delta^2 (the default) or by F alone",
    )
    p.set_defaults(run=_cmd_graft)


def _cmd_fisher(args: argparse.Namespace) -> None:
    output(args.out, {"--model": args.model, "--rollouts": args.rollouts})
    _set_threads(args.threads)
    from graftlab.fisher import fisher_kind, write_fisher

    # Only the flags given: the kind's writer holds the defaults; a flag of another kind is refused, not ignored.
    given = {option: value for option in FISHER_OPTIONS if (value := getattr(args, option)) is not None}
    if unread := sorted(set(given) - set(fisher_kind(args.kind).options)):
        flags = ", ".join("--" + option.replace("_", "-") for option in unread)
        raise UsageError(f"{flags} only mean something with another --kind than {args.kind}")
    write_fisher(args.kind, args.model, args.rollouts, args.out, args.batch_size, **given)
    print(f"graftlab: wrote {args.out}/{args.kind}.safetensors")


# Every Fisher kind's own options, each a flag of `graftlab fisher`.
FISHER_OPTIONS = sorted({option for kind in FISHERS.values() for option in kind.options})


def _add_fisher(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "fisher",
        help="retention Fisher of a model on its own rollouts",
        description="Retention Fisher of the summed completion log-likelihood of each rollout (a parquet with "
        "prompt_ids and completion_ids): diag, F = (1/N) sum_n g_n^2, saved as DIR/diag.safetensors; or kfac, "
        "Kronecker factors A and G of every linear layer with their eigendecompositions, the diagonal for the "
        "other parameters, saved as DIR/kfac.safetensors (format: docs/formats.md).",
    )
    p.add_argument("--model", required=True, help="model directory (the post model)")
    p.add_argument("--rollouts", required=True, help="parquet with list columns prompt_ids, completion_ids")
    p.add_argument("--kind", choices=list(KINDS), default="diag", help="Fisher approximation")
    p.add_argument(
        "--ekfac", action="store_true", default=None, help="kfac: re-fit the diagonal in the eigenbasis (a second pass)"
    )
    p.add_argument(
        "--max-dim",
        type=flag(low=1, integer=True),
        help="kfac: linear layers wider than this get the diagonal (default 8192)",
    )
    p.add_argument(
        "--positions",
        choices=["completion", "all"],
        help="kfac: positions A and G count: those predicting a completion token (docs/methods.md; the default), "
        "or every token",
    )
    p.add_argument("--out", required=True, help="output directory (written atomically)")
    p.add_argument(
        "--batch-size",
        type=flag(low=1, integer=True),
        default=16,
        help="rollouts per backward pass: memory, not results",
    )
    p.add_argument("--threads", type=threads(), default=None, help="torch threads (default: torch's choice)")
    p.set_defaults(run=_cmd_fisher)


def _cmd_drift(args: argparse.Namespace) -> None:
    output(args.out, {"--base": args.base, "--model": args.model})
    _set_threads(args.threads)
    from graftlab.analysis.param_drift import write_model_drift

    out = write_model_drift(args.base, args.model, args.out, k=args.k, share=args.share)
    print(f"graftlab: wrote {out}")


def _add_drift(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "drift",
        help="per weight matrix, how far a model's parameters moved from a base's",
        description="Parameter drift of MODEL against BASE for every 2-D floating tensor, in float64, one "
        "tensor at a time: spectral shift, largest principal angle between the top-k left singular "
        "subspaces, IoU of the top-share magnitude masks, share of unchanged entries and relative update "
        "norm, written as DIR/drift.parquet (docs/cli.md).",
    )
    p.add_argument("--base", required=True, help="base model directory (W)")
    p.add_argument("--model", required=True, help="model directory compared with it (W')")
    p.add_argument("--out", required=True, help="output directory; drift.parquet is written atomically")
    p.add_argument(
        "--k",
        type=flag(low=1, integer=True),
        default=16,
        help="singular vectors spanning each subspace (clipped to the rank)",
    )
    p.add_argument(
        "--share", type=flag(above=0, high=1), default=0.01, help="share of entries in each top-magnitude mask"
    )
    p.add_argument("--threads", type=threads(), default=None, help="torch threads (default: torch's choice)")
    p.set_defaults(run=_cmd_drift)


def _cmd_plan(args: argparse.Namespace) -> None:
    from graftlab.errors import GraftlabError
    from graftlab.planning.config import ConfigError
    from graftlab.planning.plan import Assumptions, dag_jobs, estimate, free_disk, load_config, render

    fields = [f.name for f in dataclasses.fields(Assumptions)]
    try:
        plan = estimate(load_config(args.configfile, args.config), Assumptions(**{f: getattr(args, f) for f in fields}))
        if args.dag:
            dag = dag_jobs(snakemake_config_args(args))
            ours = {rule: cost.jobs for rule, cost in plan.costs.items()}
            plan.notes += [
                f"{rule}: Snakemake's DAG has {dag.get(rule, 0)} jobs, the cost model {ours.get(rule, 0)}"
                for rule in sorted(set(dag) | set(ours))
                if dag.get(rule, 0) != ours.get(rule, 0)
            ] or ["Snakemake's DAG has the same jobs per rule."]
    except (ConfigError, ValueError, RuntimeError) as e:
        raise GraftlabError(str(e)) from None
    print(render(plan))
    if problem := plan.unrunnable():
        raise GraftlabError(problem)
    free = args.disk_free * 1e9 if args.disk_free is not None else free_disk(Path(args.directory))
    if problem := plan.shortfall(free):
        raise GraftlabError(f"{problem} ({args.directory})")


# The plan's assumptions (`graftlab.planning.plan.Assumptions`) a flag sets, in --help's order.
ASSUMED = {
    "mfu": "share of the GPU's peak FLOP/s a training pass reaches",
    "decode_mfu": "share that decoding reaches",
    "gpu_flops": "peak FLOP/s (default: H100 bf16 dense)",
    "gpu_bandwidth": "memory bytes/s (default: H100 SXM HBM3)",
    "kv_utilisation": "share of it a decode's KV-cache reads reach",
    "gpu_memory_gb": "one GPU's memory, as the profile's gpu_memory_gb",
    "prompt_tokens": "tokens per prompt",
    "problems": "candidates of a data set with no limit",
    "benchmark_problems": "problems per benchmark",
    "kept": "share of candidates mining keeps",
    "adaptive_kept": "share of an adaptive sweep's grafts scored fully (eval.adaptive), where no screening has decided",
    "checkpoint_bytes": "bytes per saved parameter",
    "jobs": "jobs at once, as snakemake --jobs",
    "temp_grafts": "grafts on disk at once, as --resources temp_grafts=N",
}
# Those that are shares of a whole; every other is a positive size or rate.
SHARES = ("mfu", "decode_mfu", "kv_utilisation", "kept", "adaptive_kept")


def _assumed(name: str):
    """The gate of the plan's assumption `name` (a field of `graftlab.planning.plan.Assumptions`)."""
    from graftlab.planning.plan import Assumptions

    if {f.name: f.type for f in dataclasses.fields(Assumptions)}[name] in (int, "int"):
        return flag(low=1, integer=True)
    return flag(above=0, high=1) if name in SHARES else flag(above=0)


def _add_plan(subparsers: argparse._SubParsersAction) -> None:
    from graftlab.planning.plan import Assumptions

    a = Assumptions()
    p = subparsers.add_parser(
        "plan",
        help="jobs, GPU-hours and disk per rule of a run, before its launch",
        description="Estimate a run from its config, as Snakemake would resolve it: jobs per rule, GPU-hours "
        "(tokens x FLOPs per token at a utilisation), disk written and the peak on disk (docs/cli.md).",
    )
    add_config_args(p)
    for name, words in ASSUMED.items():
        p.add_argument("--" + name.replace("_", "-"), type=_assumed(name), default=getattr(a, name), help=words)
    p.add_argument("--dag", action="store_true", help="check the job counts against Snakemake's dry-run")
    p.add_argument("--directory", default=".", help="where the run will write (the disk checked for room)")
    p.add_argument("--disk-free", type=flag(low=0), help="GB free for the run (default: measured at --directory)")
    p.set_defaults(run=_cmd_plan)


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(prog="graftlab", description="Continual learning of post-trained LLMs by grafting donor updates.")
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    _add_graft(subparsers)
    _add_fisher(subparsers)
    _add_drift(subparsers)
    _add_plan(subparsers)
    sft_cli.add_parser(subparsers)
    inspect_cli.add_parser(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run `graftlab ARGV`; the exit status: 0, 2 for a refused command line, 1 for refused data."""
    try:
        args = build_parser().parse_args(argv)
        return run(args)
    except UsageError as e:
        return refused(e, 2)


if __name__ == "__main__":
    sys.exit(main())
