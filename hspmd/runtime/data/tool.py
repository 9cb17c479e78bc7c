"""`hspmd data prepare` and `hspmd data inspect`: token files from text, and what they hold.

    hspmd data prepare corpus.txt --out data/corpus                      # bytes: ids 0-255
    hspmd data prepare docs.jsonl --out data/docs --tokenizer ./tok --vocab 32000
    hspmd data inspect data/corpus [--verify]

prepare streams its inputs (constant memory) with a progress bar on a terminal and writes
PREFIX.bin / .idx / .json (hspmd.runtime.data.tokens); a bad input is one `hspmd: error:` line
naming the file (and line).
"""

from __future__ import annotations

import os
import sys
from typing import Sequence

from rich.console import Console
from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn, TransferSpeedColumn

from hspmd.arguments import ArgumentParser, positive_int
from hspmd.errors import UsageError
from hspmd.runtime.data.prepare import BYTES, SPLITS, prepare
from hspmd.runtime.data.tokens import TokenFiles

USAGE = "usage: hspmd data prepare INPUT... --out PREFIX [--tokenizer bytes|DIR] [--vocab N] | inspect PREFIX [--verify]"


def prepare_main(argv: Sequence[str]) -> int:
    p = ArgumentParser(prog="hspmd data prepare", description="tokenize text into memory-mapped token files")
    p.add_argument("inputs", nargs="+", help="text files (documents separated by blank lines) or .jsonl files")
    p.add_argument("--out", required=True, help="dataset prefix: writes PREFIX.bin, PREFIX.idx, PREFIX.json")
    p.add_argument("--tokenizer", default=BYTES, help="`bytes` (default) or a local Hugging Face tokenizer directory")
    p.add_argument("--vocab", type=positive_int, default=None,
                   help="the model's vocabulary: refuse any id at or beyond it (default: the tokenizer's size)")
    p.add_argument("--key", default="text", help="the text field of a .jsonl line (default text)")
    p.add_argument("--split", choices=SPLITS, default="paragraphs",
                   help="text files: documents separated by blank lines (paragraphs, default) or one per line (lines)")
    args = p.parse_args(list(argv))
    console = Console(stderr=True)
    total = sum(os.path.getsize(path) for path in args.inputs if os.path.isfile(path))
    with Progress(TextColumn("preparing"), BarColumn(), DownloadColumn(), TransferSpeedColumn(), TimeRemainingColumn(),
                  console=console, disable=not console.is_terminal) as bar:
        task = bar.add_task("prepare", total=total)
        manifest = prepare(args.inputs, args.out, args.tokenizer, args.vocab, args.key, args.split,
                           progress=lambda done: bar.update(task, completed=done))
    print(f"{args.out}: {manifest['documents']} documents, {manifest['tokens']} tokens ({manifest['dtype']}), "
          f"vocabulary {manifest['vocab']}, tokenizer {manifest['tokenizer']}")
    return 0


def inspect_main(argv: Sequence[str]) -> int:
    p = ArgumentParser(prog="hspmd data inspect", description="what a prepared dataset holds")
    p.add_argument("prefix")
    p.add_argument("--verify", action="store_true", help="also hash the whole .bin against the manifest")
    args = p.parse_args(list(argv))
    files = TokenFiles(args.prefix)
    if args.verify:
        files.verify()
    lengths = files.lengths
    print(f"{files.prefix}: {files.documents} documents, {files.tokens} tokens ({files.dtype}), vocabulary "
          f"{files.vocab}, tokenizer {files.tokenizer}; document lengths {int(lengths.min())}-{int(lengths.max())}"
          f"{'; .bin verified' if args.verify else ''}")
    return 0


def main(argv: Sequence[str]) -> int:
    commands = {"prepare": prepare_main, "inspect": inspect_main}
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE)
        return 0
    if argv[0] not in commands:
        raise UsageError(f"hspmd data: unknown subcommand {argv[0]!r}; {USAGE}")
    return commands[argv[0]](argv[1:])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
