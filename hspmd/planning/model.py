"""What a model costs, independent of any hardware: parameter counts, FLOPs, bytes moved and
activation memory of a Llama-family transformer, per layer and per micro-batch.

A layer is listed as kernels of five classes (HeteroSim Table 1): "gemm" and "attn" are priced
by FLOPs, "elementwise", "norm" and "misc" (views, embedding look-ups) by bytes through HBM, each
plus a per-launch overhead. The lists mirror the ops of hspmd's DSL Llama, forward and backward
(so level 1 and level 2 of the simulator price the same work). FLOPs are exact for the matrix
products (2 per multiply-add; the attention core counts the full s x s score matrix, as the
project's causal_attention computes it); bytes are the tensors each op reads and writes once (an
approximation of the real traffic). Activation
memory counts the tensors autograd keeps for the backward pass (an estimate, not a measurement).

Presets: llama-32b-hetu (the Hetu authors' scripts, Hetu v2 §8, Table 2), llama-30b and gpt-13b (HeteroSim's
workloads), h2-100b (H2 Table 4: GQA with 8 queries per key head), llama-tiny (the demo's model).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, replace

from hspmd.comm_resolve.cost import DTYPE_SIZES, dtype_name
from hspmd.errors import ClusterError
from hspmd.models.hf_llama import read_hf_config

KERNEL_CLASSES = ("gemm", "attn", "elementwise", "norm", "misc")


@dataclass(frozen=True)
class Kernel:
    """One kernel of a layer: class, FLOPs and HBM bytes of one launch, and how many launches."""

    cls: str
    flops: float = 0.0
    bytes: float = 0.0
    count: int = 1


def _int(value: object, name: str, low: int = 1) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ClusterError(f"ModelSpec {name}: must be an integer >= {low}, got {value!r}")
    return value


@dataclass(frozen=True)
class ModelSpec:
    """A Llama-family model. `mlp`: "swiglu" (gate, up, down) or "gelu" (two matrices with biases,
    GPT); `tied`: the LM head shares the embedding matrix."""

    name: str
    layers: int
    hidden: int
    ffn: int
    heads: int
    kv_heads: int
    vocab: int
    seq_len: int
    dtype: str = "bfloat16"
    tied: bool = False
    mlp: str = "swiglu"
    head_dim: int | None = None

    def __post_init__(self):
        for field_name in ("layers", "hidden", "ffn", "heads", "kv_heads", "vocab", "seq_len"):
            _int(getattr(self, field_name), field_name)
        if self.heads % self.kv_heads:
            raise ClusterError(f"ModelSpec {self.name}: heads {self.heads} must be a multiple of kv_heads {self.kv_heads}")
        if self.head_dim is None:
            if self.hidden % self.heads:
                raise ClusterError(f"ModelSpec {self.name}: hidden {self.hidden} does not split into {self.heads} heads")
            object.__setattr__(self, "head_dim", self.hidden // self.heads)
        _int(self.head_dim, "head_dim")
        if self.mlp not in ("swiglu", "gelu"):
            raise ClusterError(f"ModelSpec {self.name}: mlp must be 'swiglu' or 'gelu', got {self.mlp!r}")
        try:
            object.__setattr__(self, "dtype", dtype_name(self.dtype))
        except Exception as e:
            raise ClusterError(f"ModelSpec {self.name}: dtype: {e}") from None

    # ---- sizes ----------------------------------------------------------------------------------

    @property
    def itemsize(self) -> int:
        return DTYPE_SIZES[self.dtype]

    @property
    def q_dim(self) -> int:
        return self.heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.kv_heads * self.head_dim

    def layer_parameters(self) -> int:
        """Parameters of one transformer layer (attention, MLP, two norms)."""
        h, f = self.hidden, self.ffn
        attn = h * self.q_dim + 2 * h * self.kv_dim + self.q_dim * h
        mlp = 3 * h * f if self.mlp == "swiglu" else 2 * h * f + f + h
        norms = 2 * h if self.mlp == "swiglu" else 4 * h  # RMSNorm weight; LayerNorm weight + bias
        return attn + mlp + norms

    def replicated_layer_parameters(self) -> int:
        """The part of layer_parameters every TP rank holds whole: the norms, and a GELU MLP's
        output bias (its input bias is split with its columns)."""
        h = self.hidden
        return 2 * h if self.mlp == "swiglu" else 4 * h + h

    def embedding_parameters(self) -> int:
        return self.vocab * self.hidden

    def head_parameters(self) -> int:
        """Final norm plus the LM head (0 extra when tied to the embedding)."""
        norm = self.hidden if self.mlp == "swiglu" else 2 * self.hidden
        return norm + (0 if self.tied else self.vocab * self.hidden)

    def parameters(self) -> int:
        return self.layers * self.layer_parameters() + self.embedding_parameters() + self.head_parameters()

    # ---- kernels --------------------------------------------------------------------------------

    def layer_kernels(self, mbs: int, seq: int, tp: int = 1, backward: bool = False,
                      share: float = 1.0) -> tuple[Kernel, ...]:
        """One layer's kernels (forward, or backward) on one of `tp` tensor-parallel devices, one
        per op of hspmd's DSL Llama (hspmd.models.llama) with its bytes read + written. `share`:
        the device's part of the sequence under context parallelism (its queries attend to the
        whole sequence's keys; head + tail chunks balance the causal half)."""
        b, s, h, e = mbs, seq, self.hidden, self.itemsize
        q, kv, f, heads = self.q_dim / tp, self.kv_dim / tp, self.ffn / tp, self.heads / tp
        t = b * s * share
        scores = 4.0 * b * heads * (s * share) * s * self.head_dim
        projections = [(h, q), (h, kv), (h, kv), (q, h)]
        projections += [(h, f), (h, f), (f, h)] if self.mlp == "swiglu" else [(h, f), (f, h)]
        if not backward:
            gemms = [Kernel("gemm", 2 * t * i * o, e * (t * i + i * o + t * o)) for i, o in projections]
            kernels = gemms + [
                Kernel("norm", 0, 2 * t * h * e, 2),                  # rms_normalize (attention, MLP)
                Kernel("elementwise", 0, (2 * t * h + h) * e, 2),     # times the norm weights
                Kernel("elementwise", 0, 2 * t * q * e), Kernel("elementwise", 0, 2 * t * kv * e),  # rotary
                Kernel("attn", scores, e * t * (2 * q + 2 * kv)),
                Kernel("elementwise", 0, 3 * t * h * e, 2),           # residual adds
                Kernel("misc", 0, 0, 8),                              # reshapes and transposes
            ]
            if self.mlp == "swiglu":
                kernels += [Kernel("elementwise", 0, 2 * t * f * e), Kernel("elementwise", 0, 3 * t * f * e)]
            else:
                kernels += [Kernel("elementwise", 0, 2 * t * f * e)]
            return tuple(kernels)
        gemms = [Kernel("gemm", 2 * t * i * o, e * (t * o + i * o + t * i), 1) for i, o in projections]
        gemms += [Kernel("gemm", 2 * t * i * o, e * (t * i + t * o + i * o), 1) for i, o in projections]
        kernels = gemms + [
            Kernel("attn", 2 * scores, e * t * (3 * q + 4 * kv)),
            Kernel("norm", 0, 3 * t * h * e, 2),                      # rms_normalize_grad
            Kernel("elementwise", 0, (2 * t * h + h) * e, 2),         # gradient through the norm weights
            Kernel("elementwise", 0, 3 * t * h * e, 2),               # gradient of the norm weights
            Kernel("elementwise", 0, (t * h + h) * e, 2),             # ... summed over tokens
            Kernel("elementwise", 0, 3 * t * q * e), Kernel("elementwise", 0, 3 * t * kv * e),  # rotary_grad
            Kernel("elementwise", 0, 3 * t * h * e, 5 if self.mlp == "swiglu" else 4),  # residual + fan-in adds
            Kernel("misc", 0, 0, 17),                                 # reshapes and transposes
        ]
        if self.mlp == "swiglu":
            kernels += [Kernel("elementwise", 0, 3 * t * f * e, 3)]   # silu_grad, two products
        else:
            kernels += [Kernel("elementwise", 0, 3 * t * f * e)]
        return tuple(kernels)

    def head_kernels(self, mbs: int, seq: int, tp: int = 1, backward: bool = False) -> tuple[Kernel, ...]:
        """Final norm, LM head (vocabulary split over TP) and the loss."""
        t, h, e, v = mbs * seq, self.hidden, self.itemsize, self.vocab / tp
        head = Kernel("gemm", 2 * t * h * v, e * (t * h + h * v + t * v), 2 if backward else 1)
        if not backward:
            return (Kernel("norm", 0, 2 * t * h * e), Kernel("elementwise", 0, (2 * t * h + h) * e), head,
                    Kernel("elementwise", 0, t * v * e + 8 * t), Kernel("elementwise", 0, 2 * e))
        return (head, Kernel("elementwise", 0, 2 * t * v * e + 8 * t), Kernel("norm", 0, 3 * t * h * e),
                Kernel("elementwise", 0, (5 * t * h + h) * e), Kernel("elementwise", 0, (t * h + h) * e),
                Kernel("elementwise", 0, 2 * e), Kernel("misc", 0, 0, 6))

    def embedding_kernels(self, mbs: int, seq: int, tp: int = 1, backward: bool = False) -> tuple[Kernel, ...]:
        """The look-up (rows read and written) or its gradient (a scatter-add into the table)."""
        t, h, e, v = mbs * seq, self.hidden, self.itemsize, self.vocab / tp
        if not backward:
            return (Kernel("misc", 0, 2 * t * h * e + 8 * t),)
        return (Kernel("misc", 0, (t * h + 2 * v * h) * e + 8 * t),)

    def layer_flops(self, mbs: int, seq: int) -> float:
        """Forward FLOPs of one layer for a micro-batch (all TP shards together)."""
        return sum(k.flops * k.count for k in self.layer_kernels(mbs, seq) if k.cls in ("gemm", "attn"))

    # ---- memory ---------------------------------------------------------------------------------

    def layer_activation_bytes(self, mbs: int, seq: int, tp: int = 1, recompute: bool | str = False,
                               cp: int = 1, share: float | None = None, cp_attention: str = "ring") -> float:
        """Bytes one layer keeps for its backward pass per micro-batch on one TP device; with
        recompute (True or "full") only the layer input; with "selective" recomputation the layer
        input, the matmul outputs (q, k, v, the attention output, the MLP's gate and up
        projections) and what context-parallel attention keeps, the norms, rotations, softmax and
        activation products being recomputed. Under context parallelism (`cp` groups, this device's
        `share` of the sequence, default 1/cp) everything per token scales by the share, and
        attention keeps what hspmd.ops.context keeps: the ring its final [o | lse] (it sends K/V
        around again in the backward), all_gather the whole sequence's K/V and its block,
        all_to_all the heads-split q, k, v and output over the whole sequence."""
        share = 1.0 / cp if share is None else share
        t, h, f, e = mbs * seq * share, self.hidden, self.ffn, self.itemsize
        if recompute and recompute != "selective":
            return t * h * e
        q, kv = self.q_dim / tp, self.kv_dim / tp
        if cp == 1:
            attention = mbs * (self.heads / tp) * seq * seq  # softmax probabilities
        elif cp_attention == "all_to_all":
            attention = mbs * seq * (2 * q + 2 * kv) / cp  # heads-split q, k, v and output, whole sequence
        elif cp_attention == "ring":
            attention = t * (q + self.heads / tp)  # the merged [o | lse]
        else:
            attention = mbs * seq * 2 * kv + t * (q + self.heads / tp)  # K/V whole, the block
        projections = (2 if self.mlp == "swiglu" else 1) * t * f / tp  # gate and up (or the one up projection)
        if recompute == "selective":
            return (t * h + t * (q + 2 * kv) + t * q + (attention if cp > 1 else 0.0) + projections) * e
        kept = (2 * t * h                    # norm input and output (attention)
                + t * (q + 2 * kv)           # q, k, v projections
                + t * (q + kv)               # rotated q, k
                + t * q                      # attention output (input of wo)
                + 2 * t * h                  # norm input and output (MLP)
                + attention)
        kept += 3 * t * f / tp if self.mlp == "swiglu" else 2 * t * f / tp
        return kept * e

    def with_(self, **changes) -> "ModelSpec":
        return replace(self, **changes)

    def describe(self) -> str:
        return (f"{self.name}: {self.layers} layers, hidden {self.hidden}, ffn {self.ffn}, {self.heads} heads "
                f"({self.kv_heads} kv), vocab {self.vocab}, seq {self.seq_len}, {self.dtype}, "
                f"{self.parameters() / 1e9:.2f} B parameters")


