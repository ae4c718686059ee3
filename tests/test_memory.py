"""The memory model (graftlab.memory): each part against a count by hand, and every job of every preset
sized by it under the cluster profile's 80 GB GPUs."""

from pathlib import Path

import pytest
import yaml

from graftlab import memory
from graftlab.memory import Shape
from graftlab.planning.chains import Continual, is_continual
from graftlab.planning.config import resolve
from graftlab.planning.layout import Experiment
from graftlab.planning.plan import continual_jobs, experiment_jobs, sized_as
from graftlab.planning.resources import Cluster, classify, job_resources, misfit
from graftlab.planning.work import continual_work, decoder_model, job_work, kfac_factor_bytes
from tests.conftest import REPO

QWEN3_4B = {  # Qwen3-4B's config.json, the fields the model reads
    "hidden_size": 2560,
    "intermediate_size": 9728,
    "num_hidden_layers": 36,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "vocab_size": 151936,
    "tie_word_embeddings": True,
}


def test_the_shape_and_parts_of_qwen3_4b_by_hand():
    model = decoder_model(QWEN3_4B, 2, "config.json")
    assert model.shape == Shape(36, 2560, 9728, 8, 128, 151936)
    assert round(model.params / 1e9, 2) == 4.02  # Qwen3-4B's card: 4.0B
    # KV cache: K and V, 36 layers, 8 heads of 128, 2 bytes: 147,456 bytes a token; 8,192 tokens: 1.21 GB.
    engine = memory.sampler(model.params, model.shape, tokens=8192)
    assert engine.parts == {"weights": 2 * model.params, "KV cache": 8192 * 147_456}
    # A layer keeps 16 x 2,560 + 6 x 1,024 + 8 x 9,728 = 124,928 bytes a token in bf16, 249,856 in fp32.
    assert model.shape.layer_bytes() == 124_928 and model.shape.layer_bytes(4) == 249_856
    # Not recomputed, fp32: 36 layers x 249,856 + logits 151,936 x 20 = 12,033,536 bytes a token.
    assert memory.activations(model.shape, 1, act_bytes=4) == 36 * 249_856 + 151_936 * 20
    # Recomputed, bf16: each layer's input 36 x 2,560 x 2, one layer whole, logits x 16.
    assert memory.activations(model.shape, 1, recompute=True) == 36 * 5120 + 124_928 + 151_936 * 16
    # The Fisher: fp32 weights and accumulator, one rollout's fp32 activations, the widest weight's
    # per-rollout gradient (the 151,936 x 2,560 embedding, more than a chunk: a chunk of 2^25 floats).
    fisher = memory.fisher(model.params, model.shape, rollouts=1, sequence=1000)
    assert fisher.parts == {
        "weights and accumulator": 8 * model.params,
        "activations": 1000 * 12_033_536,
        "per-rollout gradients": 2**25 * 4,
    }
    # KFAC: per layer a G for each of q, k, v and o, and an A for each input they read (q/k/v share one),
    # each factor with its eigenvectors and eigenvalues. The MLP's layers, 9,728 wide, are wider than
    # max_dim (8,192): they get the diagonal. With max_dim 10,000 they are factored too (gate/up share an A).
    g, a = [4096, 1024, 1024, 2560], [2560, 4096]
    per_layer = sum(2 * o * o + o for o in g) + sum(2 * i * i + i for i in a)
    assert kfac_factor_bytes(model) == 4 * 36 * per_layer
    g, a = g + [9728, 9728, 2560], a + [2560, 9728]
    per_layer = sum(2 * o * o + o for o in g) + sum(2 * i * i + i for i in a)
    assert kfac_factor_bytes(model, max_dim=10_000) == 4 * 36 * per_layer


def test_a_model_known_by_its_size_alone_has_a_plausible_shape():
    for params, layers in ((0.6e9, 17), (8e9, 41), (70e9, 84)):
        shape = Shape.of_params(params)
        assert (
            shape.assumed
            and shape.layers == layers
            and 12 * shape.layers * shape.hidden**2 == pytest.approx(params, rel=0.1)
        )


def test_a_tensor_parallel_engine_asks_for_its_span_and_no_other_count():
    config = {"vllm": {"tensor_parallel_size": 4}}
    from graftlab.planning.work import sampler_memory

    model = decoder_model(QWEN3_4B, 2, "config.json")
    need = sampler_memory(config, model, 1000)
    assert need.spans == 4 and need.gpus(80e9) == 4 and need.per_gpu(4) == pytest.approx(need.total / 4)
    huge = sampler_memory(config, decoder_model(QWEN3_4B | {"num_hidden_layers": 3600}, 2, "x"), 1000)
    assert huge.gpus(80e9) is None and "raise vllm.tensor_parallel_size" in misfit("mine", huge)


# SFT, GRPO, OPSD, SDPO and both Fishers shard over the GPUs of one node (graftlab.train.shard): every job
# of every preset has a count of 80 GB GPUs that holds it.
PRESETS = sorted(p.stem for p in (REPO / "configs").glob("*.yaml"))


