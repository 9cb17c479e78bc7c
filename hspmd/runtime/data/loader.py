"""Loaders: a dataset's global order cut into steps, each rank reading only the rows it trains.

`SequenceLoader` (fixed-length training): epoch e's documents in `order.permuted` order, back to
back, are one stream of tokens; sample j of the epoch is the window of seq + 1 tokens starting at
j * seq (tokens, and labels one to the right), so the epoch has (tokens - 1) // seq samples and the
tail shorter than a window is dropped. A step's global batch is the next `global_batch_size`
samples from the state, laid out as MicroBatchLayout says; `share(trainer, state)` gives one rank
its pipeline's rows only (none at all to a rank whose program takes no placeholder or that the
strategy leaves idle), finding where they start from the document lengths alone (the index), and
the state after the step.

`DocumentLoader` (mixed-length training): sequences are whole documents, a document longer than
`longest` + 1 tokens cut into pieces of that many (consecutive pieces share one token, so every
token but a document's first is a label once). `step(state, tokens)` takes sequences until they hold
`tokens` labels and returns a `DocumentStep`: every sequence's length (from the index, nothing
read) and a reader of any one of them, so a rank reads only the sequences dispatched to it.

Both are pure functions of (dataset, seed, state): a redone step, a resumed job or a rank of
another strategy gets the same samples from the same state. Memory is the rows read plus the
pages of the memory map they touch.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch

from hspmd.runtime.data.order import DataState, permuted
from hspmd.runtime.data.tokens import DataError, TokenFiles
from hspmd.runtime.execution.batches import PipelineBatch
from hspmd.runtime.persistence.dcp_checkpoint import open_any_checkpoint

FIELDS = ("tokens", "labels")


def _files(dataset: TokenFiles | str | os.PathLike) -> TokenFiles:
    return dataset if isinstance(dataset, TokenFiles) else TokenFiles(dataset)


_MEMO = 4096  # positions whose document is remembered (a few steps' worth; constant memory)


class _Walk:
    """Positions in the epochs' document streams (shared by both loaders)."""

    def __init__(self, dataset: TokenFiles | str | os.PathLike, seed: int):
        self.files, self.seed = _files(dataset), seed
        if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
            raise DataError(f"the data seed must be a non-negative integer, got {seed!r}")
        self._memo: dict[tuple[int, int], tuple[int, int, int]] = {}

    def locate(self, epoch: int, position: int) -> tuple[int, int, int]:
        """(document, index of its first token in the .bin, its length) at `position` of `epoch`'s order;
        the last few thousand positions asked for are remembered (a step walks the same ones again)."""
        key = (epoch, position)
        found = self._memo.get(key)
        if found is None:
            if len(self._memo) >= _MEMO:
                self._memo.clear()
            document = permuted(position, self.files.documents, self.seed, epoch)
            found = self._memo[key] = (document, *self.files.span(document))
        return found

    def document(self, epoch: int, position: int) -> int:
        """The dataset's document at `position` of `epoch`'s order."""
        return self.locate(epoch, position)[0]

    def length(self, epoch: int, position: int) -> int:
        return self.locate(epoch, position)[2]

    def check_vocab(self, graph) -> None:
        """The dataset's ids must lie inside the model's vocabulary (the tokens placeholder's range)."""
        tokens = next((p for p in graph.placeholders if p.name == "tokens"), None)
        accepted = tokens.attrs.get("values") if tokens is not None else None
        if accepted is not None and self.files.vocab > accepted[1]:
            raise DataError(f"{self.files.manifest_path}: the dataset's vocabulary of {self.files.vocab} ids is larger than "
                            f"the model's {accepted[1]}; build the model with vocab >= {self.files.vocab}")


