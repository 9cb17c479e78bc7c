"""Hugging Face Llama in and out, checked against transformers itself (a test extra; nothing is
fetched from a hub: tiny random models are created, saved with save_pretrained and read locally).

Labels follow transformers' convention in the comparison: transformers gets input_ids = labels =
z (length S+1) and shifts internally; hspmd gets tokens z[:, :S] and its already-shifted labels
z[:, 1:]. Attention is causal, so the first S positions' logits are the same computation and both
losses are the mean over the same B*S predictions."""

from __future__ import annotations

import json
import os

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # local directories only, never a hub
transformers = pytest.importorskip("transformers")

from hspmd.errors import CheckpointError, HSPMDError  # noqa: E402
from hspmd.ir import Binding  # noqa: E402
from hspmd.models.hf_llama import config_from_hf, hf_names, read_hf_config  # noqa: E402
from hspmd.models.llama import build_llama  # noqa: E402
from hspmd.ops import SGD  # noqa: E402
from hspmd.runtime.persistence.checkpoint import CheckpointReader, cut_leaves, save_checkpoint  # noqa: E402
from hspmd.runtime.persistence.hf_checkpoint import HFCheckpoint, export_checkpoint, export_hf  # noqa: E402
from hspmd.backends.local import run_on_devices  # noqa: E402
from hspmd.runtime.execution.run import DeviceState, run_backward, run_forward, run_update  # noqa: E402
from hspmd.specialize.specialized import specialize_graph  # noqa: E402
from hspmd.specialize.strategy_text import parse_strategy  # noqa: E402

B, S = 3, 8
PAD = 5  # a pad_token_id that the test sequences contain
LLAMA31 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
           "original_max_position_embeddings": 32}
CONFIGS = {
    "gqa_tied_llama3": dict(num_key_value_heads=2, head_dim=12, tie_word_embeddings=True, rope_scaling=LLAMA31),
    "mha_untied": dict(num_key_value_heads=4, tie_word_embeddings=False),
    "gqa_linear": dict(num_key_value_heads=1, tie_word_embeddings=False,
                       rope_scaling={"rope_type": "linear", "factor": 2.0}),
    "mha_untied_pad": dict(num_key_value_heads=4, tie_word_embeddings=False, pad_token_id=PAD),
}


def make_hf_model(directory, seed: int = 0, **options):
    """A random tiny LlamaForCausalLM saved in `directory` (sharded: several safetensors files)."""
    base = dict(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                rms_norm_eps=1e-5, rope_theta=500.0)
    config = transformers.LlamaConfig(**{**base, **options})
    torch.manual_seed(seed)
    model = transformers.LlamaForCausalLM(config).float()
    with torch.no_grad():  # larger than the default init, so logits and gradients are far from trivial
        for p in model.parameters():
            p.normal_(1.0 if p.ndim == 1 else 0.0, 0.2)
    model.save_pretrained(directory, max_shard_size="20KB")
    return model


def sequences(seed: int = 1):
    z = torch.randint(0, 64, (B, S + 1), generator=torch.Generator().manual_seed(seed))
    z[:, 2] = PAD
    return z


def hf_reference(model, z):
    """transformers' logits of the first S positions, its loss and its gradients (by HF name)."""
    model.zero_grad()
    out = model(input_ids=z, labels=z)
    out.loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
    if model.config.tie_word_embeddings:
        grads.pop("lm_head.weight", None)
    return out.logits[:, :S].detach(), float(out.loss.detach()), grads