@pytest.mark.parametrize("preset", PRESETS)
def test_every_job_of_a_preset_fits_the_gpus_it_asks_for_and_divides_its_batch(preset):
    """Under the cluster profile's GPU size every job asks for GPUs on which its share fits and over which
    its batch divides."""
    profile = yaml.safe_load((REPO / "profiles" / "slurm" / "config.yaml").read_text())
    cluster = Cluster.of(profile["default-resources"])
    config = resolve(yaml.safe_load(Path(REPO / "configs" / f"{preset}.yaml").read_text()))
    sized = 0
    for name, x in config["experiments"].items():
        if is_continual(x):
            c = Continual.of(config, name)
            jobs = [(rule, continual_work(sized_as(rule), config, c, w)) for rule, w in continual_jobs(c)]
        else:
            layout = Experiment.of(config, name)
            jobs = [(rule, job_work(sized_as(rule), config, layout, w)) for rule, w in experiment_jobs(layout)]
        for rule, work in jobs:
            if classify(sized_as(rule)) != "gpu":
                continue
            assert work.memory is not None, rule
            assert misfit(sized_as(rule), work.memory, cluster, work.batch) is None
            gpus = job_resources(sized_as(rule), memory=work.memory, batch=work.batch, cluster=cluster)["gpu"]
            assert work.memory.per_gpu(gpus) <= memory.GPU_SHARE * cluster.gpu_memory_gb * 1e9, rule
            # A Fisher's processes each run every rollout: it has no batch to split.
            whole = work.batch is None and sized_as(rule) == "fisher"
            assert gpus == 1 or whole or (work.batch is not None and work.batch % gpus == 0), rule
            sized += 1
    assert sized


def test_a_fisher_on_a_gpu_takes_as_many_rollouts_a_pass_as_fit(monkeypatch):
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from graftlab.fisher.diag import fitting_batch

    config = Qwen3Config(
        vocab_size=100, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2
    )
    model = Qwen3ForCausalLM(config)
    rollouts = [([1] * 10, [2] * 30)] * 16  # 40 tokens each
    assert fitting_batch(16, rollouts, model) == 16  # a CPU: the configured batch
    params = sum(p.numel() for p in model.parameters())
    per = memory.activations(Shape.of_config(config.to_dict()), 40, act_bytes=4)
    coming = params * 4 + memory.CHUNK_BYTES  # the accumulator and a chunk, still to be allocated
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    for fits, free in ((5, 5.5), (1, 0.2), (16, 100)):
        room = (coming + free * per) / memory.GPU_SHARE
        monkeypatch.setattr(torch.cuda, "mem_get_info", lambda room=room: (int(room), int(room)))
        assert fitting_batch(16, rollouts, model) == fits
    # The diagonal recomputes each layer: a rollout takes each layer's input and one layer's set.
    per = memory.activations(Shape.of_config(config.to_dict()), 40, act_bytes=4, recompute=True)
    room = (coming + 5.5 * per) / memory.GPU_SHARE
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda: (int(room), int(room)))
    assert fitting_batch(16, rollouts, model, recompute=True) == 5


def test_our_loops_shard_student_and_teacher_and_keep_a_frozen_teacher_in_bf16():
    """OPSD and SDPO divide the student's training state and the teacher over their GPUs
    (graftlab.train.shard); a frozen teacher takes 2 bytes a parameter, a moving one 4. GRPO shards through
    accelerate and, sharded, saves no resume state."""
    from graftlab.methods import METHODS

    opsd, sdpo, grpo = (METHODS[m].spec for m in ("opsd", "sdpo", "grpo"))
    assert opsd.shards and sdpo.shards and grpo.shards
    assert opsd.resumes_sharded and sdpo.resumes_sharded and not grpo.resumes_sharded
    assert opsd.scorer_bytes({}) == 2
    assert sdpo.scorer_bytes({"teachers": ["frozen"], "cot_teachers": ["ema:0.05"]}) == 2  # sdpo's own list
    assert sdpo.scorer_bytes({"teachers": ["frozen", "ema:0.05"]}) == 4
    # Each process samples an equal share of the problems and trains on one of every update's rollouts.
    section = {"batch_size": 6, "generations": 4, "updates_per_batch": 4}
    assert sdpo.batch(section) == 6 and sdpo.split(section) == 6
    assert sdpo.split(section | {"updates_per_batch": 3}) == 2  # 8 rollouts an update, 6 problems
    shape = Shape.of_params(4e9)
    need = memory.trainer(4e9, shape, tokens=1000, scorers=1, scorer_bytes=2, shards=True)
    assert need.parts["scoring models"] == 8e9
    whole = need.parts["trained model"] + need.parts["optimizer step"] + need.parts["scoring models"]
    assert need.per_gpu(4) == pytest.approx(whole / 4 + need.parts["activations"])