def from_llama_config(config, seq_len: int = 32, name: str = "llama", dtype: str = "float32") -> ModelSpec:
    """The ModelSpec of an hspmd.models.llama.LlamaConfig (GQA, head_dim and tying where it has them)."""
    return ModelSpec(name, config.layers, config.hidden, config.ffn, config.heads,
                     getattr(config, "kv_heads", None) or config.heads, config.vocab, seq_len, dtype,
                     bool(getattr(config, "tie_embeddings", getattr(config, "tied", False))), "swiglu",
                     getattr(config, "head_dim", None))


MODELS = {
    "llama-32b-hetu": ModelSpec("llama-32b-hetu", 60, 6656, 17920, 52, 52, 30592, 4096),
    "llama-30b": ModelSpec("llama-30b", 60, 6656, 17920, 52, 52, 32000, 2048),
    "gpt-13b": ModelSpec("gpt-13b", 40, 5120, 20480, 40, 40, 50257, 2048, mlp="gelu", tied=True),
    "h2-100b": ModelSpec("h2-100b", 96, 8192, 36864, 64, 8, 92544, 4096),
    "llama-tiny": ModelSpec("llama-tiny", 4, 64, 128, 4, 4, 64, 32, "float32"),
}


def from_hf_directory(directory, seq_len: int = 4096, dtype: str = "bfloat16") -> ModelSpec:
    """The ModelSpec of a local Hugging Face Llama directory, read from the same config.json that
    hspmd.models.hf_llama imports (GQA, head_dim and tying included)."""
    config = read_hf_config(directory)
    return from_llama_config(config, seq_len, os.path.basename(os.path.normpath(os.fspath(directory))), dtype)


def model_named(name: "str | os.PathLike | ModelSpec") -> ModelSpec:
    """A preset by name, or the model of a Hugging Face directory (one holding a config.json)."""
    if isinstance(name, ModelSpec):
        return name
    if os.path.isfile(os.path.join(os.fspath(name), "config.json")):
        return from_hf_directory(name)
    key = str(name).strip().lower()
    if key not in MODELS:
        raise ClusterError(f"unknown model {name!r}: use one of {', '.join(MODELS)} "
                           f"or a Hugging Face model directory (with a config.json)")
    return MODELS[key]


__all__ = ["KERNEL_CLASSES", "Kernel", "MODELS", "ModelSpec", "from_hf_directory", "from_llama_config", "model_named"]
