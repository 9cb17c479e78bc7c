"""Tokenizing a corpus into token files (hspmd.runtime.data.tokens), streaming.

Input files are read line by line, one document at a time, so memory stays constant however large
the corpus: a `.jsonl` file holds one JSON object per line whose `text` field (`key`) is a
document; any other file is UTF-8 text whose documents are separated by blank lines (`split=
"paragraphs"`) or are its non-empty lines (`split="lines"`).

Tokenizers: `bytes` (each UTF-8 byte is an id, vocabulary 256: nothing to download or ship), or a
local Hugging Face tokenizer directory: its `tokenizer.json` read by `tokenizers`, or, without
one, whatever `transformers.AutoTokenizer` loads from it offline. Every id is checked against the
vocabulary (`vocab`, default the tokenizer's) before it is written.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from dataclasses import dataclass
from typing import Callable, Iterator, Sequence

import numpy as np

from hspmd.runtime.data.tokens import DataError, TokenFiles, TokenWriter

BYTES = "bytes"
BYTES_VOCAB = 256


@dataclass(frozen=True)
class Tokenizer:
    """A name (recorded in the manifest), a vocabulary size and text -> ids."""

    name: str
    vocab: int
    encode: Callable[[str], np.ndarray]


def _bytes_encode(text: str) -> np.ndarray:
    return np.frombuffer(text.encode("utf-8"), dtype=np.uint8)


def load_tokenizer(spec: str) -> Tokenizer:
    """`bytes`, or a local Hugging Face tokenizer directory (never downloaded)."""
    if spec == BYTES:
        return Tokenizer(BYTES, BYTES_VOCAB, _bytes_encode)
    if not os.path.isdir(spec):
        raise DataError(f"tokenizer {spec}: no such directory (give `bytes` or a local Hugging Face tokenizer directory)")
    name = os.path.abspath(spec)
    file = os.path.join(spec, "tokenizer.json")
    if os.path.isfile(file):
        from tokenizers import Tokenizer as FastTokenizer

        try:
            fast = FastTokenizer.from_file(file)
        except Exception as exc:  # noqa: BLE001 - tokenizers raises its own Exception type for a bad file
            raise DataError(f"{file}: cannot be read as a tokenizer ({str(exc).splitlines()[0]})") from None
        return Tokenizer(name, fast.get_vocab_size(with_added_tokens=True),
                         lambda text: np.asarray(fast.encode(text, add_special_tokens=False).ids, dtype=np.int64))
    try:
        from transformers import AutoTokenizer

        slow = AutoTokenizer.from_pretrained(spec, local_files_only=True)
    except (OSError, ValueError, KeyError) as exc:
        raise DataError(f"tokenizer {spec}: no tokenizer.json and transformers cannot load one from it "
                        f"({str(exc).splitlines()[0]})") from None
    return Tokenizer(name, len(slow), lambda text: np.asarray(slow.encode(text, add_special_tokens=False), dtype=np.int64))


SPLITS = ("paragraphs", "lines")


def documents(path: str, key: str = "text", split: str = "paragraphs") -> Iterator[tuple[str, str, int]]:
    """(document text, where it starts as `file:line`, bytes of the file consumed so far) for
    every document of one input file."""
    if not os.path.isfile(path):
        raise DataError(f"{path}: no such input file")
    jsonl = path.endswith(".jsonl")
    consumed = 0
    with open(path, "rb") as f:
        lines: list[str] = []
        first = 0
        for number, raw in enumerate(f, start=1):
            consumed += len(raw)
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as exc:
                raise DataError(f"{path}:{number}: not UTF-8 text ({exc.reason} at byte {exc.start})") from None
            if jsonl:
                if line.strip():
                    yield _json_text(line, key, f"{path}:{number}"), f"{path}:{number}", consumed
                continue
            if line.strip() and split == "lines":
                yield line.rstrip("\r\n"), f"{path}:{number}", consumed
            elif line.strip():
                if not lines:
                    first = number
                lines.append(line)
            elif lines:
                yield "".join(lines), f"{path}:{first}", consumed
                lines = []
        if lines:
            yield "".join(lines), f"{path}:{first}", consumed


def _json_text(line: str, key: str, where: str) -> str:
    try:
        value = json.loads(line)
    except ValueError as exc:
        raise DataError(f"{where}: not a JSON object ({exc}); a truncated line?") from None
    if not isinstance(value, dict) or not isinstance(value.get(key), str):
        raise DataError(f"{where}: a JSON line needs a text field {key!r}")
    return value[key]


def prepare(inputs: Sequence[str], out: str, tokenizer: str = BYTES, vocab: int | None = None, key: str = "text",
            split: str = "paragraphs", progress: Callable[[int], None] | None = None) -> dict:
    """Tokenize `inputs` into the dataset `out` (PREFIX or PREFIX.bin); returns its manifest.
    progress(bytes) is called with the input bytes consumed so far. An error leaves any earlier dataset of that
    name as it was."""
    if not inputs:
        raise DataError("data prepare: give at least one input file")
    if split not in SPLITS:
        raise DataError(f"data prepare: documents split by {split!r}; choose one of {', '.join(SPLITS)}")
    tok = load_tokenizer(tokenizer)
    vocab = tok.vocab if vocab is None else vocab
    for path in inputs:
        if not os.path.isfile(path):
            raise DataError(f"{path}: no such input file")
    writer = TokenWriter(out, vocab, tok.name)
    try:
        done = 0
        for path in inputs:
            for text, where, consumed in documents(path, key, split):
                writer.add(tok.encode(text), f"{where} (tokenizer {tok.name})")
                if progress is not None:
                    progress(done + consumed)
            done += os.path.getsize(path)
        return writer.close(", ".join(inputs))
    except BaseException:
        writer.abort()
        raise


def prepared_now(inputs: Sequence[str], split: str = "lines") -> TokenFiles:
    """`inputs` prepared as bytes into a scratch directory that is removed at once, memory-mapped
    (the open maps keep the files readable): how an example trains on shipped text without a
    prepared dataset."""
    scratch = tempfile.mkdtemp(prefix="hspmd-data-")
    try:
        prepare([str(p) for p in inputs], os.path.join(scratch, "documents"), split=split)
        return TokenFiles(os.path.join(scratch, "documents"))
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


__all__ = ["BYTES", "BYTES_VOCAB", "SPLITS", "Tokenizer", "documents", "load_tokenizer", "prepare", "prepared_now"]
