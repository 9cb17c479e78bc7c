"""The example's data: a character-level tokenizer over the shipped corpus and a deterministic
batch sampler (the batch of step i depends only on the seed and i, so every rank draws the same
global batch and a resumed run continues with exactly the batches it would have seen)."""

from __future__ import annotations

from pathlib import Path

import torch

CORPUS = Path(__file__).with_name("corpus.txt")


class CharCorpus:
    """Characters of a text file as token ids; the vocabulary is padded to a multiple of 8."""

    def __init__(self, path: str | Path = CORPUS):
        self.text = Path(path).read_text(encoding="utf-8")
        self.chars = sorted(set(self.text))
        self.ids = {c: i for i, c in enumerate(self.chars)}
        self.tokens = torch.tensor([self.ids[c] for c in self.text], dtype=torch.int64)
        self.vocab = -(-len(self.chars) // 8) * 8

    def decode(self, ids) -> str:
        return "".join(self.chars[i] if i < len(self.chars) else "?" for i in ids)

    def batch(self, step: int, rows: int, seq: int, seed: int = 0) -> dict[str, torch.Tensor]:
        """`rows` random windows of `seq` characters; labels are the next characters."""
        if len(self.tokens) < seq + 2:
            raise ValueError(f"the corpus has {len(self.tokens)} characters, too few for sequences of {seq}")
        gen = torch.Generator().manual_seed(seed * 1_000_003 + step)
        starts = torch.randint(0, len(self.tokens) - seq - 1, (rows,), generator=gen)
        window = torch.arange(seq)
        return {"tokens": self.tokens[starts[:, None] + window], "labels": self.tokens[starts[:, None] + window + 1]}