def hspmd_one_device(directory, z):
    """hspmd on one device, weights imported from `directory`: logits, loss and gradients."""
    config = read_hf_config(directory)
    model = build_llama(config, [parse_strategy(f"layers={config.layers} ; 1x{B}: R0 L0-{config.layers - 1}")],
                        optimizer=SGD(lr=0.0))
    binding = Binding.of({"B": B, "S": S, "T": B * S}, ratios=(B,))
    fetch = [model.logits] + list(model.graph.gradients.values())
    spec = specialize_graph(model.graph, 0, binding, fetches=fetch)
    exe = spec.executables[0]
    state = DeviceState(cut_leaves(exe, HFCheckpoint(directory)))

    def body(backend):
        mb = run_forward(exe, backend, state, {"tokens": z[:, :S], "labels": z[:, 1:]}, binding, fetch=[model.logits])
        run_backward(exe, backend, state, mb)
        run_update(exe, backend, state)
        return dict(state.fetched)

    fetched = run_on_devices(body, [0])[0]
    grads = {name: fetched[t.name] for name, t in model.graph.gradients.items()}
    return config, fetched[model.logits.name], float(fetched[model.loss.name]), grads


@pytest.mark.parametrize("case", sorted(CONFIGS))
def test_imported_model_equals_transformers_on_one_device(tmp_path, case):
    hf = make_hf_model(tmp_path, **CONFIGS[case])
    assert len([f for f in os.listdir(tmp_path) if f.endswith(".safetensors")]) > 1  # shards are read
    z = sequences()
    ref_logits, ref_loss, ref_grads = hf_reference(hf, z)
    config, logits, loss, grads = hspmd_one_device(tmp_path, z)
    torch.testing.assert_close(logits, ref_logits, rtol=1e-4, atol=1e-4)
    assert loss == pytest.approx(ref_loss, rel=1e-5)
    names = hf_names(config)
    assert {names[n].name for n in grads} == set(ref_grads)
    for name, g in grads.items():
        where = names[name]
        ours = g.t() if where.transposed else g
        ref = ref_grads[where.name]
        torch.testing.assert_close(ours, ref, rtol=1e-4, atol=1e-5 * float(ref.abs().max()), msg=name)
        assert float(ref.abs().max()) > 0
    if config.pad_token is not None and not config.tie_embeddings:  # as nn.Embedding(padding_idx=): no gradient
        assert not grads["embed"][config.pad_token].any() and grads["embed"][PAD + 1:].abs().sum() > 0


def test_pad_row_gets_no_gradient_from_a_vocabulary_split_lookup():
    """TP 2 splits the embedding table by vocabulary rows: the pad row lies in one piece."""
    from hspmd.models.llama import LlamaConfig
    from hspmd.runtime.training.inprocess import InProcessJob

    z = sequences()
    for pad in (PAD, 40):
        config = LlamaConfig(vocab=64, hidden=16, layers=1, heads=2, ffn=32, pad_token=pad)
        z[:, 3] = pad
        strategy = parse_strategy(f"layers=1 ; 1x{B}: R0,1 L0")
        job = InProcessJob(build_llama(config, [strategy], optimizer=SGD(lr=0.0)).graph, 0, strategy,
                           symbols={"S": S, "T": B * S})
        job.step({"tokens": z[:, :S], "labels": z[:, 1:]})
        grad = job.gradients()["embed"]
        assert not grad[pad].any() and grad.abs().sum(1).gt(0).sum() > 10


def test_config_json_maps_every_option(tmp_path):
    make_hf_model(tmp_path, **CONFIGS["gqa_tied_llama3"])
    config = read_hf_config(tmp_path)
    assert (config.heads, config.kv_heads, config.head_dim, config.tie_embeddings) == (4, 2, 12, True)
    assert (config.rope_base, config.eps, config.ffn) == (500.0, 1e-5, 48)
    assert config.rope_scaling.kind == "llama3" and config.rope_scaling.original_max_position == 32


