"""Job resources: the sizing function with figures worked by hand, and the Qwen3 preset's DAG resolved
under profiles/slurm, each job checked for its partition, GPUs, memory and runtime."""

import math
import re
from dataclasses import replace

import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from graftlab import memory
from graftlab.memory import Shape
from graftlab.planning.plan import sized_as
from graftlab.planning.resources import (
    CPU_KINDS,
    GPU_KINDS,
    MOST_PARTS,
    PARTS,
    SAMPLE_FLOPS,
    Cluster,
    classify,
    job_resources,
    misfit,
    nominal_memory,
    overtime,
    sampling_parts,
)
from tests.conftest import REPO, job_requests, snakemake

CLUSTER = Cluster(slurm_partition="cpu-part", gpu_partition="gpu-part")


# Qwen3-8B's shape (its config.json): 36 layers of 4,096, MLP 12,288, 8 KV heads of 128, 151,936 tokens.
QWEN3_8B = Shape(layers=36, hidden=4096, intermediate=12288, kv_heads=8, head_dim=128, vocab=151_936)


def test_sft_of_an_8b_model_by_hand():
    # One sequence of 8,704 tokens, recomputed: per token 36 x 4,096 x 2 (each layer's input) + one layer's
    # 16 x 4,096 + 6 x 1,024 + 8 x 12,288 + the logits' 151,936 x 16 = 2,895,872 bytes: 25.21 GB. Sharded
    # (FSDP): 16 + 4 bytes a parameter, 160 GB. A GPU of 80 GB holds 68 GB: 160 / n + 25.21 <= 68 from n = 4.
    need = memory.trainer(8e9, QWEN3_8B, tokens=8704, recompute=True, shards=True)
    assert need.parts["activations"] == 8704 * 2_895_872
    # Runtime: 6 x 8e9 x 1000 sequences x 1000 tokens = 4.8e16 FLOPs at 4 x 120e12/s = 100 s, + 10 min.
    # Host memory: 4 GB + each of the 4 processes' fp32 copy while it loads, 4 x 32 GB.
    r = job_resources("sft", 8e9, compute=4.8e16, memory=need, batch=64, cluster=CLUSTER)
    assert r == {
        "gpu": 4,
        "mem_mb": 132000,
        "runtime": 12,
        "cpus_per_task": 8,
        "nodes": 1,
        "slurm_partition": "gpu-part",
    }
    # A retry: x1.5 memory and runtime (11.67 min x 1.5 = 17.5).
    retry = job_resources("sft", 8e9, compute=4.8e16, memory=need, batch=64, attempt=2, cluster=CLUSTER)
    assert (retry["mem_mb"], retry["runtime"], retry["gpu"]) == (198000, 18, 4)
    # A batch of 63 splits over 7 processes, not 4, 5 or 6 (the 8B STaR preset's 64 over 3 failed every try).
    assert job_resources("sft", 8e9, memory=need, batch=63)["gpu"] == 7
    # An 8B OPSD cannot shard: 128 + 32 + a 32 GB teacher is more than one GPU holds. It asks for one GPU
    # (more would sit idle) and `misfit` says why.
    opsd = memory.trainer(8e9, QWEN3_8B, tokens=8704, recompute=True, scorers=1)
    assert job_resources("opsd", 8e9, compute=4.8e16, memory=opsd, batch=64)["gpu"] == 1
    assert "opsd: needs 217.2 GB a GPU on 1" in misfit("opsd", opsd, Cluster(), 64)
    assert misfit("opsd", opsd, Cluster(gpu_memory_gb=300), 64) is None and misfit("sft", need, Cluster(), 64) is None


