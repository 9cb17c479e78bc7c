"""Hugging Face Llama checkpoints in and out of hspmd.

Import: `HFCheckpoint(directory)` is a reader for cut_leaves (and Trainer.load_checkpoint): each
rank asks only for the boxes of its own pieces and gets them with safetensors' get_slice, so no
rank loads a whole tensor it does not hold. What differs from an hspmd checkpoint is handled here,
not by loosening CheckpointReader: there is no step (training starts at step 0), optimizer states
are absent (fresh AdamW states, zeros), projections are stored transposed, and the file's dtype
(e.g. bf16) is converted to the model's (fp32 master weights).

Export: `export_hf(tensors, config, directory)` writes config.json and model.safetensors that
transformers' LlamaForCausalLM.from_pretrained loads; `export_checkpoint(path, directory)` does it
for an hspmd checkpoint file, taking the model's config.json from beside it (the training example
writes one) or from `config=`.
"""

from __future__ import annotations

import json
import os
from typing import Mapping

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from hspmd.annotations import box_shape
from hspmd.errors import CheckpointError, HSPMDError, ShapeError
from hspmd.models.hf_llama import HFName, config_from_hf, hf_config, hf_names, read_hf_config, read_hf_config_json
from hspmd.models.llama import LlamaConfig
from hspmd.runtime.persistence.checkpoint import CheckpointReader
from hspmd.runtime.persistence.sharded_checkpoint import is_sharded_checkpoint

INDEX_FILE = "model.safetensors.index.json"
WEIGHTS_FILE = "model.safetensors"


def _shard_files(directory: str) -> dict[str, str]:
    """{Hugging Face tensor name: shard path}: from the index if there is one, else every
    *.safetensors file of the directory (header only; no tensor is read)."""
    index = os.path.join(directory, INDEX_FILE)
    if os.path.isfile(index):
        try:
            with open(index, encoding="utf-8") as f:
                parsed = json.load(f)
        except (OSError, ValueError) as exc:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
            raise CheckpointError(f"Hugging Face index {index} cannot be read (not JSON text): {exc}") from None
        weight_map = parsed.get("weight_map") if isinstance(parsed, dict) else None
        if not isinstance(weight_map, dict) or not all(isinstance(f, str) for f in weight_map.values()):
            raise CheckpointError(f"{index} has no weight_map of tensor names to file names")
        return {name: os.path.join(directory, file) for name, file in weight_map.items()}
    files = sorted(f for f in os.listdir(directory) if f.endswith(".safetensors"))
    if not files:
        raise HSPMDError(f"Hugging Face directory {directory!r} has no *.safetensors file "
                         f"(only safetensors weights are read; convert .bin files first)")
    out = {}
    for file in files:
        path = os.path.join(directory, file)
        out.update({name: path for name in _open_safetensors(path).keys()})
    return out


def _open_safetensors(path: str):
    """safe_open(path), its failure (a truncated or garbage file) a CheckpointError naming it."""
    try:
        return safe_open(path, framework="pt")
    except (SafetensorError, OSError, ValueError) as exc:
        raise CheckpointError(f"Hugging Face weights {path} cannot be read (truncated or not a safetensors "
                              f"file): {exc}") from None


class HFCheckpoint:
    """A read(name, box, shape) over a local Hugging Face Llama directory for hspmd's `config`
    (default: the directory's own config.json). `dtype` is the model's parameter dtype."""

    step = 0

    def __init__(self, directory: str | os.PathLike, config: LlamaConfig | None = None,
                 dtype: torch.dtype = torch.float32):
        self.directory = os.fspath(directory)
        if not os.path.isdir(self.directory):
            raise HSPMDError(f"Hugging Face model directory {self.directory!r} does not exist")
        self.config = config if config is not None else read_hf_config(self.directory)
        self.dtype = dtype
        self.names: dict[str, HFName] = hf_names(self.config)
        self.files = _shard_files(self.directory)
        missing = sorted(n.name for n in self.names.values() if n.name not in self.files)
        if missing:
            hint = (" (config.json says tie_word_embeddings is false but the file has no LM head)"
                    if missing == ["lm_head.weight"] else "")
            raise HSPMDError(f"Hugging Face checkpoint {self.directory} lacks {len(missing)} tensor(s) this Llama "
                             f"needs, e.g. {', '.join(missing[:3])}{hint}")
        self._open: dict[str, object] = {}

    def _file(self, path: str):
        if path not in self._open:
            self._open[path] = _open_safetensors(path)
        return self._open[path]

    def __call__(self, name: str, box: tuple, shape: tuple[int, ...]) -> torch.Tensor:
        if name not in self.names:
            owner = name.rsplit(".", 1)[0]
            if owner in self.names:  # an optimizer state: a Hugging Face checkpoint starts them fresh
                return torch.zeros(box_shape(box) if box else tuple(shape), dtype=self.dtype)
            raise HSPMDError(f"Hugging Face checkpoint {self.directory}: hspmd tensor {name!r} is neither a "
                             f"Llama parameter nor an optimizer state of one")
        where = self.names[name]
        path = self.files[where.name]
        try:
            view = self._file(path).get_slice(where.name)
        except (SafetensorError, OSError, ValueError) as exc:  # an index naming a tensor the file lacks
            raise CheckpointError(f"Hugging Face weights {path}: tensor {where.name!r} cannot be read: {exc}") from None
        stored = tuple(view.get_shape())
        expected = tuple(reversed(shape)) if where.transposed else tuple(shape)
        if stored != expected:
            raise ShapeError(f"Hugging Face checkpoint {self.directory}: {where.name} has shape {stored}, "
                             f"the model's config.json implies {expected}")
        box = tuple(box) if box else tuple((0, s) for s in shape)
        hf_box = tuple(reversed(box)) if where.transposed else box
        try:
            piece = view[tuple(slice(a, b) for a, b in hf_box)]
        except (SafetensorError, OSError, ValueError, RuntimeError) as exc:
            raise CheckpointError(f"Hugging Face weights {path}: tensor {where.name!r} cannot be read: {exc}") from None
        if not piece.dtype.is_floating_point:
            raise HSPMDError(f"Hugging Face checkpoint {self.directory}: {where.name} is {piece.dtype}, not a float")
        piece = piece.t() if where.transposed else piece
        return piece.to(self.dtype).contiguous()


