"""Mutation check of the method tests (issue 18, item 7): each entry of MUTATIONS is one small change to
src/ that breaks a method's defining property; the tests named with it must fail on it and pass without it.

    python tests/mutations.py [NAME ...]         # every mutation, or the named ones
    python tests/mutations.py --list

The shared working tree is never touched: a private `git worktree` of HEAD gets one mutation at a time,
and the tests of this checkout run against it through PYTHONPATH (each run first asserts that graftlab is
imported from the worktree). The table this prints is tests/MUTATIONS.md's.
"""

import itertools
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import NamedTuple

REPO = Path(__file__).resolve().parents[1]


class Mutation(NamedTuple):
    name: str
    file: str  # under src/graftlab
    old: str
    new: str
    tests: tuple[str, ...]  # pytest node ids (or -k expressions after "::-k ")


OPSD, STAR, FISHER, KFAC = "tests/test_opsd.py", "tests/test_star.py", "tests/test_fisher.py", "tests/test_kfac.py"
SDPO, TEACHER, GRPO = "tests/test_sdpo.py", "tests/test_teacher.py", "tests/test_grpo.py"
CHUNKS, SCREEN = "tests/test_sample_chunks.py", "tests/test_screen.py"
SAMPLING, LAYOUT = "tests/test_sampling_vllm.py", "tests/test_layout.py"
TEACHER_READS = f"{OPSD}::test_the_teacher_reads_the_demonstration_and_the_loss_is_the_teacher_topk_divergence"
KFAC_DEF = f"{KFAC}::test_kfac_mask_equals_the_eigenbasis_definition_on_square_and_non_square_layers"
KFAC_GRAFT = f"{KFAC}::test_kfac_mask_zeroes_the_top_scored_eigen_directions"
DIAG_DEFAULT = f"{FISHER}::test_by_default_a_diag_mask_ranks_by_the_predicted_rise_of_the_retention_loss"
STATS_FIRST = "tests/test_stage_data.py::test_a_stages_table_appears_only_after_its_stats"
SIBLING = f"{SDPO}::test_each_rollouts_teacher_reads_its_first_successful_siblings_answer_never_its_own"
SCHEDULE = f"{SDPO}::test_the_teacher_a_run_hands_on_follows_its_schedule_at_the_right_steps"
GRPO_ADV = f"{GRPO}::test_advantages_and_the_token_pooled_loss_match_a_hand_computation"
DIVERGE = "tests/test_diverge.py"
BAD = "tests/test_bad_input.py::test_bad_input_is_one_clear_line_and_leaves_nothing"

