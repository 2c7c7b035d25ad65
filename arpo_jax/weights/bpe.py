"""Byte-level BPE tokenizers trained offline with Qwen2's pipeline, for tiny models (tests, quickstart, demo).

The pipeline (NFC normaliser, Qwen2's pre-tokenize regex, byte-level) matters: transformers reloads a tokenizer
saved next to a `model_type: qwen2` config as Qwen2Tokenizer, which swaps in exactly these components; training
with them keeps token ids identical in tokenizers, transformers and vLLM.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
CHATML_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def train_bpe_tokenizer(corpus: Iterable[str], *, vocab_size: int = 512, path: str | Path | None = None):
    """Trains on `corpus` and returns a PreTrainedTokenizerFast (eos <|im_end|>, pad <|endoftext|>, ChatML)."""
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast
    from transformers.models.qwen2.tokenization_qwen2 import PRETOKENIZE_REGEX

    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(PRETOKENIZE_REGEX), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(SPECIAL_TOKENS), show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(corpus, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>")
    fast.chat_template = CHATML_TEMPLATE
    if path is not None:
        fast.save_pretrained(str(path))
    return fast