def hf_state_dict(tensors: Mapping[str, torch.Tensor], config: LlamaConfig,
                  dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
    """Hugging Face names and orientation of hspmd's whole parameters (optimizer states dropped)."""
    out = {}
    for name, where in hf_names(config).items():
        if name not in tensors:
            raise HSPMDError(f"export: the checkpoint has no parameter {name!r} of this Llama configuration")
        value = tensors[name].t() if where.transposed else tensors[name]
        out[where.name] = value.to(dtype or value.dtype).contiguous()
    return out


def export_hf(tensors: Mapping[str, torch.Tensor], config: LlamaConfig, directory: str | os.PathLike,
              dtype: torch.dtype | None = None, original: Mapping | None = None) -> str:
    """Write config.json and model.safetensors for LlamaForCausalLM.from_pretrained(directory);
    `original` (the model's own config.json) keeps every field hspmd does not determine."""
    directory = os.fspath(directory)
    os.makedirs(directory, exist_ok=True)
    state = hf_state_dict(tensors, config, dtype)
    dtype_name = str(next(iter(state.values())).dtype).replace("torch.", "")
    tmp = os.path.join(directory, f"{WEIGHTS_FILE}.tmp-{os.getpid()}")
    save_file(state, tmp, metadata={"format": "pt"})
    os.replace(tmp, os.path.join(directory, WEIGHTS_FILE))
    with open(os.path.join(directory, "config.json"), "w", encoding="utf-8") as f:
        json.dump(hf_config(config, dtype_name, original), f, indent=2, sort_keys=True)
    return directory


def export_checkpoint(path: str | os.PathLike, directory: str | os.PathLike, config: str | os.PathLike | None = None,
                      dtype: torch.dtype | None = None) -> str:
    """Export an hspmd checkpoint file; `config` is a Hugging Face config.json or a directory with
    one (default: the checkpoint's own directory)."""
    path = os.fspath(path)
    if is_sharded_checkpoint(path):
        raise CheckpointError(f"{path} is a sharded checkpoint directory; export-hf reads one file: run "
                              f"`hspmd checkpoint consolidate {path} OUT.safetensors` first, then export OUT.safetensors "
                              f"(with --config naming the model's config.json unless it is beside OUT)")
    reader = CheckpointReader(path)
    where = os.fspath(config) if config is not None else os.path.dirname(os.path.abspath(path))
    if os.path.isfile(where):
        where = os.path.dirname(os.path.abspath(where)) if os.path.basename(where) == "config.json" else where
        if os.path.isfile(where):
            raise HSPMDError(f"--config {where!r}: give a config.json or the directory holding it")
    if not os.path.isfile(os.path.join(where, "config.json")):
        raise HSPMDError(f"no config.json beside {path} (in {where}): pass the model's config with --config "
                         f"(examples/llama/train.py writes one next to its checkpoint)")
    original = read_hf_config_json(where)
    model = config_from_hf(original)
    shapes = model.parameter_shapes()
    tensors = {name: reader(name, tuple((0, s) for s in shape), shape) for name, shape in shapes.items()}
    return export_hf(tensors, model, directory, dtype, original)


__all__ = ["HFCheckpoint", "export_checkpoint", "export_hf", "hf_state_dict"]
