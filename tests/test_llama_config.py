"""LlamaConfig: the shapes its options give, and clear errors for options that cannot work."""

import pytest

from hspmd.errors import HSPMDError
from hspmd.models.llama import LlamaConfig, RopeScaling


def test_gqa_head_dim_and_tied_embeddings_shape_the_parameters():
    shapes = LlamaConfig(hidden=32, heads=4, kv_heads=2, head_dim=12, tie_embeddings=True, layers=1).parameter_shapes()
    assert shapes["layers.0.wq"] == (32, 48) and shapes["layers.0.wo"] == (48, 32)
    assert shapes["layers.0.wk"] == shapes["layers.0.wv"] == (32, 24)
    assert "lm_head" not in shapes
    assert LlamaConfig(hidden=32, heads=4).head_dim == 8


@pytest.mark.parametrize(
    "options, message",
    [
        (dict(heads=4, kv_heads=3), "kv_heads 3 must be a positive divisor of heads 4"),
        (dict(hidden=30, heads=4), "give head_dim explicitly"),
        (dict(head_dim=7), "head_dim must be a positive even integer"),
        (dict(layers=0), "layers must be a positive integer"),
        (dict(rope_scaling={"rope_type": "llama3"}), "rope_scaling must be a RopeScaling"),
    ],
)
def test_bad_options_are_named(options, message):
    with pytest.raises(HSPMDError, match=message):
        LlamaConfig(**options)


def test_bad_rope_scaling_is_named():
    with pytest.raises(HSPMDError, match="'yarn' is not supported"):
        RopeScaling("yarn", 2.0)
    with pytest.raises(HSPMDError, match="high_freq_factor > low_freq_factor"):
        RopeScaling("llama3", 8.0, 4.0, 1.0)