class SequenceLoader(_Walk):
    """Packed windows of `seq` tokens (+1 for the labels); module docstring."""

    def __init__(self, dataset: TokenFiles | str | os.PathLike, seq: int, seed: int = 0):
        super().__init__(dataset, seed)
        if isinstance(seq, bool) or not isinstance(seq, int) or seq < 1:
            raise DataError(f"the sequence length must be a positive integer, got {seq!r}")
        self.seq = seq
        self.samples_per_epoch = (self.files.tokens - 1) // seq
        if self.samples_per_epoch < 1:
            raise DataError(f"{self.files.bin_path}: {self.files.tokens} tokens make no sequence of {seq} "
                            f"(+1 for the labels); prepare more text or shorten the sequences")

    def sample_id(self, state: DataState) -> int:
        """The id of the sample at `state`: its epoch's first id plus its index in the epoch."""
        return state.epoch * self.samples_per_epoch + state.sample

    def _rolled(self, state: DataState) -> DataState:
        return DataState(state.epoch + 1) if state.sample >= self.samples_per_epoch else state

    def _walk(self, state: DataState, tokens: int) -> tuple[int, int]:
        position, offset = state.document, state.offset
        while tokens > 0:
            left = self.length(state.epoch, position) - offset
            if tokens < left:
                return position, offset + tokens
            tokens -= left
            position, offset = position + 1, 0
        return position, offset

    def skip(self, state: DataState, samples: int) -> DataState:
        """The state `samples` samples later (reads the index only)."""
        while samples > 0:
            state = self._rolled(state)
            n = min(samples, self.samples_per_epoch - state.sample)
            position, offset = self._walk(state, n * self.seq)
            state = DataState(state.epoch, state.sample + n, position, offset)
            samples -= n
        return self._rolled(state)

    def ids(self, state: DataState, samples: int) -> tuple[int, ...]:
        """The ids of the next `samples` samples (nothing read)."""
        out = []
        for _ in range(samples):
            state = self._rolled(state)
            out.append(self.sample_id(state))
            state = DataState(state.epoch, state.sample + 1)  # only epoch and sample matter for ids
        return tuple(out)

    def windows(self, state: DataState, samples: int) -> tuple[np.ndarray, tuple[int, ...]]:
        """The next `samples` windows of seq + 1 tokens ([samples, seq + 1] int64) and their ids."""
        out = np.empty((samples, self.seq + 1), dtype=np.int64)
        ids = []
        for row in range(samples):
            state = self._rolled(state)
            ids.append(self.sample_id(state))
            position, offset, filled = state.document, state.offset, 0
            while filled < self.seq + 1:
                _, first, length = self.locate(state.epoch, position)
                take = min(length - offset, self.seq + 1 - filled)
                out[row, filled: filled + take] = self.files.bin[first + offset: first + offset + take]
                filled += take
                position, offset = position + 1, 0
            position, offset = self._walk(state, self.seq)
            state = DataState(state.epoch, state.sample + 1, position, offset)
        return out, tuple(ids)

    def batch(self, state: DataState, rows: int) -> tuple[dict[str, torch.Tensor], tuple[int, ...]]:
        """A whole global batch of `rows` samples ({tokens, labels}, ids): for a single-device
        reference or a test; a rank reads its share with `share`."""
        windows, ids = self.windows(state, rows)
        values = torch.from_numpy(windows)
        return {"tokens": values[:, :-1], "labels": values[:, 1:]}, ids

    def share(self, trainer, state: DataState) -> tuple[PipelineBatch, DataState]:
        """This rank's rows of the step that starts at `state` under `trainer`'s strategy (its
        pipeline's micro-batches, only the placeholders its program feeds) and the state after the step."""
        layout = trainer.layout
        after = self.skip(state, layout.global_batch_size)
        names = [node.name for node in trainer.exe.placeholders] if not trainer.idle else []
        unknown = sorted(set(names) - set(FIELDS))
        if unknown:
            raise DataError(f"the model takes {unknown}, which token files do not give (they give {', '.join(FIELDS)})")
        if trainer.idle:
            return PipelineBatch(None, {}, ()), after
        first, stop = layout.pipeline_rows(trainer.pipeline)
        start = self.skip(state, first)
        if not names:  # a middle stage: it trains these samples but reads none of them
            return PipelineBatch(trainer.pipeline, {}, self.ids(start, stop - first)), after
        self.check_vocab(trainer.graph)
        windows, ids = self.windows(start, stop - first)
        values = torch.from_numpy(windows)
        fields = {"tokens": values[:, :-1], "labels": values[:, 1:]}
        return PipelineBatch(trainer.pipeline, {name: fields[name] for name in names}, ids), after


@dataclass(frozen=True)
class _Piece:
    epoch: int
    position: int
    document: int
    offset: int
    length: int  # tokens read: the sequence and its last label


class DocumentStep(Sequence):
    """One mixed-length step's sequences: `lengths` and `ids` known without reading; item i is
    sequence i as (tokens, labels), read when asked for."""

    def __init__(self, files: TokenFiles, pieces: Sequence[_Piece]):
        self._files, self._pieces = files, tuple(pieces)
        self.lengths = tuple(p.length - 1 for p in self._pieces)
        self.ids = tuple((p.epoch, p.document, p.offset) for p in self._pieces)
        self.read: list[int] = []  # the sequences read so far, by index

    @property
    def reads(self) -> int:
        return len(self.read)

    @property
    def counted(self) -> int:
        """Labels that count in the loss (every one: documents carry no padding)."""
        return sum(self.lengths)

    def __len__(self) -> int:
        return len(self._pieces)

    def __getitem__(self, i):
        p = self._pieces[i]
        self.read.append(i)
        window = torch.from_numpy(self._files.document(p.document, p.offset, p.offset + p.length).astype(np.int64))
        return window[:-1], window[1:]


class DocumentLoader(_Walk):
    """Whole documents (pieces of at most `longest` tokens plus their last label) for mixed-length
    steps; module docstring."""

    def __init__(self, dataset: TokenFiles | str | os.PathLike, longest: int, seed: int = 0):
        super().__init__(dataset, seed)
        if isinstance(longest, bool) or not isinstance(longest, int) or longest < 1:
            raise DataError(f"the longest sequence must be a positive number of tokens, got {longest!r}")
        self.longest = longest

    def step(self, state: DataState, tokens: int) -> tuple[DocumentStep, DataState]:
        """The sequences of the step starting at `state`, taken until they hold at least `tokens`
        labels, and the state after them."""
        pieces, total, barren = [], 0, 0
        epoch, position, offset, sample = state.epoch, state.document, state.offset, state.sample
        n = self.files.documents
        while total < tokens:
            if position >= n:
                epoch, position, offset, sample = epoch + 1, 0, 0, 0
            document, _, length = self.locate(epoch, position)
            if length - offset < 2:
                position, offset, barren = position + 1, 0, barren + 1
                if barren > n:
                    raise DataError(f"{self.files.bin_path}: every document has fewer than 2 tokens: nothing to predict")
                continue
            barren = 0
            size = min(self.longest + 1, length - offset)
            pieces.append(_Piece(epoch, position, document, offset, size))
            total += size - 1
            sample += 1
            offset += size - 1
            if length - offset < 2:
                position, offset = position + 1, 0
        return DocumentStep(self.files, pieces), DataState(epoch, sample, position, offset)


def saved_state(source) -> DataState | None:
    """The data state a checkpoint was saved with (a path of any format, or an open reader);
    None if it was saved without one."""
    reader = open_any_checkpoint(source) if isinstance(source, (str, os.PathLike)) else source
    text = getattr(reader, "data", None)
    return None if text is None else DataState.from_json(text, reader.path)


__all__ = ["DocumentLoader", "DocumentStep", "SequenceLoader", "saved_state"]
