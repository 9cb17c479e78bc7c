"""Token files: a tokenized corpus on disk, memory-mapped, with an index of documents.

A prepared dataset `PREFIX` is three files:

    PREFIX.bin    every document's token ids back to back (uint16 when the vocabulary fits, else int32)
    PREFIX.idx    Megatron-LM's MMIDIDX index (version 1): header, document lengths (int32), byte
                  offsets into .bin (int64), document boundaries (int64, one sequence per document)
    PREFIX.json   hspmd's manifest: format, vocabulary, tokenizer, counts, sizes and the sha256 of .bin
                  and .idx; written last, so a dataset without one is incomplete

.bin and .idx are byte for byte what Megatron's indexed dataset reads, so a dataset prepared here
trains there too; the manifest adds what that format lacks (checksums, the vocabulary the ids were
checked against). Each file is written atomically (runtime/persistence/integrity.atomic_write).

`TokenWriter` streams documents in (constant memory: lengths spill to a scratch file);
`TokenFiles` opens a dataset, checks its manifest, the index's checksum and the .bin's size (a
truncated file is refused by name), and reads documents as views of the memory map.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
import tempfile
from dataclasses import dataclass
from typing import BinaryIO

import numpy as np

from hspmd.errors import HSPMDError
from hspmd.runtime.persistence.integrity import (
    atomic_write, fsync_path, read_format_document, remove_stale_temporaries, temporary_path,
)

FORMAT = "hspmd.tokens/1"
INDEX_MAGIC = b"MMIDIDX\x00\x00"
INDEX_VERSION = 1
DTYPE_CODES = {np.dtype(np.uint16): 8, np.dtype(np.int32): 4}  # Megatron's DType codes
_HEADER = struct.Struct("<9sQBQQ")  # magic, version, dtype code, sequence count, document-boundary count
_CHUNK = 1 << 16  # elements per chunk when streaming lengths and offsets


class DataError(HSPMDError):
    """A corpus, tokenizer or prepared dataset is unusable; the message names the file."""


def dtype_for(vocab: int) -> np.dtype:
    """uint16 for vocabularies up to 65,536 ids, int32 beyond (what Megatron picks)."""
    if vocab < 1:
        raise DataError(f"a vocabulary needs at least one id, got {vocab}")
    return np.dtype(np.uint16) if vocab <= 65536 else np.dtype(np.int32)


def paths(prefix: str | os.PathLike) -> tuple[str, str, str]:
    """(PREFIX.bin, PREFIX.idx, PREFIX.json)."""
    prefix = os.fspath(prefix)
    for suffix in (".bin", ".idx", ".json"):
        if prefix.endswith(suffix):
            prefix = prefix[: -len(suffix)]
    return prefix + ".bin", prefix + ".idx", prefix + ".json"


def _sha256(path: str) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(1 << 18):
            digest.update(block)
    return digest.hexdigest()


class TokenWriter:
    """Writes a dataset document by document (`add`), then `close()` writes .idx and the manifest.

    The .bin is written to its temporary name as documents arrive and hashed on the way; lengths go
    to a scratch file, so memory stays constant however many documents there are."""

    def __init__(self, prefix: str | os.PathLike, vocab: int, tokenizer: str = "bytes"):
        self.bin_path, self.idx_path, self.manifest_path = paths(prefix)
        self.vocab, self.tokenizer, self.dtype = vocab, tokenizer, dtype_for(vocab)
        self.documents = self.tokens = 0
        self._digest = hashlib.sha256()
        self._bin_done = False
        directory = os.path.dirname(os.path.abspath(self.bin_path))
        os.makedirs(directory, exist_ok=True)
        self._lengths: BinaryIO = tempfile.TemporaryFile(dir=directory)
        self._bin: BinaryIO | None = None
        self._bin_tmp: str | None = None

    def add(self, ids: np.ndarray, where: str) -> None:
        """Append one document's token ids; `where` names it in an error (file and line)."""
        ids = np.asarray(ids)
        if ids.ndim != 1 or ids.size == 0:
            return
        if ids.dtype.kind not in "iu":
            raise DataError(f"{where}: token ids must be integers, got {ids.dtype}")
        low, high = int(ids.min()), int(ids.max())
        if low < 0 or high >= self.vocab:
            bad = low if low < 0 else high
            raise DataError(f"{where}: token id {bad} is beyond the vocabulary of {self.vocab} ids "
                            f"(give the model's vocabulary with --vocab, or the tokenizer it was made for)")
        if self.documents >= np.iinfo(np.int64).max or ids.size > np.iinfo(np.int32).max:
            raise DataError(f"{where}: a document of {ids.size} tokens is longer than the index can hold (2**31 - 1)")
        if self._bin is None:
            self._start_bin()
        data = ids.astype(self.dtype, copy=False).tobytes()
        self._bin.write(data)
        self._digest.update(data)
        self._lengths.write(struct.pack("<i", ids.size))
        self.documents += 1
        self.tokens += int(ids.size)

    def _start_bin(self) -> None:
        remove_stale_temporaries(self.bin_path)
        self._bin_tmp = temporary_path(self.bin_path)
        self._bin = open(self._bin_tmp, "wb")

    def close(self, source: str = "") -> dict:
        """Finish .bin, write .idx and then the manifest (each atomically); returns the manifest."""
        if self.documents == 0:
            self.abort()
            raise DataError(f"{source or self.bin_path}: no document holds any token; nothing to prepare")
        self._bin.close()
        fsync_path(self._bin_tmp)  # the same durable replace as atomic_write, for a file streamed in
        os.replace(self._bin_tmp, self.bin_path)
        self._bin_done = True
        atomic_write(self.idx_path, self._write_index)
        manifest = {
            "format": FORMAT, "dtype": self.dtype.name, "vocab": self.vocab, "tokenizer": self.tokenizer,
            "documents": self.documents, "tokens": self.tokens, "bin_bytes": self.tokens * self.dtype.itemsize,
            "bin_sha256": self._digest.hexdigest(), "idx_sha256": _sha256(self.idx_path),
        }
        atomic_write(self.manifest_path, lambda tmp: _write_json(tmp, manifest))
        self._lengths.close()
        return manifest

    def abort(self) -> None:
        """Drop what was written (a failed prepare leaves any earlier dataset of this name intact)."""
        if self._bin is not None and not self._bin.closed:
            self._bin.close()
        if self._bin_tmp and not self._bin_done and os.path.exists(self._bin_tmp):
            os.remove(self._bin_tmp)
        self._lengths.close()

    def _write_index(self, tmp: str) -> None:
        with open(tmp, "wb") as out:
            out.write(_HEADER.pack(INDEX_MAGIC, INDEX_VERSION, DTYPE_CODES[self.dtype], self.documents,
                                   self.documents + 1))
            for lengths in self._length_chunks():
                out.write(lengths.tobytes())
            offset = 0
            for lengths in self._length_chunks():
                ends = np.cumsum(lengths, dtype=np.int64) * self.dtype.itemsize + offset
                out.write((ends - lengths.astype(np.int64) * self.dtype.itemsize).tobytes())
                offset = int(ends[-1])
            for start in range(0, self.documents + 1, _CHUNK):
                out.write(np.arange(start, min(start + _CHUNK, self.documents + 1), dtype=np.int64).tobytes())

    def _length_chunks(self):
        self._lengths.flush()
        self._lengths.seek(0)
        while block := self._lengths.read(4 * _CHUNK):
            yield np.frombuffer(block, dtype="<i4")