def test_sampling_and_cpu_jobs_by_hand():
    # 2 bytes/param x 8e9 x 1.25 = 20 GB: one GPU. 2 x 8e9 x 1e4 x 1e4 = 1.6e18 FLOPs at 40e12/s =
    # 40,000 s = 666.7 min, + 10.
    r = job_resources("mine", 8e9, generate=1.6e18, cluster=CLUSTER)
    assert (r["gpu"], r["runtime"], r["slurm_partition"]) == (1, 677, "gpu-part")
    # OPSD decodes and passes whole sequences: 1.2e17 FLOPs at 40e12/s + 7.2e17 at 120e12/s = 3,000 + 6,000 s.
    o = job_resources("opsd", 1e9, generate=1.2e17, compute=7.2e17)
    assert (o["gpu"], o["runtime"]) == (1, 160)
    # A graft job grafts (16 bytes/param in host memory: 4 GB + 128 GB, streamed at 50 MB/s: 42.7 min) and
    # evaluates its model on a GPU (1.2e17 FLOPs at 40e12/s: 50 min), + 10 min.
    g = job_resources("graft", 8e9, generate=1.2e17, cluster=CLUSTER)
    assert (g["gpu"], g["mem_mb"], g["runtime"], g["slurm_partition"]) == (1, 132000, 103, "gpu-part")
    # A continual chain's graft is kept for the next stage and evaluated apart: a CPU job.
    c = job_resources("chain_graft", 8e9, cluster=CLUSTER)
    assert (c["gpu"], c["mem_mb"], c["runtime"], c["cpus_per_task"], c["slurm_partition"]) == (
        0,
        132000,
        53,
        1,
        "cpu-part",
    )
    assert "slurm_partition" not in job_resources("chain_graft", 8e9)  # no cluster: no partition
    assert job_resources("mine", 1e12, generate=2e23)["runtime"] == 48 * 60  # capped


@given(grafts=st.integers(1, 40), params=st.floats(1e6, 1e11), minutes=st.floats(0, 1e4))
def test_a_sweep_asks_for_every_grafts_streaming_through_host_memory(grafts, params, minutes):
    # Each graft streams 16 bytes/param through host memory at 50 MB/s before it is evaluated, one graft
    # after another; the sampling is each graft's (`minutes` of KV-cache reads at 0.2 x 3.35e12 B/s).
    uncapped = Cluster(gpu_max_runtime=10**9)
    kv_read = grafts * minutes * 60 * 0.2 * 3.35e12
    job = job_resources("graft", params, kv_read=kv_read, streams=grafts, cluster=uncapped)
    expected = 10 + grafts * params * 16 / 50e6 / 60 + grafts * minutes
    assert job["runtime"] == math.ceil(expected) or math.isclose(job["runtime"], expected, abs_tol=1)


@given(gb=st.floats(0.01, 1000), batch=st.integers(1, 256), sharded=st.booleans(), node=st.integers(1, 16))
def test_the_gpus_of_a_job_are_the_fewest_on_a_node_that_hold_it_and_divide_its_batch(gb, batch, sharded, node):
    need = nominal_memory("sft", 8e9)
    need = need if sharded else replace(need, sharded=frozenset())
    cluster = Cluster(gpu_memory_gb=gb, gpus_per_node=node)
    gpus = job_resources("sft", 8e9, memory=need, batch=batch, cluster=cluster)["gpu"]
    holds = lambda n: batch % n == 0 and need.per_gpu(n) <= memory.GPU_SHARE * gb * 1e9  # noqa: E731
    if not any(holds(n) for n in range(1, node + 1) if sharded or n == 1):
        # No count a node holds: one GPU, and `misfit` names the job.
        assert gpus == 1 and misfit("sft", need, cluster, batch).startswith("sft: ")
    else:
        assert gpus <= node and holds(gpus) and not any(holds(n) for n in range(1, gpus)) and (sharded or gpus == 1)
        assert misfit("sft", need, cluster, batch) is None


@given(bad=st.one_of(st.floats().filter(lambda x: not (math.isfinite(x) and x > 0)), st.text(), st.booleans()))
def test_a_gpu_memory_that_is_not_a_positive_number_is_refused_by_name(bad):
    if isinstance(bad, str):
        assume(not _positive(bad))
    with pytest.raises(ValueError, match="gpu_memory_gb must be a positive number of GB"):
        Cluster.of({"gpu_memory_gb": bad})


def _positive(text: str) -> bool:
    try:
        return math.isfinite(float(text)) and float(text) > 0
    except ValueError:
        return False


def test_an_unsized_rule_is_an_error():
    with pytest.raises(KeyError, match="not sized"):
        classify("new_rule")


def workflow_rules() -> set[str]:
    """Every rule's name, and the name each rule a loop defines is sized under (`sized("evaluate_run")`)."""
    texts = [f.read_text() for f in [REPO / "Snakefile", *sorted((REPO / "rules").glob("*.smk"))]]
    found = [re.findall(r"^rule (\w+):|^\s+\*\*sized\(\"(\w+)\"\)", t, re.M) for t in texts]
    return {name for pairs in found for pair in pairs for name in pair if name}


