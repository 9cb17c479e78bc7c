"""Token files and the loader: throughput against plain numpy, and a rank's memory as the dataset grows.

    python benchmarks/bench_data.py [--reps 5] [--largest 1073741824]

1. prepare: tokens/s of `hspmd data prepare` (bytes tokenizer, documents separated by blank lines,
   checksums, index) on an 8 MiB generated corpus, against plain numpy reading the file whole and
   writing its bytes as uint16 (no documents, no checksum). Sides interleaved, --reps each.
2. loader: tokens/s of one rank's share of each step (SequenceLoader: the skip to its pipeline's first
   row through the index, then its rows from the shuffled documents) against plain numpy slicing the
   same number of rows of seq + 1 tokens out of the memory-mapped .bin in file order (both after a
   warm-up pass, so both read from the page cache).
3. memory: a fresh process per dataset size opens the dataset and reads 200 steps of a rank's share
   (starting in epoch 1, so the rows come from documents all over the file); its resident memory
   grown by that (VmRSS, file pages it touched included) and Python's peak allocation, for datasets
   of 2^20 to --largest tokens (generated in a temporary directory, deleted at the end).
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import tracemalloc

import numpy as np

from _common import table
from hspmd.runtime.data.loader import SequenceLoader
from hspmd.runtime.data.order import DataState
from hspmd.runtime.data.prepare import prepare
from hspmd.runtime.data.tokens import TokenWriter

SEQ, GLOBAL_ROWS, SHARE = 512, 64, (16, 32)  # a rank's pipeline trains rows 16-31 of each 64-row batch
WORDS = np.array("the cluster woke before engineers did eight old cards hummed in first rack and four new ones".split())


def corpus(path: str, size: int) -> None:
    rng = np.random.default_rng(0)
    with open(path, "w", encoding="utf-8") as f:
        written = 0
        while written < size:
            text = " ".join(rng.choice(WORDS, int(rng.integers(20, 400)))) + "\n\n"
            f.write(text)
            written += len(text)


def plain_prepare(path: str, out: str) -> int:
    with open(path, "rb") as f:
        tokens = np.frombuffer(f.read(), dtype=np.uint8).astype(np.uint16)
    tokens.tofile(out)
    return tokens.size


def spread(values) -> str:
    return f"{statistics.median(values):.3g} ({min(values):.3g}-{max(values):.3g})"


def bench_prepare(tmp: str, reps: int) -> None:
    text = os.path.join(tmp, "corpus.txt")
    corpus(text, 8 * 2**20)
    ours, plain = [], []
    for rep in range(reps):
        began = time.perf_counter()
        tokens = prepare([text], os.path.join(tmp, f"p{rep}"))["tokens"]
        ours.append(tokens / (time.perf_counter() - began))
        began = time.perf_counter()
        count = plain_prepare(text, os.path.join(tmp, f"plain{rep}.bin"))
        plain.append(count / (time.perf_counter() - began))
    ratios = [a / b for a, b in zip(ours, plain)]
    print(f"prepare, {tokens / 2**20:.1f} Mi tokens, {reps} interleaved runs: median (min-max)")
    print(table(["", "M tokens/s"], [["hspmd data prepare", spread([x / 1e6 for x in ours])],
                                     ["numpy: read, cast, write", spread([x / 1e6 for x in plain])]]))
    print(f"prepare / numpy: {spread(ratios)}\n")


def generate(prefix: str, tokens: int, seed: int = 0) -> None:
    """A dataset of `tokens` random ids (vocabulary 32,000) in documents of 100-8,000 tokens."""
    rng = np.random.default_rng(seed)
    writer = TokenWriter(prefix, 32000)
    left = tokens
    while left > 0:
        n = min(left, int(rng.integers(100, 8000)))
        writer.add(rng.integers(0, 32000, n, dtype=np.int32), "generated")
        left -= n
    writer.close()


def share_steps(loader: SequenceLoader, state: DataState, steps: int) -> int:
    read = 0
    for _ in range(steps):
        windows, _ = loader.windows(loader.skip(state, SHARE[0]), SHARE[1] - SHARE[0])
        read += windows.size
        state = loader.skip(state, GLOBAL_ROWS)
    return read


def plain_steps(bin_path: str, steps: int) -> int:
    tokens = np.memmap(bin_path, dtype=np.uint16, mode="r")
    read, row = 0, 0
    for _ in range(steps):
        rows = np.stack([np.asarray(tokens[(row + r) * SEQ: (row + r) * SEQ + SEQ + 1], dtype=np.int64)
                         for r in range(SHARE[1] - SHARE[0])])
        read += rows.size
        row += GLOBAL_ROWS
    return read


def bench_loader(tmp: str, reps: int) -> None:
    prefix = os.path.join(tmp, "loader")
    generate(prefix, 64 * 2**20)
    loader, steps = SequenceLoader(prefix, SEQ, seed=1), 200
    share_steps(loader, DataState(epoch=1), steps)  # warm-up: both sides then read from the page cache
    plain_steps(prefix + ".bin", steps)
    ours, plain = [], []
    for _ in range(reps):
        began = time.perf_counter()
        read = share_steps(loader, DataState(epoch=1), steps)
        ours.append(read / (time.perf_counter() - began))
        began = time.perf_counter()
        read = plain_steps(prefix + ".bin", steps)
        plain.append(read / (time.perf_counter() - began))
    ratios = [a / b for a, b in zip(ours, plain)]
    print(f"loader, one rank's rows {SHARE[0]}-{SHARE[1] - 1} of {GLOBAL_ROWS} x {SEQ} tokens per step, {steps} steps, "
          f"64 Mi-token dataset, {reps} interleaved runs")
    print(table(["", "M tokens/s"], [["SequenceLoader (shuffled documents)", spread([x / 1e6 for x in ours])],
                                     ["numpy slices of the .bin in file order", spread([x / 1e6 for x in plain])]]))
    print(f"loader / numpy: {spread(ratios)}\n")


def rss() -> int:
    with open("/proc/self/status", encoding="ascii") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))


def child(prefix: str) -> None:
    """One rank: open the dataset, read 200 steps of its share; print RSS growth and Python's peak."""
    before = rss()
    tracemalloc.start()
    share_steps(SequenceLoader(prefix, SEQ, seed=1), DataState(epoch=1), 200)
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    print(rss() - before, peak)