def _write_json(path: str, value: dict) -> None:
    with open(path, "w", encoding="utf-8") as f:
        json.dump(value, f, indent=1, sort_keys=True)


@dataclass(frozen=True)
class _Manifest:
    dtype: np.dtype
    vocab: int
    tokenizer: str
    documents: int
    tokens: int
    bin_bytes: int
    bin_sha256: str
    idx_sha256: str


def _read_manifest(path: str) -> _Manifest:
    if not os.path.isfile(path):
        raise DataError(f"{path}: no manifest; the dataset is not prepared or its preparation did not finish "
                        f"(run `hspmd data prepare` again)")
    raw = read_format_document(path, FORMAT, DataError, "the manifest cannot be read; prepare the dataset again")
    try:
        fields = {k: raw[k] for k in ("vocab", "documents", "tokens", "bin_bytes")}
        if any(isinstance(v, bool) or not isinstance(v, int) or v < 0 for v in fields.values()):
            raise ValueError(f"counts must be non-negative integers, got {fields}")
        dtype = np.dtype(raw["dtype"])
        if dtype not in DTYPE_CODES or dtype != dtype_for(fields["vocab"]):
            raise ValueError(f"dtype {raw['dtype']!r} does not fit a vocabulary of {fields['vocab']}")
        texts = {k: raw[k] for k in ("tokenizer", "bin_sha256", "idx_sha256")}
        if not all(isinstance(v, str) for v in texts.values()):
            raise ValueError("tokenizer and checksums must be text")
    except (KeyError, TypeError, ValueError) as exc:
        raise DataError(f"{path}: the manifest is damaged ({exc}); prepare the dataset again") from None
    return _Manifest(dtype, **fields, **texts)