def test_every_rule_is_sized_once():
    rules = workflow_rules()
    assert not set(GPU_KINDS) & set(CPU_KINDS)
    unsized = sorted(r for r in rules if r not in GPU_KINDS and r not in CPU_KINDS)
    assert not unsized, f"rules missing from graftlab.planning.resources: {unsized}"
    assert not (set(GPU_KINDS) | set(CPU_KINDS)) - rules  # nothing stale either


def dry_run_jobs(workdir, *args):
    proc = snakemake(workdir, "-n", *args, configs=(REPO / "configs" / "qwen3-1.7b-star.yaml",))
    assert proc.returncode == 0, proc.stderr[-3000:]
    jobs = job_requests(proc.stdout + proc.stderr)
    assert jobs
    return jobs


def test_qwen3_preset_resolves_under_the_slurm_profile(tmp_path):
    jobs = dry_run_jobs(tmp_path, "--profile", str(REPO / "profiles" / "slurm"))
    seen = {}
    for named, res in jobs:
        if named == "all":
            continue
        rule = sized_as(named)  # the rules evaluating a training run's checkpoints are sized as `evaluate_run`
        gpu = classify(rule) == "gpu"
        assert res["slurm_partition"] == ("YOUR_GPU_PARTITION" if gpu else "YOUR_CPU_PARTITION"), rule
        assert (int(res.get("gpu", 0)) >= 1) == gpu, rule
        seen[rule] = (int(res.get("gpu", 0)), int(res["mem_mb"]), int(res["runtime"]))
    assert {r for r in seen if classify(r) == "gpu"} == {
        "mine",
        "star",
        "sft",
        "opsd",
        "rollouts",
        "fisher",
        "evaluate",
        "evaluate_run",
        "graft",
    }
    # Qwen3-1.7B (the preset's 1.72e9 hint): SFT and the Fisher on one GPU, 4 GB + 4 bytes/param of host memory.
    assert all(seen[r][:2] == (1, 10880) for r in ("sft", "fisher"))
    # MATH sets no limit: 10,000 candidates, half kept as hard, 200 held out: 4,800 to train on; every
    # sequence 512 prompt + 8,192 generated = 8,704 tokens (graftlab.planning.work).
    # SFT: 6 x 1.72e9 x 3 epochs x 4,800 x 8,704 = 1.2935e18 FLOPs at 120e12/s = 179.6 min, + 10.
    assert seen["sft"][2] == 190
    # Mining samples 16 x 10,000 answers of 8,192 tokens after 512: each new token reads the KV cache of
    # every token before it, 512 x 8,192 + 8,192^2 / 2 token-reads an answer, each 2 (K, V) x 24 layers x 4
    # KV heads x 128 x 2 bytes (the shape a 1.72e9 model is assumed to have): 2.97e17 bytes at 0.67e12 B/s,
    # 7,385 minutes, where its FLOPs alone (2 x 1.72e9 x 160,000 x 8,704 at 40e12/s) take 1,996. STaR's 32
    # attempts x 4,800 answers: 7,089. One engine would need more than the 48-hour limit less the setup
    # (2,870 minutes), so each runs 3 engines at once, each on a GPU and loading the model in its own process.
    assert (seen["mine"], seen["star"]) == ((3, 4000 + 3 * 4 * 1720, 2472), (3, 4000 + 3 * 4 * 1720, 2374))
    # Evaluation: 1,700 problems (500 for each of the 3 benchmarks that set no limit, 200 held out) x 16
    # answers of up to 32,768 tokens read 7.4e17 bytes of KV cache: 307 hours for one engine, 7 at once.
    assert seen["evaluate"] == (7, 4000 + 7 * 4 * 1720, 2641)
    # A graft sweep's job evaluates its 3 models (lam 0.25, 0.5, 1) each as an evaluation of a model that
    # size does (the donor is the base model, as large as post): 3 x 307 hours, a node's 8 engines at once
    # and still past the 48-hour limit, which its requeued attempts resume past (its chunks kept).
    assert seen["graft"] == (8, 4000 + 8 * 4 * 1720, 2880)
    # Each graft streams 16 bytes/param through host memory at 50 MB/s: 9.2 minutes more than an evaluation.
    uncapped = Cluster(gpu_max_runtime=10**6)
    graft, evaluation = (job_resources(r, 1.72e9, kv_read=1e15, cluster=uncapped) for r in ("graft", "evaluate"))
    assert graft["runtime"] - evaluation["runtime"] in (9, 10)
    assert all(res["temp_grafts"] == "1" for rule, res in jobs if sized_as(rule) == "graft")
    assert seen["fetch_model"][0] == 0


