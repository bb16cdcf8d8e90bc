"""Fill-in-the-middle (FIM) prompts in a code model's own FIM tokens: the text before the cursor (prefix), the text
after it (suffix) and, optionally, other files of the repository as context.

Each model family spells FIM with its own special tokens (:data:`FIM_FORMATS`); the family is detected from the
tokenizer's vocabulary. Qwen2.5-Coder's documented format, which the others follow with their own tokens:

- without repository context: ``<|fim_prefix|>{prefix}<|fim_suffix|>{suffix}<|fim_middle|>``;
- with repository files: ``<|repo_name|>{name}\\n<|file_sep|>{path}\\n{content}\\n ... <|file_sep|>{path}\\n``
  then the FIM part for the current file.

The prompt is built as token ids (each text piece tokenised on its own, special-token strings in it read as
text), so the code being edited can never inject a control token. The model writes the middle and ends it with
one of :attr:`FimFormat.stops` or its own EOS (:func:`fim_stop_ids`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

__all__ = ["FILENAME", "FIM_FORMATS", "FimFormat", "REPO_NAME", "RepoFile", "fim_format", "fim_ids", "fim_stop_ids",
           "has_fim", "repo_files"]

REPO_NAME = "myproject"
"""The repository name of a prompt with repository files when none is given (llama.cpp's)."""

FILENAME = "filename"
"""The path of the file being edited in a prompt with repository files when none is given (llama.cpp's)."""


@dataclass(frozen=True)
class FimFormat:
    """One model family's FIM tokens. ``prefix``, ``suffix`` and ``middle`` are required; ``repo_name`` and
    ``file_sep`` (repository context) are optional; ``stops`` end the middle (those in the vocabulary, beside the
    model's EOS)."""

    family: str
    prefix: str
    suffix: str
    middle: str
    repo_name: str | None = None
    file_sep: str | None = None
    stops: tuple[str, ...] = ()

    @property
    def required(self) -> tuple[str, str, str]:
        return (self.prefix, self.suffix, self.middle)


FIM_FORMATS: tuple[FimFormat, ...] = (
    FimFormat("qwen2.5-coder", "<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>", "<|repo_name|>",
              "<|file_sep|>", ("<|endoftext|>", "<|file_sep|>", "<|fim_pad|>")),
    FimFormat("starcoder", "<fim_prefix>", "<fim_suffix>", "<fim_middle>", "<repo_name>", "<file_sep>",
              ("<|endoftext|>", "<file_sep>", "<fim_pad>")),
    FimFormat("deepseek-coder", "<｜fim▁begin｜>", "<｜fim▁hole｜>", "<｜fim▁end｜>", None, None,
              ("<｜end▁of▁sentence｜>", "<|EOT|>")),
)
"""The FIM token names of each model family, in the order they are tried."""


@dataclass(frozen=True)
class RepoFile:
    """A file of the repository given as context: its path and its text."""

    filename: str
    text: str


class _Vocab:
    """Look-ups of single tokens in a tokenizer's vocabulary (no copy of the whole vocabulary, which for a 150k
    vocabulary costs tens of milliseconds)."""

    def __init__(self, tokenizer: Any) -> None:
        if tokenizer is None:
            raise ValueError("fill-in-the-middle needs the target's tokenizer")
        self.tokenizer = tokenizer

    def get(self, token: str) -> int | None:
        """The id of ``token``, or None when it is not in the vocabulary (an unknown-token id does not count)."""
        tid = self.tokenizer.convert_tokens_to_ids(token)
        if not isinstance(tid, int) or self.tokenizer.convert_ids_to_tokens(tid) != token:
            return None
        return tid

    def __contains__(self, token: str) -> bool:
        return self.get(token) is not None

    def __getitem__(self, token: str) -> int:
        tid = self.get(token)
        if tid is None:
            raise KeyError(token)
        return tid


def fim_format(tokenizer: Any) -> FimFormat:
    """The :class:`FimFormat` whose required tokens are all in ``tokenizer``'s vocabulary.

    Raises:
        ValueError: one line naming the missing tokens (of the family the tokenizer comes closest to, or of
            every family when it has none of them).
    """
    vocab = _Vocab(tokenizer)
    best: tuple[int, FimFormat] | None = None
    for fmt in FIM_FORMATS:
        present = sum(t in vocab for t in fmt.required)
        if present == len(fmt.required):
            return fmt
        if present and (best is None or present > best[0]):
            best = (present, fmt)
    if best is not None:
        fmt = best[1]
        missing = ", ".join(t for t in fmt.required if t not in vocab)
        raise ValueError(f"this model's tokenizer has no complete fill-in-the-middle tokens: {fmt.family}'s "
                         f"{missing} missing")
    known = "; ".join(f"{f.family}: {', '.join(f.required)}" for f in FIM_FORMATS)
    raise ValueError(f"this model's tokenizer has no fill-in-the-middle tokens (missing {known}): use a code model "
                     "trained for infilling, e.g. Qwen2.5-Coder")


def has_fim(tokenizer: Any) -> bool:
    """Whether ``tokenizer`` has a complete set of FIM tokens (:func:`fim_format` would succeed)."""
    try:
        fim_format(tokenizer)
    except ValueError:
        return False
    return True


def repo_files(extra: Sequence[Any] | None) -> list[RepoFile]:
    """``extra`` as :class:`RepoFile` s: each item a ``RepoFile``, a mapping ``{"filename", "text"}`` (llama.cpp's
    ``input_extra``; ``filename`` optional) or a ``(filename, text)`` pair. Raises a one-line ValueError naming the
    item at fault."""
    if extra is None:
        return []
    if isinstance(extra, (str, bytes, Mapping)) or not isinstance(extra, Sequence):
        raise ValueError(f"extra must be a list of files ({{'filename', 'text'}} objects), got "
                         f"{type(extra).__name__}")
    files = []
    for i, item in enumerate(extra):
        if isinstance(item, RepoFile):
            name, text = item.filename, item.text
        elif isinstance(item, Mapping):
            unknown = sorted(str(k) for k in item if k not in ("filename", "text"))
            if unknown:
                raise ValueError(f"extra[{i}] has unknown field {unknown[0]!r} (a file has 'filename' and 'text')")
            name, text = item.get("filename", "tmp"), item.get("text")
        elif isinstance(item, (tuple, list)) and len(item) == 2:
            name, text = item
        else:
            raise ValueError(f"extra[{i}] must be a {{'filename', 'text'}} object or a (filename, text) pair")
        if not isinstance(name, str):
            raise ValueError(f"extra[{i}].filename must be a string, got {type(name).__name__}")
        if not isinstance(text, str):
            raise ValueError(f"extra[{i}].text must be a string, got {type(text).__name__}")
        files.append(RepoFile(name, text))
    return files


def _encode(tokenizer: Any, text: str) -> list[int]:
    """``text``'s ids with no special tokens added, special-token strings in it read as text."""
    if not text:
        return []
    try:
        return list(tokenizer(text, add_special_tokens=False, split_special_tokens=True)["input_ids"])
    except TypeError:  # a tokenizer without split_special_tokens
        return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def _leading(tokenizer: Any) -> list[int]:
    """The special ids the tokenizer puts before a text by default (a BOS token), which start the prompt too."""
    with_specials = list(tokenizer("x")["input_ids"])
    plain = _encode(tokenizer, "x")
    if plain and with_specials[len(with_specials) - len(plain):] == plain:
        return with_specials[:len(with_specials) - len(plain)]
    return []


def fim_ids(tokenizer: Any, prefix: str, suffix: str, extra: Sequence[Any] | None = None, *,
            repo_name: str = REPO_NAME, filename: str = FILENAME, max_prefix_tokens: int | None = None,
            max_suffix_tokens: int | None = None) -> list[int]:
    """The token ids of a FIM prompt in ``tokenizer``'s own FIM tokens (:func:`fim_format`): ``prefix`` and
    ``suffix`` around the cursor and, with ``extra`` (:func:`repo_files`), the repository files first, then the
    current file's path ``filename``, under ``repo_name``. ``max_prefix_tokens`` / ``max_suffix_tokens`` keep only
    the prefix's last / the suffix's first tokens (None: all), the text nearest the cursor.

    Raises:
        ValueError: one line: a tokenizer without FIM tokens (naming them), repository files for a family
            without repository tokens, or text that is not a string.
    """
    fmt = fim_format(tokenizer)
    for name, value in (("prefix", prefix), ("suffix", suffix), ("repo_name", repo_name), ("filename", filename)):
        if not isinstance(value, str):
            raise ValueError(f"{name} must be a string, got {type(value).__name__}")
    files = repo_files(extra)
    vocab = _Vocab(tokenizer)
    ids = _leading(tokenizer)
    if files:
        missing = [t for t in (fmt.repo_name, fmt.file_sep) if t is None or t not in vocab]
        if missing:
            names = ", ".join(t for t in (fmt.repo_name, fmt.file_sep) if t is not None) or "none"
            raise ValueError(f"this model's fill-in-the-middle format ({fmt.family}) has no repository tokens "
                             f"({names}): give no extra files")
        ids += [vocab[fmt.repo_name]] + _encode(tokenizer, repo_name + "\n")
        for f in files:
            text = f.text if not f.text or f.text.endswith("\n") else f.text + "\n"
            ids += [vocab[fmt.file_sep]] + _encode(tokenizer, f"{f.filename}\n{text}")
        ids += [vocab[fmt.file_sep]] + _encode(tokenizer, filename + "\n")
    before, after = _encode(tokenizer, prefix), _encode(tokenizer, suffix)
    if max_prefix_tokens is not None:
        before = before[len(before) - max_prefix_tokens:] if len(before) > max_prefix_tokens else before
    if max_suffix_tokens is not None:
        after = after[:max_suffix_tokens]
    ids += [vocab[fmt.prefix]] + before
    ids += [vocab[fmt.suffix]] + after
    ids.append(vocab[fmt.middle])
    return ids


def fim_stop_ids(tokenizer: Any, model: Any = None) -> list[int]:
    """The ids that end an infill: the family's stop tokens in the vocabulary (:attr:`FimFormat.stops`), the
    tokenizer's EOS and the model's generation-config EOS."""
    from .chat import stop_ids

    fmt = fim_format(tokenizer)
    vocab = _Vocab(tokenizer)
    found = [t for t in map(vocab.get, fmt.stops) if t is not None]
    return list(dict.fromkeys([*found, *stop_ids(tokenizer, model)]))
