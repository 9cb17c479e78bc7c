"""torch Distributed Checkpoint in and out on 4 gloo processes: a Llama sharded by torch as DTensors
(TP over one mesh dim, DP / FSDP over the other, one weight FSDP2+TP-style with _StridedShard) is
saved by torch.distributed.checkpoint under Hugging Face names; hspmd loads it under a heterogeneous
strategy (each rank reading only the chunks its boxes meet), trains 2 steps, saves it as DCP; torch
loads that into a plain transformers model and into DTensors, and hspmd under another strategy, and
the weights equal hspmd's. A
flipped byte in a data file is named by the tensor, chunk and file it damages."""

from __future__ import annotations

import glob
import os

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
transformers = pytest.importorskip("transformers")

from hspmd.errors import CheckpointError  # noqa: E402
from hspmd.runtime.persistence.dcp_checkpoint import DCPCheckpoint  # noqa: E402
from hspmd.runtime.processes.multiprocess import run_multiprocess  # noqa: E402

from test_hf_llama import S, make_hf_model  # noqa: E402

pytestmark = [pytest.mark.multiprocess, pytest.mark.filterwarnings("ignore:torch.distributed is disabled")]

HETERO = "layers=2 ; 2x2: R0,1 L0-1 ; 2x1: R2 L0 | R3 L1"
DP_PP = "layers=2 ; 3x1: R0 L0 | R1 L1 ; 3x1: R2 L0 | R3 L1"
ROWS = 6