def test_a_job_that_cannot_shard_and_fits_no_gpu_is_refused_before_any_is_submitted(tmp_path):
    """On 2 GB GPUs the 1.7B preset's samplers (vLLM engines on one GPU: the weights alone are 3.4 GB) fit
    no count: the dry run, which builds the DAG as a submitting run does, stops on the first, in one line
    naming the rule. SFT, which shards, would only be warned about: smaller micro-batches may still fit it."""
    preset = (REPO / "configs" / "qwen3-1.7b-star.yaml",)
    proc = snakemake(tmp_path, "-n", "--default-resources", "gpu_memory_gb=2", configs=preset)
    assert proc.returncode != 0
    said = proc.stdout + proc.stderr
    refused = re.findall(r"^\s*(\w+): needs .* more than 85% of a 2 GB GPU, and cannot shard over GPUs;", said, re.M)
    assert len(refused) == 1 and refused[0] in ("mine", "star", "rollouts", "evaluate", "graft"), said[-3000:]
    assert not (tmp_path / "results").exists()


def test_local_runs_name_no_partition(tmp_path):
    jobs = dry_run_jobs(tmp_path)
    assert all("slurm_partition" not in res for _, res in jobs)


@pytest.mark.workflow
@pytest.mark.parametrize(
    ("profile", "args", "cap"),
    [(False, (), "2"), (True, (), None), (True, ("--resources", "temp_grafts=5"), "5")],
    ids=["no-profile", "cluster-profile", "command-line"],
)
def test_the_grafts_cap_is_the_cluster_profiles_else_two(tmp_path, profile, args, cap):
    """The cap Snakemake schedules by (its 'Provided resources' line of a real one-job run): the command
    line's, else the cluster profile's (which the workflow profile, profiles/default, must not override),
    else graftlab's default (rules/common.smk)."""
    import yaml

    cluster = yaml.safe_load((REPO / "profiles" / "slurm" / "config.yaml").read_text())
    if profile:
        # profiles/slurm's own `resources`, on the local executor (no scheduler on this machine).
        (tmp_path / "profile").mkdir()
        local = {"resources": cluster["resources"], "cores": 1}
        (tmp_path / "profile" / "config.yaml").write_text(yaml.safe_dump(local))
        where = ("--profile", str(tmp_path / "profile"))
    else:
        where = ("--cores", "1")
    cap = cap or dict(r.split("=") for r in cluster["resources"])["temp_grafts"]
    assert cap != "2" or not profile  # the cluster's cap must differ from the default to be seen
    # The target between flags: --configfile (first) and --resources (last) each take a list.
    done = snakemake(tmp_path, *where, "results/world/tokenizer", *args)
    assert done.returncode == 0, done.stderr[-3000:]
    provided = re.search(r"^Provided resources: .*$", done.stdout + done.stderr, re.M)
    # Snakemake prints a resource as `name=value` or, parsed, `name=Resource("name", value)`.
    assert provided and re.findall(r'temp_grafts=(?:Resource\("temp_grafts", )?(\d+)', provided[0]) == [cap]


def test_the_cluster_shape_reaches_the_gpu_rules_alone():
    cluster = Cluster.of(
        {
            "gpu_type": "h100",
            "gpu_constraint": "hopper",
            "gpu_qos": "high",
            "gpu_max_runtime": "1440",
            "cpu_max_runtime": 60,
        }
    )
    gpu = job_resources("mine", 8e9, generate=1e24, cluster=cluster)
    cpu = job_resources("chain_graft", 8e11, cluster=cluster)
    assert (gpu["gpu_model"], gpu["constraint"], gpu["qos"], gpu["runtime"]) == ("h100", "hopper", "high", 1440)
    assert not {"gpu_model", "constraint", "qos"} & set(cpu) and cpu["runtime"] == 60  # capped at its partition's
    # A job needing more GPUs than a node has fits no count: one GPU, and the reason names the node's count.
    need = nominal_memory("sft", 8e9)
    small = Cluster(gpu_memory_gb=24, gpus_per_node=4)
    assert job_resources("sft", memory=need, batch=64, cluster=small)["gpu"] == 1
    assert "no count of up to 4 GPUs dividing its batch of 64" in misfit("sft", need, small, 64)


