"""Hugging Face Llama checkpoints as plain data: config.json <-> LlamaConfig, and the map between
hspmd's parameter names and Hugging Face's (with which weights are transposed).

hspmd stores projections [in_features, out_features] (x @ w); Hugging Face's nn.Linear stores
[out_features, in_features], so every projection and the LM head is transposed on the way in and
out. Both apply RoPE in the rotate-half form to the same head layout, so no permutation is needed.
Reading and writing the tensors is hspmd.runtime.persistence.hf_checkpoint's job; this module only maps names.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any, Mapping

from hspmd.errors import HSPMDError
from hspmd.models.llama import LlamaConfig
from hspmd.ops.nn import RopeScaling

# hspmd name inside layer l -> (Hugging Face name inside model.layers.l, stored transposed)
LAYER_NAMES = {
    "attn_norm": ("input_layernorm.weight", False),
    "wq": ("self_attn.q_proj.weight", True),
    "wk": ("self_attn.k_proj.weight", True),
    "wv": ("self_attn.v_proj.weight", True),
    "wo": ("self_attn.o_proj.weight", True),
    "mlp_norm": ("post_attention_layernorm.weight", False),
    "w_gate": ("mlp.gate_proj.weight", True),
    "w_up": ("mlp.up_proj.weight", True),
    "w_down": ("mlp.down_proj.weight", True),
}
TOP_NAMES = {
    "embed": ("model.embed_tokens.weight", False),
    "final_norm": ("model.norm.weight", False),
    "lm_head": ("lm_head.weight", True),
}
SUPPORTED_MODEL_TYPES = ("llama",)


@dataclass(frozen=True)
class HFName:
    """Where an hspmd parameter lives in a Hugging Face state dict, and whether it is transposed."""

    name: str
    transposed: bool


def hf_names(config: LlamaConfig) -> dict[str, HFName]:
    """{hspmd parameter name: HFName} for every parameter of the model (no lm_head when tied)."""
    out = {}
    for name in config.parameter_shapes():
        if name.startswith("layers."):
            _, layer, local = name.split(".", 2)
            hf, transposed = LAYER_NAMES[local]
            out[name] = HFName(f"model.layers.{layer}.{hf}", transposed)
        else:
            out[name] = HFName(*TOP_NAMES[name])
    return out


def _key(cfg: Mapping[str, Any], key: str, kind, default=None, required: bool = True):
    if key not in cfg or cfg[key] is None:
        if required and default is None:
            raise HSPMDError(f"Hugging Face config.json has no {key!r}; a Llama config needs it")
        return default
    value = cfg[key]
    if kind is int and (not isinstance(value, int) or isinstance(value, bool)):
        raise HSPMDError(f"Hugging Face config.json: {key} must be an integer, got {value!r}")
    if kind is float and (not isinstance(value, (int, float)) or isinstance(value, bool)):
        raise HSPMDError(f"Hugging Face config.json: {key} must be a number, got {value!r}")
    return kind(value)


def _rope(cfg: Mapping[str, Any]) -> tuple[float, RopeScaling | None]:
    """(base, scaling) from either transformers 5's rope_parameters or the older rope_theta +
    rope_scaling keys."""
    params = dict(cfg.get("rope_parameters") or {})
    scaling = dict(cfg.get("rope_scaling") or {})
    base = params.get("rope_theta", cfg.get("rope_theta", 10000.0))
    if not isinstance(base, (int, float)) or isinstance(base, bool) or base <= 0:
        raise HSPMDError(f"Hugging Face config.json: rope_theta must be a positive number, got {base!r}")
    spec = {**scaling, **params}
    kind = spec.get("rope_type", spec.get("type", "default"))
    if kind == "default":
        return float(base), None
    where = "rope_parameters" if params else "rope_scaling"
    if kind not in ("linear", "llama3"):
        raise HSPMDError(f"Hugging Face config.json: {where}.rope_type {kind!r} is not supported "
                         f"(supported: default, linear, llama3)")
    try:
        if kind == "linear":
            return float(base), RopeScaling("linear", float(spec["factor"]))
        return float(base), RopeScaling("llama3", float(spec["factor"]), float(spec["low_freq_factor"]),
                                        float(spec["high_freq_factor"]),
                                        int(spec["original_max_position_embeddings"]))
    except KeyError as exc:
        raise HSPMDError(f"Hugging Face config.json: {where} of type {kind} has no {exc.args[0]!r}") from None


def config_from_hf(cfg: Mapping[str, Any]) -> LlamaConfig:
    """The LlamaConfig of a Hugging Face Llama config.json (as a dict); refuses what hspmd's Llama
    cannot represent (biases, another activation, another model type) by name."""
    model_type = cfg.get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise HSPMDError(f"Hugging Face config.json: model_type {model_type!r} is not a Llama "
                         f"(supported: {', '.join(SUPPORTED_MODEL_TYPES)})")
    for key in ("attention_bias", "mlp_bias"):
        if cfg.get(key):
            raise HSPMDError(f"Hugging Face config.json: {key} is true; hspmd's Llama has no biases")
    if cfg.get("hidden_act", "silu") != "silu":
        raise HSPMDError(f"Hugging Face config.json: hidden_act {cfg['hidden_act']!r} is not supported (only silu)")
    base, scaling = _rope(cfg)
    heads = _key(cfg, "num_attention_heads", int)
    vocab = _key(cfg, "vocab_size", int)
    pad = _key(cfg, "pad_token_id", int, required=False)
    if pad is not None and not 0 <= pad < vocab:
        raise HSPMDError(f"Hugging Face config.json: pad_token_id {pad} is not a token of the vocabulary of {vocab}")
    return LlamaConfig(
        vocab=vocab,
        hidden=_key(cfg, "hidden_size", int),
        layers=_key(cfg, "num_hidden_layers", int),
        heads=heads,
        ffn=_key(cfg, "intermediate_size", int),
        rope_base=base,
        eps=_key(cfg, "rms_norm_eps", float, 1e-6),
        kv_heads=_key(cfg, "num_key_value_heads", int, heads),
        head_dim=_key(cfg, "head_dim", int, required=False),
        tie_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        rope_scaling=scaling,
        pad_token=pad,
    )


# config.json keys that hspmd's LlamaConfig determines (with the dtype); an export writes these and keeps
# every other key of the model's original config.json as it was (token ids, max_position_embeddings, ...)
OWNED_KEYS = ("architectures", "model_type", "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
              "num_attention_heads", "num_key_value_heads", "head_dim", "hidden_act", "rms_norm_eps",
              "tie_word_embeddings", "attention_bias", "mlp_bias", "torch_dtype", "dtype")
ROPE_KEYS = ("rope_theta", "rope_scaling", "rope_parameters")


def hf_config(config: LlamaConfig, dtype: str = "float32", original: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """config.json of `config` for transformers' LlamaForCausalLM (both rope key styles written).

    original: the config.json the model came from; then every key hspmd does not determine (token ids,
    max_position_embeddings, generation settings, ...) is kept as it was, and so are its RoPE keys
    when they read as `config`'s RoPE, so that an export changes only what hspmd changed."""
    if original is not None:
        out = dict(original)
        out.update({k: v for k, v in hf_config(config, dtype).items() if k in OWNED_KEYS})
        if _rope(original) != (config.rope_base, config.rope_scaling):
            out.update({k: v for k, v in hf_config(config, dtype).items() if k in ROPE_KEYS})
        out.setdefault("max_position_embeddings", hf_config(config, dtype)["max_position_embeddings"])
        return out
    rope: dict[str, Any] = {"rope_type": "default", "rope_theta": config.rope_base}
    scaling = config.rope_scaling
    if scaling is not None:
        rope.update(rope_type=scaling.kind, factor=scaling.factor)
        if scaling.kind == "llama3":
            rope.update(low_freq_factor=scaling.low_freq_factor, high_freq_factor=scaling.high_freq_factor,
                        original_max_position_embeddings=scaling.original_max_position)
    legacy = None if scaling is None else {k: v for k, v in rope.items() if k != "rope_theta"}
    return {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": config.vocab,
        "hidden_size": config.hidden, "intermediate_size": config.ffn, "num_hidden_layers": config.layers,
        "num_attention_heads": config.heads, "num_key_value_heads": config.kv_heads, "head_dim": config.head_dim,
        "hidden_act": "silu", "rms_norm_eps": config.eps, "rope_theta": config.rope_base, "rope_scaling": legacy,
        "rope_parameters": rope, "tie_word_embeddings": config.tie_embeddings, "attention_bias": False,
        "mlp_bias": False, "max_position_embeddings": max(2048, scaling.original_max_position if scaling else 0),
        "torch_dtype": dtype, "dtype": dtype, **({} if config.pad_token is None else {"pad_token_id": config.pad_token}),
    }


def read_hf_config(directory: str | os.PathLike) -> LlamaConfig:
    """The LlamaConfig of a local Hugging Face model directory (its config.json)."""
    return config_from_hf(read_hf_config_json(directory))


def read_hf_config_json(directory: str | os.PathLike) -> dict[str, Any]:
    """A local Hugging Face model directory's config.json as it is written (a dict)."""
    path = os.path.join(os.fspath(directory), "config.json")
    if not os.path.isfile(path):
        raise HSPMDError(f"{os.fspath(directory)!r} is not a Hugging Face model directory: it has no config.json")
    try:
        with open(path, encoding="utf-8") as f:
            cfg = json.load(f)
    except json.JSONDecodeError as exc:
        raise HSPMDError(f"{path} is not valid JSON: {exc}") from None
    if not isinstance(cfg, dict):
        raise HSPMDError(f"{path} must hold a JSON object, got {type(cfg).__name__}")
    return cfg


__all__ = ["HFName", "config_from_hf", "hf_config", "hf_names", "read_hf_config", "read_hf_config_json"]