def bench_memory(tmp: str, largest: int) -> None:
    sizes = [2**20]
    while sizes[-1] * 32 <= largest:
        sizes.append(sizes[-1] * 32)
    if sizes[-1] < largest:
        sizes.append(largest)
    rows = []
    for tokens in sizes:
        prefix = os.path.join(tmp, f"m{tokens}")
        began = time.perf_counter()
        generate(prefix, tokens)
        made = time.perf_counter() - began
        out = subprocess.run([sys.executable, __file__, "--child", prefix], capture_output=True, text=True, check=True)
        grown, peak = map(int, out.stdout.split())
        rows.append([f"{tokens / 2**20:,.0f} Mi", f"{os.path.getsize(prefix + '.bin') / 2**20:,.0f} MiB",
                     f"{grown / 2**20:.1f}", f"{peak / 2**20:.2f}", f"{made:.0f}s"])
        for suffix in (".bin", ".idx", ".json"):
            os.remove(prefix + suffix)
    print(f"memory of one rank reading 200 steps of its share ({(SHARE[1] - SHARE[0]) * SEQ:,} tokens each), fresh process")
    print(table(["dataset tokens", ".bin", "RSS grown MiB", "Python peak MiB", "generated in"], rows))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--largest", type=int, default=2**30, help="tokens of the largest dataset (default 2^30)")
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        child(args.child)
        return 0
    tmp = tempfile.mkdtemp(prefix="bench-data-", dir="/tmp")
    try:
        bench_prepare(tmp, args.reps)
        bench_loader(tmp, args.reps)
        bench_memory(tmp, args.largest)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