class TokenFiles:
    """A prepared dataset, memory-mapped (nothing is read until a document is asked for).

    Opening checks the manifest, the .idx against its sha256 and header, and the .bin's size
    against the manifest and the index; `verify()` also hashes the whole .bin."""

    def __init__(self, prefix: str | os.PathLike):
        self.bin_path, self.idx_path, self.manifest_path = paths(prefix)
        self.prefix = self.bin_path[:-4]
        m = _read_manifest(self.manifest_path)
        self.vocab, self.tokenizer, self.dtype = m.vocab, m.tokenizer, m.dtype
        self.documents, self.tokens, self._bin_sha256 = m.documents, m.tokens, m.bin_sha256
        for path in (self.bin_path, self.idx_path):
            if not os.path.isfile(path):
                raise DataError(f"{path}: missing; the dataset {self.prefix} is incomplete (prepare it again)")
        if _sha256(self.idx_path) != m.idx_sha256:
            raise DataError(f"{self.idx_path}: does not match the sha256 in {self.manifest_path}: truncated or damaged "
                            f"(prepare the dataset again)")
        self._check_index(m)
        size = os.path.getsize(self.bin_path)
        if size != m.bin_bytes or size != self.tokens * self.dtype.itemsize:
            raise DataError(f"{self.bin_path}: {size} bytes where the manifest says {m.bin_bytes} "
                            f"({self.tokens} tokens): truncated or damaged (prepare the dataset again)")
        self.bin = np.memmap(self.bin_path, dtype=self.dtype, mode="r")  # every token, documents back to back

    def _check_index(self, m: _Manifest) -> None:
        n = m.documents
        expected = _HEADER.size + n * 4 + n * 8 + (n + 1) * 8
        size = os.path.getsize(self.idx_path)
        with open(self.idx_path, "rb") as f:
            head = f.read(_HEADER.size)
        if len(head) < _HEADER.size:
            raise DataError(f"{self.idx_path}: {size} bytes, shorter than an index header: truncated")
        magic, version, code, count, boundaries = _HEADER.unpack(head)
        if magic != INDEX_MAGIC or version != INDEX_VERSION:
            raise DataError(f"{self.idx_path}: not a version-{INDEX_VERSION} MMIDIDX index")
        if code != DTYPE_CODES[m.dtype] or count != n or boundaries != n + 1 or size != expected:
            raise DataError(f"{self.idx_path}: header (dtype code {code}, {count} documents, {size} bytes) does not "
                            f"match the manifest ({m.dtype}, {n} documents, {expected} bytes)")
        self.lengths = np.memmap(self.idx_path, dtype="<i4", mode="r", offset=_HEADER.size, shape=(n,))
        self.pointers = np.memmap(self.idx_path, dtype="<i8", mode="r", offset=_HEADER.size + 4 * n, shape=(n,))

    def verify(self) -> None:
        """Hash the whole .bin against the manifest (opening checks sizes only)."""
        if _sha256(self.bin_path) != self._bin_sha256:
            raise DataError(f"{self.bin_path}: does not match the sha256 in {self.manifest_path}: damaged "
                            f"(prepare the dataset again)")

    def length(self, document: int) -> int:
        return int(self.lengths[document])

    def span(self, document: int) -> tuple[int, int]:
        """(index in `bin` of the document's first token, its length)."""
        return int(self.pointers[document]) // self.dtype.itemsize, int(self.lengths[document])

    def document(self, document: int, start: int = 0, stop: int | None = None) -> np.ndarray:
        """Tokens [start, stop) of a document: a view of the memory map."""
        first, length = self.span(document)
        stop = length if stop is None else min(stop, length)
        return self.bin[first + start: first + stop]

    def __repr__(self) -> str:
        return (f"TokenFiles({self.prefix!r}: {self.documents} documents, {self.tokens} tokens, "
                f"vocabulary {self.vocab}, {self.tokenizer})")


__all__ = ["DataError", "FORMAT", "TokenFiles", "TokenWriter", "dtype_for", "paths"]