@pytest.mark.parametrize("key", ["gpus_per_node", "cpu_max_runtime", "gpu_max_runtime"])
@pytest.mark.parametrize("bad", ["0", "-3", "8.5", "eight", True])
def test_a_cluster_count_that_is_not_a_whole_number_is_refused_by_name(key, bad):
    with pytest.raises(ValueError, match=f"{key} must be a whole number >= 1"):
        Cluster.of({key: bad})


def test_no_cluster_key_but_the_default_partition_is_one_the_slurm_plugin_reads():
    """The profile's default-resources reach every job, CPU jobs too: a key the plugin reads there (its
    `gpu_model`, `constraint`, `qos`) would give each CPU job a GPU model, constraint or QoS. graftlab's own
    names stay apart; the GPU rules translate them (`job_resources`)."""
    from dataclasses import fields
    from pathlib import Path

    import snakemake_executor_plugin_slurm as plugin

    source = "\n".join(p.read_text() for p in Path(plugin.__file__).parent.glob("*.py"))
    read = set(re.findall(r"resources\.get\(\s*[\"'](\w+)[\"']", source))
    read |= set(re.findall(r"resources\.(\w+)\b", source)) - {"get"}
    assert {"gpu_model", "constraint", "qos", "slurm_partition"} <= read  # what the plugin reads, as expected
    assert {f.name for f in fields(Cluster)} & read == {"slurm_partition"}


def test_param_drift_is_sized_by_its_decompositions():
    """Finding 6 of issue 31: the 4B chain's parameter drift asked for 4 GB and 10 minutes. Sized by its SVDs,
    its 104 pairs would take a month in one job; a job a chain's model after a stage (2 pairs) fits the
    48-hour limit."""
    import yaml

    from graftlab.planning.chains import Continual
    from graftlab.planning.config import resolve
    from graftlab.planning.work import continual_work

    config = resolve(yaml.safe_load((REPO / "configs" / "qwen3-4b-continual.yaml").read_text()))
    layout = Continual.of(config, next(n for n, x in config["experiments"].items() if x["stages"]))
    chain = layout.chains()[0].key
    work = continual_work("stage_drift", config, layout, {"chain": chain, "k": "2"})
    shape = work.model.shape  # assumed from 4.02e9 parameters until the model is fetched: 32 layers of 3,200
    widest = shape.vocab * shape.hidden  # the embedding
    assert work.host == 6 * 8 * widest and len(layout.drift_pairs()) == 104
    # Two thin SVDs (6 m n^2 FLOPs each) of every matrix, 2 pairs (against the stage's start and the post
    # model): the embedding's alone 2 x 2 x 6 m n^2.
    assert len(layout.stage_drift_pairs(chain, 2)) == 2 and work.compute >= 2 * 2 * 6 * shape.vocab * shape.hidden**2
    r = job_resources("stage_drift", work.model.params, compute=work.compute, host=work.host)
    assert r["mem_mb"] == math.ceil(4000 + work.host / 1e6)
    assert 60 < r["runtime"] < 48 * 60 and 104 / 2 * (r["runtime"] - 10) > 30 * 24 * 60
    assert job_resources("param_drift", compute=0.0)["runtime"] == 10  # the tables in one


def test_decoding_takes_the_longer_of_its_flops_and_its_kv_cache_reads():
    """A short decode is bound by its FLOPs (40e12/s), a long reasoning decode by reading its KV cache
    (0.2 x 3.35e12 B/s): the runtime takes the slower, plus 10 minutes of setup (a model too small for its
    weights' streaming through host memory to add a minute)."""
    assert job_resources("evaluate", generate=4e16, kv_read=1e14)["runtime"] == 10 + math.ceil(4e16 / 40e12 / 60)
    assert job_resources("evaluate", generate=4e16, kv_read=1e17)["runtime"] == 10 + math.ceil(1e17 / 6.7e11 / 60)