def _torch_placements(hf_name: str):
    """(dp, tp) placements of a torch TP + DP layout: projections column- or row-wise over tp; the
    embedding FSDP-sharded over dp; q_proj FSDP2 + TP (dim 0 over tp first, then dp); norms replicated."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.placement_types import _StridedShard
    if hf_name.endswith("q_proj.weight"):
        return [_StridedShard(0, split_factor=2), Shard(0)]
    if hf_name.endswith(("k_proj.weight", "v_proj.weight", "gate_proj.weight", "up_proj.weight")):
        return [Replicate(), Shard(0)]
    if hf_name.endswith(("o_proj.weight", "down_proj.weight")):
        return [Replicate(), Shard(1)]
    if hf_name.endswith("embed_tokens.weight"):
        return [Shard(0), Replicate()]
    return [Replicate(), Replicate()]


def rank_main(backend, hf_dir: str, torch_dir: str, hspmd_dir: str, z: torch.Tensor):
    import torch.distributed.checkpoint as dcp
    from safetensors.torch import load_file
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from hspmd.models.hf_llama import hf_names, read_hf_config
    from hspmd.models.llama import build_llama
    from hspmd.ops import AdamW
    from hspmd.runtime.execution.batches import MicroBatchLayout
    from hspmd.runtime.training.trainer import Trainer
    from hspmd.specialize.strategy_text import parse_strategy

    torch.set_num_threads(1)
    mesh = DeviceMesh("cpu", torch.arange(4).reshape(2, 2))  # (dp, tp)
    weights = {}
    for path in sorted(glob.glob(os.path.join(hf_dir, "*.safetensors"))):
        weights.update(load_file(path))
    # torch saves its DTensor state dict (each rank's shards; no communication to make them)
    state = {name: distribute_tensor(value, mesh, _torch_placements(name), src_data_rank=None) for name, value in weights.items()}
    dcp.save(state, checkpoint_id=torch_dir)

    config = read_hf_config(hf_dir)
    names = {n: (hf.name, hf.transposed) for n, hf in hf_names(config).items()}
    strategy = parse_strategy(HETERO)
    model = build_llama(config, [strategy], optimizer=AdamW(lr=1e-2))
    trainer = Trainer(model.graph, 0, backend, MicroBatchLayout.of(strategy), symbols={"S": S, "T": ROWS * S})
    reader = DCPCheckpoint(torch_dir, names)
    assert trainer.load_checkpoint(reader) == 0
    loaded = trainer.state_dict()  # whole, on rank 0 (collective)
    for _ in range(2):
        trainer.step({"tokens": z[:, :S], "labels": z[:, 1:]})
    trainer.save_dcp(hspmd_dir, names)
    trained = trainer.state_dict()
    # hspmd reads its own DCP save back by path under another strategy (DP2 x PP2), step and optimizer states included
    other = parse_strategy(DP_PP)
    again = Trainer(build_llama(config, [other], optimizer=AdamW(lr=1e-2)).graph, 0, backend, MicroBatchLayout.of(other),
                    symbols={"S": S, "T": ROWS * S})
    assert again.load_checkpoint(hspmd_dir) == 2
    reloaded = again.state_dict()

    # torch loads hspmd's checkpoint into DTensors of its own TP + DP layout
    shard = {name: distribute_tensor(torch.zeros_like(value), mesh, [Shard(0), Shard(value.dim() - 1)], src_data_rank=None)
             for name, value in weights.items() if name in {hf.name for hf in hf_names(config).values()}}
    dcp.load(shard, checkpoint_id=hspmd_dir)
    as_dtensors = {name: value.full_tensor() for name, value in shard.items()}
    return loaded, trained, as_dtensors, sorted({name for name, _ in reader.chunks_read}), reloaded


def test_torch_dcp_into_heterogeneous_hspmd_training_and_back(tmp_path):
    import torch.distributed.checkpoint as dcp

    from hspmd.models.hf_llama import hf_names, read_hf_config

    hf_dir, torch_dir, hspmd_dir = tmp_path / "hf", tmp_path / "torch-dcp", tmp_path / "hspmd-dcp"
    hf = make_hf_model(hf_dir, num_key_value_heads=2, head_dim=8, tie_word_embeddings=False)
    z = torch.randint(0, 64, (ROWS, S + 1), generator=torch.Generator().manual_seed(7))
    results = run_multiprocess(rank_main, 4, str(hf_dir), str(torch_dir), str(hspmd_dir), z, timeout=300)
    loaded, trained, _, _, reloaded = results[0]
    read = {rank: results[rank][3] for rank in range(4)}  # each rank read only the chunks its boxes meet
    assert read[2] and not [n for n in read[2] if n.startswith("model.layers.1.")], read[2]  # rank 2 holds layer 0 only
    assert read[3] and not [n for n in read[3] if n.startswith("model.layers.0.")], read[3]
    config = read_hf_config(hf_dir)
    names = hf_names(config)
    original = hf.state_dict()
    assert sorted(reloaded) == sorted(trained) and len(trained) > len(names)  # optimizer states too
    for name, value in trained.items():
        assert torch.equal(reloaded[name], value), name
    for name, where in names.items():  # torch's DTensor save read by hspmd under the heterogeneous strategy
        theirs = original[where.name]
        assert torch.equal(loaded[name], theirs.t() if where.transposed else theirs), name

    # a plain transformers model loads hspmd's DCP save: its weights are hspmd's trained ones
    plain = transformers.LlamaForCausalLM(hf.config).float()
    state = plain.state_dict()
    dcp.load(state, checkpoint_id=str(hspmd_dir), no_dist=True)
    plain.load_state_dict(state)
    changed = 0
    for name, where in names.items():
        ours = trained[name].t() if where.transposed else trained[name]
        assert torch.equal(plain.state_dict()[where.name], ours), name
        for rank in range(4):
            assert torch.equal(results[rank][2][where.name], ours), (rank, name)
        changed += not torch.equal(ours, original[where.name])
    assert changed == len(names)  # training moved every weight
    reader = DCPCheckpoint(hspmd_dir)
    assert reader.step == 2 and reader.stamp["format"] == "hspmd-dcp-1"
    reader.verify()

    # a flipped byte inside a stored chunk's data is named
    name = names["layers.0.wo"].name  # stored transposed, as torch's o_proj
    victim = trained["layers.0.wo"].t().contiguous()
    row = victim[0].numpy().tobytes()
    for path in glob.glob(os.path.join(hspmd_dir, "*.distcp")):
        data = bytearray(open(path, "rb").read())
        at = bytes(data).find(row[:16])
        if at >= 0:
            data[at + 3] ^= 0x10
            open(path, "wb").write(bytes(data))
            break
    else:
        pytest.fail(f"no data file holds the first row of {name}")
    with pytest.raises(CheckpointError, match=rf"tensor {name}'s chunk at offsets .* in .*{os.path.basename(path)} fails its checksum"):
        DCPCheckpoint(hspmd_dir).verify()
