"""`hspmd checkpoint ...`: tools over checkpoint files (export-hf writes a Hugging Face directory)."""

from __future__ import annotations

import argparse
import sys

import torch

from hspmd.errors import HSPMDError
from hspmd.runtime.hf_checkpoint import export_checkpoint

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="hspmd checkpoint", description="Tools over hspmd checkpoint files.")
    sub = parser.add_subparsers(dest="tool", required=True)
    export = sub.add_parser("export-hf", help="write a directory that transformers' LlamaForCausalLM loads")
    export.add_argument("checkpoint", help="an hspmd checkpoint (.safetensors) of a Llama")
    export.add_argument("directory", help="output directory (config.json + model.safetensors)")
    export.add_argument("--config", default=None,
                        help="the model's config.json or a directory with one (default: beside the checkpoint)")
    export.add_argument("--dtype", choices=sorted(DTYPES), default=None,
                        help="store the weights in this dtype (default: the checkpoint's)")
    args = parser.parse_args(argv)
    try:
        out = export_checkpoint(args.checkpoint, args.directory, args.config, DTYPES.get(args.dtype))
    except HSPMDError as exc:
        print(f"hspmd checkpoint: error: {exc}", file=sys.stderr)
        return 2
    print(f"wrote {out} (load it with transformers.LlamaForCausalLM.from_pretrained)")
    return 0


__all__ = ["main"]