def test_a_job_longer_than_its_partitions_limit_is_named_unless_it_resumes():
    # Mining 1.6e19 FLOPs at 40e12/s: 111 hours, 6,667 minutes. One engine would need more than the 48-hour
    # limit less the setup (2,870), so the job runs 3 at once on 3 GPUs (graftlab.sample_chunks.DataParallel).
    assert job_resources("mine", 8e9, generate=1.6e19).items() >= {"gpu": 3, "runtime": 10 + 2223}.items()
    # On nodes of 2 GPUs, 2 engines: 3,343 minutes, held to the limit; its finished chunks carry it over.
    pair = Cluster(gpus_per_node=2)
    assert job_resources("mine", 8e9, generate=1.6e19, cluster=pair).items() >= {"gpu": 2, "runtime": 48 * 60}.items()
    assert overtime("mine", pair, attempts=2, generate=1.6e19, params=8e9) is None
    assert overtime("mine", pair, attempts=1, generate=1.6e19, params=8e9) == (
        "mine: needs about 56 hours, more than its partition's 48 x 1 attempts (Snakemake's retries + 1), "
        "each continuing the last: raise retries"
    )
    # A graft job's chunks are kept under its inputs, so it resumes too, though its model is made anew. Beyond
    # its attempts, an evaluation or a graft is told the parts that would bring each within one limit: on
    # nodes of 2 GPUs, 56 hours with its weights streamed; two parts of 28.
    assert overtime("graft", pair, attempts=3, generate=1.6e19, params=8e9) is None
    assert overtime("graft", pair, attempts=1, generate=1.6e19, params=8e9) == (
        "graft: needs about 56 hours, more than its partition's 48: "
        "split its sampling over 2 jobs at once (eval.parts: 2), or raise retries"
    )
    assert overtime("graft", pair, attempts=1, generate=1.6e19, params=8e9, part_of=2) is None
    assert overtime("graft", Cluster(gpus_per_node=2, gpu_max_runtime=3500), generate=1.6e19, params=8e9) is None
    assert all(overtime(r, generate=1.6e19, params=8e9) is None for r in ("mine", "evaluate_run", "star", "graft"))
    # A trainer on one GPU saves its state and resumes; over several SFT's and GRPO's processes save none,
    # our own loops' (OPSD, SDPO) a whole state. 4e19 FLOPs at 120e12/s: 93 hours.
    assert job_resources("sft", 1.7e9)["gpu"] == 1 and overtime("sft", attempts=3, compute=4e19, params=1.7e9) is None
    assert job_resources("sft", 8e9)["gpu"] > 1 and job_resources("opsd", 8e9)["gpu"] > 1
    for rule in ("sft", "grpo"):
        late = overtime(rule, attempts=3, compute=4e19 * job_resources(rule, 8e9)["gpu"], params=8e9)
        assert late.startswith(f"{rule}: needs about ")
        assert late.endswith("and runs over several GPUs, where it saves no resume state")
    assert overtime("opsd", attempts=3, compute=4e19 * job_resources("opsd", 8e9)["gpu"], params=8e9) is None
    assert overtime("param_drift", Cluster(cpu_max_runtime=60), compute=1e15) == (
        "param_drift: needs about 56 hours, more than its partition's 1, and does not resume"
    )


@settings(max_examples=200, deadline=None)
@given(hours=st.floats(1, 48 * 8 * 70), gpus_per_node=st.sampled_from([1, 2, 4, 8]))
def test_a_split_evaluation_takes_the_fewest_parts_that_each_fit_one_limit(hours, gpus_per_node):
    """An evaluation decoding `hours` of one GPU's work, on nodes of `gpus_per_node`: each of n parts decodes
    hours / n on as many engines as it needs, a node's at most, within 48 hours less 10 minutes of setup,
    so n = ceil(minutes / (engines x 2,870)), counted here by hand; None beyond 64 parts."""
    cluster = Cluster(gpus_per_node=gpus_per_node)
    generate = hours * 60 * 60 * SAMPLE_FLOPS
    minutes = generate / SAMPLE_FLOPS / 60
    by_hand = math.ceil(minutes / (gpus_per_node * (48 * 60 - 10)) - 1e-9)
    parts = sampling_parts("evaluate", cluster, generate=generate, params=2e9)
    assert parts == (by_hand if by_hand <= MOST_PARTS else None)
    if parts:
        part = job_resources("evaluate", 2e9, generate=generate, cluster=cluster, capped=False, part_of=parts)
        assert part["runtime"] <= 48 * 60 and part["gpu"] <= gpus_per_node
    assert sampling_parts("mine", cluster, generate=generate, params=2e9) == 1  # STaR's rounds do not split


def test_the_most_parts_are_the_configs_bound():
    from graftlab.schema import load_schema

    parts = load_schema()["$defs"]["experiment"]["properties"]["eval"]["properties"]["parts"]
    assert parts["maximum"] == MOST_PARTS
    assert PARTS == {"evaluate": "evaluate_part", "evaluate_run": "evaluate_run_part", "graft": "graft_part"}
