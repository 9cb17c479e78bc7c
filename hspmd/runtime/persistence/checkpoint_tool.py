"""`hspmd checkpoint ...`: tools over checkpoint files (export-hf writes a Hugging Face directory;
inspect and consolidate read sharded checkpoints; verify checks every tensor of any format hspmd
writes, DCP included).
Run through `hspmd.cli.main`, which turns an HSPMDError into one `hspmd: error:` line and exit
status 2."""

from __future__ import annotations

import torch

from hspmd.arguments import ArgumentParser
from hspmd.runtime.persistence.hf_checkpoint import export_checkpoint
from hspmd.runtime.persistence.dcp_checkpoint import open_any_checkpoint
from hspmd.runtime.persistence.sharded_checkpoint import consolidate, inspect

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def main(argv: list[str] | None = None) -> int:
    parser = ArgumentParser(prog="hspmd checkpoint", description="Tools over hspmd checkpoint files.")
    sub = parser.add_subparsers(dest="tool", required=True)
    export = sub.add_parser("export-hf", help="write a directory that transformers' LlamaForCausalLM loads")
    export.add_argument("checkpoint", help="an hspmd checkpoint (.safetensors) of a Llama")
    export.add_argument("directory", help="output directory (config.json + model.safetensors)")
    export.add_argument("--config", default=None,
                        help="the model's config.json or a directory with one (default: beside the checkpoint)")
    export.add_argument("--dtype", choices=sorted(DTYPES), default=None,
                        help="store the weights in this dtype (default: the checkpoint's)")
    sub.add_parser("inspect", help="what a sharded checkpoint holds: step, files, tensors and their boxes").add_argument(
        "path", help="a sharded checkpoint directory (its latest step) or one step directory")
    merge = sub.add_parser("consolidate", help="a sharded checkpoint as one plain safetensors file of whole tensors")
    merge.add_argument("path", help="a sharded checkpoint directory (its latest step) or one step directory")
    merge.add_argument("out", help="the .safetensors file to write (an hspmd single-file checkpoint too)")
    sub.add_parser("verify", help="read every tensor (every stored piece) of a checkpoint and check its sha256").add_argument(
        "path", help="a single-file checkpoint, a sharded checkpoint directory (its latest step), one step directory, "
                     "or a torch Distributed Checkpoint directory hspmd wrote")
    args = parser.parse_args(argv)
    if args.tool == "verify":
        reader = open_any_checkpoint(args.path)
        reader.verify()
        print(f"{reader.path}: step {reader.step}, {len(reader.names)} tensors, every one matches its checksum")
    elif args.tool == "inspect":
        print(inspect(args.path))
    elif args.tool == "consolidate":
        print(f"wrote {args.out} (step {consolidate(args.path, args.out)})")
    else:
        out = export_checkpoint(args.checkpoint, args.directory, args.config, DTYPES.get(args.dtype))
        print(f"wrote {out} (load it with transformers.LlamaForCausalLM.from_pretrained)")
    return 0


__all__ = ["main"]
