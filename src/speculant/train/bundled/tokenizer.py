"""Byte-level BPE tokenizer trained with the ``tokenizers`` package, saved for ``AutoTokenizer``.

Byte-level: every string round-trips exactly (no unknown token), including indentation and non-ASCII text.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import PreTrainedTokenizerFast

__all__ = ["EOS", "train_tokenizer", "save_tokenizer"]

EOS = "<|endoftext|>"


def train_tokenizer(texts: Iterable[str], vocab_size: int = 16384, min_frequency: int = 2, bos: str = EOS,
                    eos: str = EOS, pad: str | None = EOS) -> PreTrainedTokenizerFast:
    """Train a byte-level BPE of ``vocab_size`` tokens on ``texts``. Its special tokens come first (ids 0, 1 ...):
    ``bos`` and ``eos`` (one token ``<|endoftext|>`` by default, also the ``pad`` token; the test fixtures of
    :mod:`speculant.tiny_models` use ``<s>`` = 0 and ``</s>`` = 1 and no pad token). It adds no special tokens when
    encoding."""
    specials = list(dict.fromkeys([bos, eos]))
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=min_frequency,
        special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=bos, eos_token=eos, pad_token=pad,
                                   model_max_length=1 << 30, clean_up_tokenization_spaces=False)


def save_tokenizer(tokenizer: PreTrainedTokenizerFast, directory: str | Path) -> None:
    """Write the tokenizer so that ``AutoTokenizer.from_pretrained(directory)`` loads it offline."""
    tokenizer.save_pretrained(str(directory))