MUTATIONS = [
    Mutation(
        "opsd-bare-teacher",
        "train/opsd.py",
        'texts = [teacher_text(self.cfg.template, b["prompt"], b["demonstration"]) for b in batch]',
        'texts = [b["prompt"] for b in batch]',
        (TEACHER_READS,),
    ),
    Mutation(
        "opsd-shifted-logits",
        "sampling.py",
        "logits[row, len(p) - 1 : len(p) + len(r) - 1]",
        "logits[row, len(p) : len(p) + len(r)]",
        (f"{OPSD}::test_response_logits_predict_each_response_token_from_exactly_what_precedes_it", TEACHER_READS),
    ),
    Mutation(
        "opsd-student-topk-tail",
        "train/opsd.py",
        '"teacher_topk", self.k)',
        '"student_topk_tail", self.k)',
        (TEACHER_READS,),
    ),
    Mutation(
        "star-first-sample",
        "synth/star.py",
        "Found(completions[hit], used + hit + 1)",
        "Found(completions[0], used + hit + 1)",
        (f"{STAR}::test_a_round_keeps_its_first_verified_sample_not_its_first_sample",),
    ),
    Mutation(
        "diag-default-f-only (make_mask)",
        "fisher/__init__.py",
        'score="fisher_delta",',
        'score="fisher",',
        (DIAG_DEFAULT,),
    ),
    Mutation(
        "diag-default-f-only (DiagMask)",
        "fisher/masks.py",
        'score="fisher_delta", deltas=None',
        'score="fisher", deltas=None',
        (DIAG_DEFAULT,),
    ),
    Mutation(
        "kfac-f-only-rotation-transposed",
        "fisher/kfac_mask.py",
        '            rotated = e["G_eigvecs"].T @ delta @ e["A_eigvecs"]\n        rotated.view',
        '            rotated = e["A_eigvecs"].T @ delta.T @ e["G_eigvecs"]\n        rotated.view',
        (KFAC_DEF, f"{KFAC_GRAFT}[global-fisher]"),
    ),
    Mutation(
        "kfac-f-only-rotation-unrotated",
        "fisher/kfac_mask.py",
        '            rotated = e["G_eigvecs"].T @ delta @ e["A_eigvecs"]\n        rotated.view',
        '            rotated = e["G_eigvecs"] @ delta @ e["A_eigvecs"].T\n        rotated.view',
        (
            KFAC_DEF,
            f"{KFAC_GRAFT}[global-fisher]",
            "tests/test_fisher_scale.py::test_streamed_mask_grafts_bit_for_bit_as_the_former_exact_mask[kfac]",
        ),
    ),
    Mutation(
        "kfac-ignores-ekfac",
        "fisher/kfac_mask.py",
        'return e["ekfac"] if "ekfac" in e else torch.outer',
        "return torch.outer",
        (KFAC_DEF, f"{KFAC_GRAFT}[global-ekfac]"),
    ),
    Mutation(  # the count stays exact: only a test of which ties are masked sees it
        "mask-ties-broken-last-first",
        "fisher/masks.py",
        "ties = (score == self.threshold).nonzero()[:, 0][: self.ties_left]",
        "ties = (score == self.threshold).nonzero()[:, 0].flip(0)[: self.ties_left]",
        (f"{FISHER}::test_global_mask_zeroes_exactly_round_rho_total_of_the_top_scores[fisher]",),
    ),
    Mutation(
        "pareto-frontier-with-donors",
        "analysis/pareto.py",
        'cands = pareto_front(df.filter(~pl.col("method").is_in(INGREDIENTS)))',
        "cands = pareto_front(df)",
        ("tests/test_analysis.py::test_the_pareto_figures_frontier_is_that_of_the_candidates_never_a_donors",),
    ),
    Mutation(
        "table-before-stats (write_table_with_stats)",
        "io/atomic.py",
        "    write_json(stats_out, stats)\n    with atomic_file(out) as tmp:\n        table.write_parquet(tmp)\n",
        "    with atomic_file(out) as tmp:\n        table.write_parquet(tmp)\n    write_json(stats_out, stats)\n",
        (STATS_FIRST,),
    ),
    Mutation(
        "table-before-stats (stage_data)",
        "synth/stage_data.py",
        'write_table_with_stats(traces, stats, out / "sft.parquet", out / "sft.json")',
        'traces.write_parquet(out / "sft.parquet")\n    '
        'write_table_with_stats(traces, stats, out / "sft.parquet", out / "sft.json")',
        (STATS_FIRST,),
    ),
    # The new methods.
    Mutation("sdpo-own-demonstration", "train/sdpo.py", "if correct[j] and j != i", "if correct[j]", (SIBLING,)),
    Mutation(
        "sdpo-last-sibling",
        "train/sdpo.py",
        "for j in range(len(correct)) if correct[j] and j != i), None)",
        "for j in reversed(range(len(correct))) if correct[j] and j != i), None)",
        (SIBLING,),
    ),
    Mutation(
        "sdpo-reprompt-own-answer",
        "train/sdpo.py",
        "solution=fill(c.solution_template, solution=demo)",
        "solution=fill(c.solution_template, solution=own or demo)",
        (SIBLING,),
    ),
    Mutation(
        "sdpo-loop-never-updates-teacher",
        "train/sdpo.py",
        "                update_teacher(self.teacher, self.student, cfg.schedule, steps, cfg.steps)\n",
        "                pass\n",
        (SCHEDULE,),
    ),
    Mutation(
        "sdpo-loop-teacher-every-step",
        "train/sdpo.py",
        "            if step == steps[-1]:\n",
        "            if True:\n",
        (SCHEDULE,),
    ),
    Mutation(
        "teacher-ema-rate-swapped",
        "train/teacher.py",
        "dtype=t.dtype), rate)",
        "dtype=t.dtype), 1 - rate)",
        (TEACHER, SCHEDULE),
    ),
    Mutation(
        "teacher-refresh-at-last-step",
        "train/teacher.py",
        "and step < total_steps",
        "and step <= total_steps",
        (TEACHER,),
    ),
    Mutation(
        "teacher-refresh-interval-floor",
        "train/teacher.py",
        "max(1, round(rate * total_steps))",
        "max(1, int(rate * total_steps))",
        (TEACHER,),
    ),
    Mutation(
        "teacher-frozen-follows",
        "train/teacher.py",
        'if s.kind == "frozen":\n        return False',
        'if s.kind == "frozen":\n        _blend(teacher, student, 0.5)\n        return True',
        (TEACHER,),
    ),
    Mutation("grpo-batch-std", "train/grpo.py", 'scale_rewards="group" if', 'scale_rewards="batch" if', (GRPO_ADV,)),
    Mutation(
        "grpo-never-scaled",
        "train/grpo.py",
        'scale_rewards="group" if cfg.scale_rewards else "none"',
        'scale_rewards="none"',
        (GRPO_ADV,),
    ),
    Mutation("grpo-sequence-mean-loss", "train/grpo.py", 'loss_type="dapo",', 'loss_type="grpo",', (GRPO_ADV,)),
    # Issue 32: the official code's optimizer step, and the properties item 10 of its findings named.
    Mutation(
        "grpo-updates-as-passes",
        "train/grpo.py",
        "steps_per_generation=accumulated * cfg.updates_per_batch,\n        num_iterations=cfg.epochs_per_batch,",
        "steps_per_generation=accumulated,\n        num_iterations=cfg.epochs_per_batch * cfg.updates_per_batch,",
        (f"{GRPO}::test_each_optimizer_step_trains_on_its_own_share_of_one_sampled_batch",),
    ),
    Mutation(
        "our-loops-never-clip",
        "train/onpolicy.py",
        'limit = self.cfg.max_grad_norm or float("inf")',
        'limit = float("inf")',
        ("tests/test_clipping.py",),
    ),
    Mutation(
        "star-rationalization-unverified",
        "synth/star.py",
        'return grade(completion, str(rows[unsolved[j]]["answer"])) and not mentions_hint(completion)',
        "return not mentions_hint(completion)",
        (f"{STAR}::test_rationalization_keeps_a_problems_first_hinted_sample_that_verifies_and_never_leaks",),
    ),
    Mutation(
        "teacher-traces-unverified",
        "synth/pedagogical.py",
        'return grade(completion, str(rows[i]["answer"])) and well_formed(completion, 0, 0) and not leaks',
        "return well_formed(completion, 0, 0) and not leaks",
        (
            "tests/test_pedagogical.py::"
            "test_the_teacher_keeps_a_problems_first_sample_that_verifies_thinks_and_never_names_the_reference",
        ),
    ),
    Mutation(
        "sdpo-importance-weight-differentiated",
        "train/sdpo.py",
        "torch.exp(now.detach() - sampled)",
        "torch.exp(now - sampled)",
        (f"{SDPO}::test_the_importance_weight_scales_the_gradient_but_is_not_differentiated",),
    ),
    Mutation(
        "collapse-even-median-upper",
        "analysis/collapse.py",
        "median = earlier[n // 2] if n % 2 else (earlier[n // 2 - 1] + earlier[n // 2]) / 2",
        "median = earlier[n // 2]",
        ("tests/test_collapse.py::test_an_entropy_spike_is_the_first_step_past_3x_the_median_of_all_earlier_steps",),
    ),
    Mutation(
        "collapse-domain-from-the-chain-start",
        "analysis/collapse.py",
        "for d in eval_dirs[j:]], floor, peak)",
        "for d in eval_dirs], floor, peak)",
        ("tests/test_collapse.py::test_a_domain_collapses_only_after_its_own_stage_learnt_it",),
    ),
    Mutation(
        "kl-residual-sign",
        "analysis/kl_forgetting.py",
        "residual = np.where(used, y - fitted, math.nan)",
        "residual = np.where(used, fitted - y, math.nan)",
        (
            "tests/test_kl_forgetting.py::"
            "test_the_fit_is_closed_form_least_squares_and_a_residual_is_forgetting_above_the_line",
        ),
    ),
    Mutation(
        "drift-pairs-from-the-chain-start",
        "planning/chains.py",
        '("stage_start", self.stage_model(c, k - 1)[1])',
        '("stage_start", self.stage_model(c, 0)[1])',
        ("tests/test_chains.py::test_each_stage_drifts_from_where_its_chain_stood_before_it",),
    ),
    Mutation(
        "clean-stale-host-prefix",
        "io/atomic.py",
        "if host == HOST and pid.isdigit()",
        "if host.startswith(HOST) and pid.isdigit()",
        ("tests/test_atomic.py",),
    ),
    Mutation(
        "diverge-loop-unchecked",
        "train/onpolicy.py",
        "refuse_diverged(self.name, self.step, loss, norm)",
        "None",
        (f"{DIVERGE}::test_a_huge_learning_rate_stops_every_trainer_at_its_second_step",),
    ),
    Mutation(
        "diverge-trainers-unchecked",
        "train/diverge.py",
        "    if all(v is None or math.isfinite(v) for v in (loss, grad_norm)):",
        "    if True:",
        (f"{DIVERGE}::test_a_nan_loss_with_a_finite_gradient_stops_every_trainer",),
    ),
    Mutation(
        "gate-output-may-be-an-input",
        "io/gates.py",
        "if target == given or target in given.parents or given in target.parents:",
        "if False:",
        (f"{BAD}[sft-out-is-model]", f"{BAD}[graft-out-holds-post]"),
    ),
    Mutation(
        "gate-nan-passes-bounds",
        "io/gates.py",
        "    if not math.isfinite(parsed):",
        "    if False:",
        (f"{BAD}[sft--lr=inf]", f"{BAD}[plan--mfu=nan]"),
    ),
    Mutation(
        "part-takes-every-chunk",
        "sample_chunks.py",
        "        return i % self.count == self.index",
        "        return True",
        (f"{CHUNKS}::test_parts_of_a_call_fill_the_store_with_exactly_the_uninterrupted_samples",),
    ),
    Mutation(
        "part-returns-samples",
        "sample_chunks.py",
        "        if not self.part.whole:\n            return None",
        "        if False:\n            return None",
        (f"{CHUNKS}::test_parts_of_a_call_fill_the_store_with_exactly_the_uninterrupted_samples",),
    ),
    Mutation(
        "screen-touching-intervals",
        "analysis/screen.py",
        "new >= 0 and old >= 0 and (new > 0 or old > 0)",
        "new >= 0 and old >= 0",
        (f"{SCREEN}::test_a_graft_is_screened_out_exactly_when_an_interval_lies_wholly_beyond_its_own",),
    ),
    Mutation(
        "screen-one-axis",
        "analysis/screen.py",
        "new >= 0 and old >= 0 and (new > 0 or old > 0)",
        "(new >= 0 or old >= 0) and (new > 0 or old > 0)",
        (f"{SCREEN}::test_no_point_of_the_frontier_of_validation_means_is_screened_out",),
    ),
    Mutation(
        "screen-bootstrap-at-zero",
        "analysis/screen.py",
        '        if out[f"{role}_val_hi"] == 0:',
        "        if False:",
        (f"{SCREEN}::test_an_interval_collapsed_at_zero_or_one_is_widened_to_the_exact_binomial_bound",),
    ),
    Mutation(
        "kept-engine-any-model",
        "sampling.py",
        "    if kept.files != engine_files(model_dir):",
        "    if False:",
        (f"{SAMPLING}::test_a_job_scoring_several_models_keeps_one_engine_for_every_model_alike_but_for_its_weights",),
    ),
    Mutation(
        "kept-engine-old-weights",
        "sampling.py",
        '            self.llm.collective_rpc("graftlab_swap", args=(self.model_dir,))',
        "            pass",
        (f"{SAMPLING}::test_a_job_scoring_several_models_keeps_one_engine_for_every_model_alike_but_for_its_weights",),
    ),
    Mutation(
        "source-id-ignores-settings",
        "planning/layout.py",
        "    digest = hashlib.sha256(json.dumps(read, sort_keys=True).encode()).hexdigest()[:12]",
        '    digest = "0"',
        (f"{LAYOUT}::test_experiments_reading_one_data_set_share_its_file_and_any_change_to_it_makes_another",),
    ),
    Mutation(
        "mining-home-ignores-settings",
        "planning/layout.py",
        '            "mining": self.x["mining"],',
        '            "mining": None,',
        (f"{LAYOUT}::test_experiments_share_mining_and_the_post_models_evaluation_exactly_when_their_inputs_agree",),
    ),
    Mutation(
        "copied-evaluation-without-records",
        "evaluate/run.py",
        '    for name in [*(f.name for f in sorted(src.glob("*.parquet"))), "metrics.json"]:',
        '    for name in ["metrics.json"]:',
        (
            "tests/test_evaluate.py::test_an_evaluation_copied_for_another_experiment_is_the_same_files_its_metrics_last",
        ),
    ),
    Mutation(
        "summary-keeps-screened-out",
        "analysis/summary.py",
        '        if "screened_out" in record:\n            return None',
        "        if False:\n            return None",
        ("tests/test_screen.py::test_the_summary_leaves_a_screened_out_graft_out",),
    ),
]


