"""The tiny world's character-level tokenizer, saved as an ordinary Hugging Face tokenizer.

Every printable character of the world is one token; the chat markers and `<think>` tags are special
tokens, so a chat transcript is as long as its text and the template mirrors Qwen3's.
"""

from pathlib import Path

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>"]
CHARS = list("0123456789+-*=<>?.,:;!()/ \nabcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ")

# Qwen3's template, cut to what the tiny world uses: no system prompt, no tools.
# `enable_thinking=False` pre-fills an empty think block, as Qwen3 does.
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n{% endif %}"
    "{% endif %}"
)


def build_tokenizer() -> PreTrainedTokenizerFast:
    vocab = {tok: i for i, tok in enumerate(SPECIALS + CHARS)}
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token="?"))
    core.pre_tokenizer = pre_tokenizers.Split(Regex("[\\s\\S]"), behavior="isolated")
    core.decoder = decoders.Fuse()
    tok = PreTrainedTokenizerFast(
        tokenizer_object=core,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        additional_special_tokens=SPECIALS[1:],
        chat_template=CHAT_TEMPLATE,
        clean_up_tokenization_spaces=False,
    )
    tok.add_special_tokens({"additional_special_tokens": SPECIALS[1:]})
    return tok


def save_tokenizer(out_dir: str | Path) -> None:
    build_tokenizer().save_pretrained(out_dir)