@pytest.mark.parametrize(
    "change, message",
    [
        ({"model_type": "mistral"}, "model_type 'mistral' is not a Llama"),
        ({"attention_bias": True}, "attention_bias is true"),
        ({"hidden_act": "gelu"}, "hidden_act 'gelu'"),
        ({"rope_parameters": {"rope_type": "yarn", "factor": 2.0, "rope_theta": 1.0}}, "rope_type 'yarn'"),
        ({"rope_parameters": {"rope_type": "llama3", "factor": 2.0, "rope_theta": 1.0}}, "has no 'low_freq_factor'"),
        ({"num_key_value_heads": 3}, "kv_heads 3 must be a positive divisor"),
        ({"num_attention_heads": "4"}, "num_attention_heads must be an integer"),
    ],
)
def test_bad_config_json_is_named(tmp_path, change, message):
    make_hf_model(tmp_path, **CONFIGS["mha_untied"])
    cfg = json.loads((tmp_path / "config.json").read_text())
    with pytest.raises(HSPMDError, match=message):
        config_from_hf({**cfg, **change})


def test_missing_or_mismatched_tensors_are_named(tmp_path):
    make_hf_model(tmp_path, **CONFIGS["mha_untied"])
    cfg = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**cfg, "intermediate_size": 40}))
    reader = HFCheckpoint(tmp_path)
    with pytest.raises(HSPMDError, match=r"mlp.up_proj.weight has shape \(48, 32\).*implies \(40, 32\)"):
        reader("layers.0.w_up", ((0, 32), (0, 40)), (32, 40))
    with pytest.raises(HSPMDError, match="neither a Llama parameter"):
        reader("bogus", (), ())
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(HSPMDError, match="no config.json"):
        HFCheckpoint(empty)


def test_bf16_file_loads_into_fp32_master_weights_and_states_start_fresh(tmp_path):
    hf = make_hf_model(tmp_path / "f32", **CONFIGS["gqa_tied_llama3"])
    hf.to(torch.bfloat16).save_pretrained(tmp_path / "bf16")
    reader = HFCheckpoint(tmp_path / "bf16")
    piece = reader("layers.1.wk", ((0, 32), (12, 24)), (32, 24))
    assert piece.dtype == torch.float32
    whole = hf.model.layers[1].self_attn.k_proj.weight.detach().t()
    torch.testing.assert_close(piece, whole[:, 12:24].float())
    state = reader("layers.1.wk.exp_avg", ((0, 32), (12, 24)), (32, 24))
    assert state.shape == (32, 12) and not state.any()


def test_export_round_trips_exactly_and_transformers_agrees(tmp_path):
    hf = make_hf_model(tmp_path / "in", **CONFIGS["gqa_tied_llama3"])
    config = read_hf_config(tmp_path / "in")
    reader = HFCheckpoint(tmp_path / "in")
    whole = {name: reader(name, (), shape) for name, shape in config.parameter_shapes().items()}
    save_checkpoint(tmp_path / "ckpt" / "model.safetensors", whole, step=5)
    (tmp_path / "ckpt" / "config.json").write_text((tmp_path / "in" / "config.json").read_text())
    export_checkpoint(tmp_path / "ckpt" / "model.safetensors", tmp_path / "out")
    again = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "out")
    theirs, ours = hf.state_dict(), again.state_dict()
    assert set(theirs) == set(ours)
    for name in theirs:
        assert torch.equal(theirs[name], ours[name]), name
    z = sequences()
    torch.testing.assert_close(again(input_ids=z).logits, hf(input_ids=z).logits, rtol=0, atol=0)
    back = HFCheckpoint(tmp_path / "out")
    for name, shape in config.parameter_shapes().items():
        assert torch.equal(back(name, (), shape), whole[name]), name
    with pytest.raises(HSPMDError, match="no config.json beside"):
        export_checkpoint(tmp_path / "ckpt" / "model.safetensors", tmp_path / "x", config=tmp_path / "in" / "nowhere")
    assert CheckpointReader(tmp_path / "ckpt" / "model.safetensors").step == 5
    export_hf(whole, config, tmp_path / "direct")
    assert json.loads((tmp_path / "direct" / "config.json").read_text())["tie_word_embeddings"] is True