def failing(src: Path, tests: tuple[str, ...]) -> set[str] | None:
    """The named tests (as given) with a failing case when graftlab is imported from `src`; None when
    pytest itself could not run them (a collection error, a name that matches nothing)."""
    env = os.environ | {"PYTHONPATH": str(src), "OMP_NUM_THREADS": "1"}
    where = subprocess.run(
        [sys.executable, "-c", "import graftlab; print(graftlab.__file__)"], env=env, capture_output=True, text=True
    )
    assert where.stdout.startswith(str(src)), f"graftlab imported from {where.stdout.strip()}, not {src}"
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-rf", "-p", "no:cacheprovider", *tests],
        env=env,
        capture_output=True,
        text=True,
        cwd=REPO,
    )
    if done.returncode not in (0, 1):
        print(done.stdout[-2000:], done.stderr[-2000:], file=sys.stderr)
        return None
    failed = [line.split()[1] for line in done.stdout.splitlines() if line.startswith("FAILED ")]
    return {t for t in tests if any(f.startswith(t) for f in failed)}


def check(worktree: Path, m: Mutation) -> str:
    """Apply `m` to the worktree, run its tests, restore the file; a table row. Caught: every named test
    fails on the mutation."""
    path = worktree / "src" / "graftlab" / m.file
    original = path.read_text()
    if original.count(m.old) != 1:
        return f"| {m.name} | `{m.file}`: the text to change is not found once (the code moved?) | | ERROR |"
    path.write_text(original.replace(m.old, m.new))
    try:
        failed = failing(worktree / "src", m.tests)
    finally:
        path.write_text(original)
    change = f"`{_first_difference(m.old, m.new)[0][:60]}` -> `{_first_difference(m.old, m.new)[1][:60]}`"
    tests = "<br>".join(f"`{t.removeprefix('tests/')}`" for t in m.tests)
    verdict = (
        "ERROR" if failed is None else "caught" if failed == set(m.tests) else "MISSED" if not failed else "PARTLY"
    )
    return f"| {m.name} | `{m.file}`: {change} | {tests} | {verdict} |"


