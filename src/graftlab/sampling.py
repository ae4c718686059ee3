"""One `generate()` for every stage that samples: evaluation, mining, trace synthesis, rollouts.

Two backends behind the same call: vLLM on a GPU (imported lazily: it pins its own CUDA torch and lives
in its own environment) and transformers `generate` everywhere else.
"""

from dataclasses import dataclass

from tqdm import tqdm

# One sample as the exact token ids: the prompt as the model read it (no padding) and the completion as
# generated, ending with the end-of-turn token when the model produced one. The Fisher scores these ids.
Sample = tuple[list[int], list[int]]


@dataclass(frozen=True)
class SamplingConfig:
    n: int
    temperature: float  # 0 means greedy
    top_p: float
    max_new_tokens: int
    seed: int = 0
    batch_size: int = 256  # prompts per transformers batch (each expanded n times); memory, not results

    @classmethod
    def from_config(cls, section: dict, seed: int) -> "SamplingConfig":
        """From a workflow config section with `samples`, `temperature`, `top_p`, `max_new_tokens`."""
        return cls(
            section["samples"], section["temperature"], section.get("top_p", 1.0), section["max_new_tokens"], seed
        )


def vllm_available() -> bool:
    try:
        import vllm  # noqa: F401
    except ImportError:
        return False
    import torch

    return torch.cuda.is_available()


def generate(model_dir, prompts: list[str], cfg: SamplingConfig, backend: str = "auto") -> list[list[str]]:
    """`cfg.n` completions per prompt (already chat-formatted), decoded up to the end-of-turn token."""
    return load_sampler(model_dir, backend)(prompts, cfg)


def generate_ids(model_dir, prompts: list[str], cfg: SamplingConfig, backend: str = "auto") -> list[list[Sample]]:
    """`cfg.n` samples per prompt as token ids `(prompt_ids, completion_ids)`, for stages that score them."""
    return load_sampler(model_dir, backend).sample_ids(prompts, cfg)


def load_sampler(model_dir, backend: str = "auto"):
    """A callable `(prompts, cfg) -> completions` holding the model, for stages that sample repeatedly;
    its `sample_ids(prompts, cfg)` gives the same samples as token ids."""
    if backend == "auto":
        backend = "vllm" if vllm_available() else "transformers"
    if backend == "vllm":
        return VllmSampler(model_dir)
    if backend == "transformers":
        return HfSampler(model_dir)
    raise ValueError(f"unknown sampling backend {backend!r}; use auto, transformers or vllm")


class VllmSampler:
    def __init__(self, model_dir):
        try:
            from vllm import LLM
        except ImportError:
            raise RuntimeError(
                "sampling backend 'vllm' needs vLLM: install graftlab[gpu] in its own environment "
                "(envs/sample-vllm.yaml) or use sampling_backend: transformers"
            ) from None

        self.llm = LLM(model=str(model_dir))

    def _generate(self, prompts: list[str], cfg: SamplingConfig):
        from vllm import SamplingParams

        params = SamplingParams(
            n=cfg.n,
            temperature=cfg.temperature,
            top_p=cfg.top_p if cfg.temperature > 0 else 1.0,
            max_tokens=cfg.max_new_tokens,
            seed=cfg.seed,
            skip_special_tokens=False,
        )
        return self.llm.generate(prompts, params)

    def __call__(self, prompts: list[str], cfg: SamplingConfig) -> list[list[str]]:
        return [[c.text for c in o.outputs] for o in self._generate(prompts, cfg)]

    def sample_ids(self, prompts: list[str], cfg: SamplingConfig) -> list[list[Sample]]:
        eos = self.llm.get_tokenizer().eos_token_id
        return [
            [(list(o.prompt_token_ids), _vllm_completion_ids(c, eos)) for c in o.outputs]
            for o in self._generate(prompts, cfg)
        ]


class HfSampler:
    def __init__(self, model_dir):
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self.tok = AutoTokenizer.from_pretrained(model_dir, padding_side="left")
        self.device = "cuda" if torch.cuda.is_available() else "cpu"
        self.model = AutoModelForCausalLM.from_pretrained(model_dir).eval().to(self.device)

    @classmethod
    def from_model(cls, model, tokenizer) -> "HfSampler":
        """A sampler over a model in memory (a student being trained on its own samples): no copy; the
        caller switches the model to eval mode around sampling. The tokenizer pads on the left here."""
        import copy

        sampler = cls.__new__(cls)
        sampler.tok = copy.copy(tokenizer)  # a shallow copy: padding the caller's tokenizer stays as it was
        sampler.tok.padding_side = "left"
        sampler.model, sampler.device = model, next(model.parameters()).device
        return sampler

    def __call__(self, prompts: list[str], cfg: SamplingConfig) -> list[list[str]]:
        decode = self.tok.decode
        return [[decode(c, skip_special_tokens=False) for _, c in cs] for cs in self.sample_ids(prompts, cfg)]

    def sample_ids(self, prompts: list[str], cfg: SamplingConfig) -> list[list[Sample]]:
        import torch

        torch.manual_seed(cfg.seed)
        out: list[list[Sample]] = []
        batches = range(0, len(prompts), cfg.batch_size)
        for start in tqdm(batches, desc="sampling", unit="batch", disable=len(batches) < 2):
            out.extend(self._batch(prompts[start : start + cfg.batch_size], cfg))
        return out

    def _batch(self, prompts: list[str], cfg: SamplingConfig) -> list[list[Sample]]:
        import torch

        tok, greedy = self.tok, cfg.temperature == 0
        # Greedy decoding gives one answer per prompt: decode it once and repeat it n times, as vLLM does.
        n = 1 if greedy else cfg.n
        batch = tok(prompts, return_tensors="pt", padding=True).to(self.device)
        with torch.inference_mode():
            ids = self.model.generate(
                **batch,
                do_sample=not greedy,
                temperature=None if greedy else cfg.temperature,
                top_p=None if greedy else cfg.top_p,
                top_k=None,
                num_return_sequences=n,
                max_new_tokens=cfg.max_new_tokens,
                eos_token_id=tok.eos_token_id,
                pad_token_id=tok.pad_token_id,
            )
        # Left padding: a prompt's own ids are where the attention mask is set.
        prompt_ids = [row[mask.bool()].tolist() for row, mask in zip(batch["input_ids"], batch["attention_mask"])]
        completions = [_until_eos(row, tok.eos_token_id) for row in ids[:, batch["input_ids"].shape[1] :].tolist()]
        samples = [(prompt_ids[i // n], c) for i, c in enumerate(completions)]
        return [samples[i : i + n] * (cfg.n // n) for i in range(0, len(samples), n)]


def _until_eos(ids: list[int], eos: int) -> list[int]:
    # A finished row is padded up to the longest one: cut after the end of turn ourselves (decoding with
    # skip_special_tokens would also drop the <think> tags that grading needs).
    return ids[: ids.index(eos) + 1] if eos in ids else ids


def _vllm_completion_ids(completion, eos: int) -> list[int]:
    """vLLM keeps a stop token in `token_ids`; should a version leave the end of turn out, put it back
    (finish_reason "stop" with no stop_reason means the EOS ended the sample), so both backends agree."""
    ids = list(completion.token_ids)
    ended_by_eos = completion.finish_reason == "stop" and completion.stop_reason is None
    return ids + [eos] if ended_by_eos and ids[-1:] != [eos] else ids
