"""The work model the scheduler and the cost plan share: model sizes against transformers and by hand,
where a size comes from, and one job's FLOPs worked out by hand."""

import copy
import json

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from graftlab.planning.config import resolve
from graftlab.planning.layout import Experiment
from graftlab.planning.work import WORLD_VOCAB, Assumptions, decoder_model, job_work, model_of, size_in_name, world_work
from tests.test_plan import HAND, SAMPLES

QWEN3_1_7B = {
    "hidden_size": 2048,
    "intermediate_size": 6144,
    "num_hidden_layers": 28,
    "num_attention_heads": 16,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "vocab_size": 151936,
    "tie_word_embeddings": True,
}


def test_qwen3_1_7b_by_hand():
    # attention 2*2048*16*128 + 2*2048*8*128 = 12,582,912; MLP 3*2048*6144 = 37,748,736; norms per layer
    # 2*2048 + 2*128 = 4,352; 28 layers = 1,409,407,996 + the final norm 2,048; tied embeddings 311,164,928.
    model = decoder_model(QWEN3_1_7B, 2, "")
    assert model.params == 28 * (12_582_912 + 37_748_736 + 4_352) + 2_048 + 311_164_928 == 1_720_574_976
    assert len(model.linears) == 28 * 7


def test_a_mixture_of_experts_counts_every_expert_and_its_router():
    moe = {**QWEN3_1_7B, "num_hidden_layers": 1, "num_experts": 4, "moe_intermediate_size": 768}
    dense = {**QWEN3_1_7B, "num_hidden_layers": 1, "intermediate_size": 4 * 768}
    # Four experts of width 768 hold the weights of one MLP of width 3,072, plus a 2048 x 4 router.
    assert decoder_model(moe, 2, "").params - decoder_model(dense, 2, "").params == 2048 * 4


def test_world_count_matches_transformers():
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from graftlab.world.tokenizer import CHARS, SPECIALS

    assert len(SPECIALS + CHARS) == WORLD_VOCAB
    arch = {"hidden_size": 64, "intermediate_size": 128, "layers": 2, "heads": 2, "kv_heads": 1}
    config = Qwen3Config(
        vocab_size=WORLD_VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=32,
        tie_word_embeddings=True,
    )
    real = sum(p.numel() for p in Qwen3ForCausalLM(config).parameters())
    world = {"model": arch, "corpus": {"block": 64}, "pretrain": {"steps": 0, "batch_size": 0, "ladder": []}}
    assert world_work("world_pretrain", world).model.params == real


def test_model_sizes_in_hub_ids():
    assert size_in_name("Qwen/Qwen3-8B") == 8e9
    assert size_in_name("Qwen/Qwen3-1.7B-Base") == 1.7e9
    assert size_in_name("allenai/Olmo-3-1025-7B") == 7e9
    assert size_in_name("org/model") is None


def test_a_model_size_comes_from_its_fetched_config_then_its_hint_then_its_name(tmp_path):
    config = resolve(
        {**copy.deepcopy(HAND), "models": {"m": {"source": "org/Model-1B", "params": 3e9}, "d": {"source": "org/d"}}}
    )
    layout = Experiment.of(config, "x")
    assert model_of(config, layout, "post", tmp_path).params == 3e9  # the hint, not the name's 1B
    with pytest.raises(ValueError, match="no config.json fetched and no size"):
        model_of(config, layout, "d", tmp_path)
    fetched = tmp_path / layout.model_dir("m")
    fetched.mkdir(parents=True)
    (fetched / "config.json").write_text(json.dumps({**QWEN3_1_7B, "torch_dtype": "bfloat16"}))
    model = model_of(config, layout, "post", tmp_path)
    assert (model.params, model.bytes_per_param) == (1_720_574_976, 2)


