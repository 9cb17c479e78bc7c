"""The mixed-length example's data: a long-tailed corpus of documents cut deterministically from
examples/llama/corpus.txt (nothing downloaded), and steps of whole documents under a token budget.

Most documents are short and a few are long (a Pareto tail, like the paper's Fig. 16: most
sequences short, a few very long). `documents.txt` is the shipped output of
`python examples/mixed_length/longtail.py --write`; regenerating it gives the same file."""

from __future__ import annotations

import random
import sys
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.append(str(HERE.parent / "llama"))
from chardata import CORPUS, CharCorpus  # noqa: E402  (the character vocabulary of the llama example)

DOCUMENTS = HERE / "documents.txt"
SHORTEST, LONGEST, TAIL = 6, 120, 1.1


def make_documents(text: str, count: int = 600, seed: int = 0) -> list[str]:
    """`count` windows of `text` whose lengths follow a Pareto tail (index TAIL) from SHORTEST,
    capped at LONGEST characters; newlines become spaces (one document per line)."""
    rng = random.Random(seed)
    docs = []
    for _ in range(count):
        n = min(LONGEST, int(SHORTEST / (1.0 - rng.random()) ** (1.0 / TAIL)))
        start = rng.randrange(len(text) - n)
        docs.append(text[start:start + n].replace("\n", " "))
    return docs


class LongTailCorpus:
    """The shipped documents as (tokens, labels) sequences, labels the next characters."""

    def __init__(self, path: Path = DOCUMENTS):
        self.chars = CharCorpus(CORPUS)
        self.vocab = self.chars.vocab
        lines = [line for line in path.read_text(encoding="utf-8").split("\n") if len(line) >= 2]
        self.documents = [torch.tensor([self.chars.ids[c] for c in line], dtype=torch.int64) for line in lines]

    def step(self, i: int, tokens: int = 256, seed: int = 0) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Step i's sequences: documents drawn at random (a function of seed and i only) until
        `tokens` tokens are reached."""
        rng = random.Random(seed * 1_000_003 + i)
        out, total = [], 0
        while total < tokens:
            doc = self.documents[rng.randrange(len(self.documents))]
            out.append((doc[:-1], doc[1:]))
            total += len(doc) - 1
        return out


if __name__ == "__main__":
    if sys.argv[1:] != ["--write"]:
        sys.exit("usage: python examples/mixed_length/longtail.py --write")
    DOCUMENTS.write_text("\n".join(make_documents(CORPUS.read_text(encoding="utf-8"))) + "\n", encoding="utf-8")
    print(f"wrote {DOCUMENTS}")
