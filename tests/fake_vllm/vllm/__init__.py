"""A stand-in for vLLM, put on sys.path by tests (tests/test_sampling_vllm.py): it records every call and
answers with fixed completions in vLLM's output shapes, so each stage's vLLM path runs in CI without a GPU.

`CALLS` holds `(name, details)` in call order: `init` (the LLM's keyword arguments), `generate` (prompts
and SamplingParams), `reload_weights` (the model runner's in-place reload: each parameter's sum, by name),
`reset_prefix_cache`, `collective_rpc` (the method and its arguments). `RESPOND(prompt, i)` gives
the i-th completion text of a prompt; tests replace it."""

from dataclasses import dataclass, field
from types import SimpleNamespace

CALLS: list[tuple[str, object]] = []


def _default_response(prompt: str, index: int) -> str:
    return "<think>\n</think>\n\n0<|im_end|>"


RESPOND = _default_response


class SamplingParams:
    def __init__(self, **kwargs):
        self.kwargs = kwargs
        self.__dict__.update(kwargs)


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str = "stop"
    stop_reason: object = None


@dataclass
class RequestOutput:
    prompt: str
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput] = field(default_factory=list)


class _ModelRunner:
    def reload_weights(self, weights_iterator=None, weights_path=None, is_checkpoint_format=True):
        CALLS.append(("reload_weights", {name: float(t.double().sum()) for name, t in weights_iterator}))

    def get_model(self):
        return SimpleNamespace()  # no output head to process again (tests/vllm_cpu/ has the real one)


class LLM:
    def __init__(self, model, **kwargs):
        from transformers import AutoTokenizer

        CALLS.append(("init", {"model": model, **kwargs}))
        self.tokenizer = AutoTokenizer.from_pretrained(model)
        self.llm_engine = SimpleNamespace(
            model_executor=SimpleNamespace(driver_worker=SimpleNamespace(model_runner=_ModelRunner()))
        )

    def get_tokenizer(self):
        return self.tokenizer

    def reset_prefix_cache(self):
        CALLS.append(("reset_prefix_cache", None))

    def collective_rpc(self, method, timeout=None, args=(), kwargs=None):
        CALLS.append(("collective_rpc", {"method": method, "args": args, "kwargs": kwargs or {}}))
        return [None]

    def generate(self, prompts, params):
        prompts = [prompts] if isinstance(prompts, str) else list(prompts)
        CALLS.append(("generate", {"prompts": prompts, "params": params}))
        encode = lambda text: self.tokenizer(text, add_special_tokens=False)["input_ids"]  # noqa: E731
        outputs = []
        for prompt in prompts:
            texts = [RESPOND(prompt, i) for i in range(params.n)]
            completions = [CompletionOutput(i, t, encode(t)) for i, t in enumerate(texts)]
            outputs.append(RequestOutput(prompt, encode(prompt), completions))
        return outputs