def _first_difference(old: str, new: str) -> tuple[str, str]:
    """The first line where the change differs, before and after (empty where a line is removed)."""
    pairs = itertools.zip_longest(old.strip().splitlines(), new.strip().splitlines(), fillvalue="")
    return next(((a.strip(), b.strip()) for a, b in pairs if a != b), ("", ""))


def main(names: list[str]) -> int:
    if names == ["--list"]:
        print("\n".join(m.name for m in MUTATIONS))
        return 0
    chosen = [m for m in MUTATIONS if not names or m.name in names]
    worktree = Path(tempfile.mkdtemp(prefix="graftlab-mut-")) / "wt"
    subprocess.run(
        ["git", "worktree", "add", "--detach", str(worktree), "HEAD"], cwd=REPO, check=True, capture_output=True
    )
    for built in (REPO / "src" / "graftlab").glob("_kernel*.so"):  # the compiled kernel is not in git
        shutil.copy(built, worktree / "src" / "graftlab")
    try:
        tests = sorted({t for m in chosen for t in m.tests})
        print(f"unmutated: {'pass' if failing(worktree / 'src', tuple(tests)) == set() else 'FAIL'}")
        print("| mutation | change | tests | result |\n|---|---|---|---|")
        rows = []
        for m in chosen:
            rows.append(check(worktree, m))
            print(rows[-1], flush=True)
    finally:
        subprocess.run(["git", "worktree", "remove", "--force", str(worktree)], cwd=REPO, check=True)
    return 0 if all(r.endswith("| caught |") for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