def test_export_keeps_every_field_of_the_original_config(tmp_path):
    """Token ids, context length and settings hspmd has no use for come back as they were."""
    original_fields = dict(bos_token_id=60, eos_token_id=[61, 62], pad_token_id=PAD, max_position_embeddings=131072,
                           initializer_range=0.01, pretraining_tp=1)
    make_hf_model(tmp_path / "in", **CONFIGS["gqa_tied_llama3"], **original_fields)
    original = json.loads((tmp_path / "in" / "config.json").read_text())
    config = read_hf_config(tmp_path / "in")
    assert config.pad_token == PAD
    reader = HFCheckpoint(tmp_path / "in")
    whole = {name: reader(name, (), shape) for name, shape in config.parameter_shapes().items()}
    save_checkpoint(tmp_path / "ckpt" / "model.safetensors", whole, step=1)
    (tmp_path / "ckpt" / "config.json").write_text(json.dumps(original))
    export_checkpoint(tmp_path / "ckpt" / "model.safetensors", tmp_path / "out")
    exported = json.loads((tmp_path / "out" / "config.json").read_text())
    assert {k: exported.get(k) for k in original} == original
    again = transformers.AutoConfig.from_pretrained(tmp_path / "out")
    assert (again.eos_token_id, again.bos_token_id, again.pad_token_id) == ([61, 62], 60, PAD)
    assert again.max_position_embeddings == 131072


def test_the_cost_models_model_spec_reads_the_same_config_json(tmp_path):
    from hspmd.planning.model import from_llama_config, model_named

    make_hf_model(tmp_path / "tiny", **CONFIGS["gqa_tied_llama3"])
    spec = model_named(tmp_path / "tiny")
    assert (spec.name, spec.kv_heads, spec.head_dim, spec.tied) == ("tiny", 2, 12, True)
    assert spec.parameters() == from_llama_config(read_hf_config(tmp_path / "tiny")).parameters()
    hf = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "tiny")
    assert spec.parameters() == sum(p.numel() for p in hf.parameters())


@pytest.mark.parametrize("index_text", ["{not json", "[1, 2]", '{"weight_map": [1]}', "\udcff"])
def test_a_malformed_index_json_is_a_checkpoint_error_naming_it(tmp_path, index_text):
    make_hf_model(tmp_path, **CONFIGS["mha_untied"])
    index = tmp_path / "model.safetensors.index.json"
    index.write_bytes(index_text.encode("utf-8", "surrogateescape"))
    with pytest.raises(CheckpointError, match="model.safetensors.index.json"):
        HFCheckpoint(tmp_path)


@pytest.mark.parametrize("garbage", [b"", b"\x00" * 5, b"x" * 64, (10**6).to_bytes(8, "little") + b"{}"])
def test_a_garbage_weights_file_is_a_checkpoint_error_naming_it(tmp_path, garbage):
    model = make_hf_model(tmp_path / "in", **CONFIGS["mha_untied"])
    model.save_pretrained(tmp_path / "one")  # a single model.safetensors, no index
    (tmp_path / "one" / "model.safetensors").write_bytes(garbage)
    with pytest.raises(CheckpointError, match=r"one/model\.safetensors cannot be read"):
        HFCheckpoint(tmp_path / "one")


def test_export_of_a_sharded_checkpoint_says_to_consolidate_first(tmp_path, capsys):
    from hspmd.cli import main as cli_main

    folder = tmp_path / "sh"
    folder.mkdir()
    (folder / "latest").write_text("step-00000003")
    with pytest.raises(CheckpointError, match="sharded checkpoint directory.*hspmd checkpoint consolidate"):
        export_checkpoint(folder, tmp_path / "out")
    assert cli_main(["checkpoint", "export-hf", str(folder), str(tmp_path / "out")]) == 2
    assert "consolidate" in capsys.readouterr().err