def test_one_job_by_hand(tmp_path):
    """HAND's 1B model, STaR data: 100 candidates, half kept, 10 held out; prompts of 256 tokens."""
    config = resolve(copy.deepcopy(HAND))
    layout, a = Experiment.of(config, "x"), Assumptions(prompt_tokens=256)

    def work(rule, **wildcards):
        return job_work(rule, config, layout, wildcards, a, tmp_path)

    assert work("mine").generate == pytest.approx(2e9 * 100 * 8 * 1000) and work("mine").compute == 0
    sft = work("sft", donor="d")
    assert (sft.compute, sft.written) == (pytest.approx(6e9 * 2 * 40 * 1000), 2 * 4e9)
    # The Fisher's per-example gradients: one backward pass per rollout token; its file in fp32.
    fisher = work("fisher", mask="diag")
    assert (fisher.compute, fisher.written) == (pytest.approx(6e9 * 100 * 1000), 4e9)
    # Evaluation: (50 benchmark + 10 held-out problems) x 2 samples x 1,000 tokens, by the evaluated model.
    assert work("evaluate", run="sft/d/lr~1e-5/epoch~2").generate == pytest.approx(2e9 * 60 * 2 * 1000)
    # A sweep of grafts: each graft's evaluation, each written in turn and none kept (a temp() output);
    # its samples kept, 4 bytes a token.
    graft = work("graft", donor="d", lr="1e-5", epoch="2", mask="none", rho="0")
    assert (graft.generate, graft.written, graft.kept) == (pytest.approx(2e9 * 60 * 2 * 1000), 2e9 + SAMPLES, SAMPLES)


def test_an_evaluation_is_charged_each_benchmarks_mean_response_length(tmp_path):
    """HAND's evaluation, 50 x 2 answers to `b` and 10 x 2 to `heldout` after 256-token prompts: each at its
    benchmark's configured `response_tokens`, else the mean the finished evaluation of the post model
    measured, else the whole 744-token budget, and never more than it. Each new token reads the KV cache of
    the tokens before it, 2 (K, V) x 20 layers x 3 KV heads x 128 x 2 bytes (the shape a 1e9 model is
    assumed to have)."""

    def evaluation():
        config = resolve(copy.deepcopy(HAND))
        if configured is not None:
            config["experiments"]["x"]["benchmarks"]["b"]["response_tokens"] = configured
        layout = Experiment.of(config, "x")
        return job_work("evaluate", config, layout, {}, Assumptions(prompt_tokens=256), tmp_path), layout

    def charged(b: float, heldout: float) -> tuple:
        answers = {100: b, 20: heldout}
        generate = sum(2e9 * n * (256 + t) for n, t in answers.items())
        return pytest.approx(generate), pytest.approx(
            sum(n * 30720 * (256 * t + t * t / 2) for n, t in answers.items())
        )

    configured = None
    work, _ = evaluation()
    assert (work.generate, work.kv_read) == charged(744, 744)
    metrics = tmp_path / "results/x/eval/post/metrics.json"
    metrics.parent.mkdir(parents=True)
    measured = {"b": {"response_tokens": 300.5}, "heldout": {"response_tokens": 5000.0}}
    metrics.write_text(json.dumps({"benchmarks": measured}))
    work, _ = evaluation()
    assert (work.generate, work.kv_read) == charged(300.5, 744)  # a mean over the budget is held to it
    configured = 100
    work, layout = evaluation()
    assert (work.generate, work.kv_read) == charged(100, 744)
    # The data set job does not see it: setting it re-reads nothing.
    read = layout.sources()["experiments.x.benchmarks.b"]
    assert "response_tokens" not in read and read["limit"] == 50


@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    entities=st.integers(1, 300),
    per_entity=st.integers(1, 6),
    replay=st.integers(0, 400),
    seed=st.integers(0, 2**16),
)
def test_a_knowledge_example_is_never_longer_than_its_bound(tmp_path_factory, entities, per_entity, replay, seed):
    """SFT on knowledge is sized for `KNOWLEDGE_TRACE_TOKENS` answer tokens (not the evaluation budget):
    every completion the knowledge world writes, replay included, is ASCII and no longer, so under any
    tokenizer it takes no more tokens than characters."""
    import polars as pl

    from graftlab.planning.work import KNOWLEDGE_TRACE_TOKENS, trace_tokens
    from graftlab.tasks import arith
    from graftlab.world import knowledge as kn

    out = tmp_path_factory.mktemp("knowledge")
    cfg = kn.KnowledgeConfig(entities=entities, facts=entities * per_entity, replay=replay, seed=seed)
    kn.write_knowledge_data(out, cfg, sorted(arith.SOLVERS))
    completions = pl.read_parquet(out / "sft.parquet")["completion"]
    assert completions.str.contains(r"^[\x00-\x7f]*$").all()
    assert completions.str.len_chars().max() <= KNOWLEDGE_TRACE_TOKENS
    assert trace_tokens({"data": "knowledge", "eval": {"max_new_tokens": 32768}}) == KNOWLEDGE_TRACE_TOKENS
