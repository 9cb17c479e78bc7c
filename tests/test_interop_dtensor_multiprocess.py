"""The DTensor bridge on 4 gloo processes: DTensors made and redistributed by torch over real process
groups (meshes in transposed rank order, shard orders, uneven and partial layouts); from_dtensor then
to_dtensor (global shape read off each rank's piece) gives back each rank's local tensor, and the
hspmd plan between the bridged layouts lands where DTensor's redistribute lands, rank by rank."""

from __future__ import annotations

from math import prod

import pytest
import torch

from hspmd.runtime.processes.multiprocess import run_multiprocess

WORLD = 4
# Meshes whose ranks ascend along every mesh dim: torch 2.13's DeviceMesh makes each dim's process groups
# with new_group, which numbers a group's ranks in ascending order, so DTensor's redistribute on a mesh
# such as [[3, 1], [0, 2]] gathers pieces out of coordinate order (its own full_tensor() is then wrong).
CASES = [  # mesh shape, ranks row-major, placements, shard order, redistribute target, shape
    ((2, 2), (0, 2, 1, 3), ("S0", "S1"), None, ("R", "S0"), (6, 4)),
    ((2, 2), (0, 2, 1, 3), ("S0", "S0"), (1, 0), ("S1", "R"), (8, 3)),
    ((4,), (0, 1, 2, 3), ("S0",), None, ("R",), (7,)),
    ((2, 2), (0, 2, 1, 3), ("P", "S1"), None, ("S0", "S1"), (4, 6)),
    ((2, 2), (0, 1, 2, 3), ("S0", "R"), None, ("S1", "S0"), (5, 2)),
]


def _placements(names, order, mesh):
    from torch.distributed.tensor import Partial, Replicate, Shard
    from torch.distributed.tensor._dtensor_spec import DTensorSpec, ShardOrderEntry
    placements = tuple(Shard(int(n[1:])) if n[0] == "S" else Replicate() if n == "R" else Partial() for n in names)
    if order is None:
        return placements
    dim = int(names[order[0]][1:])
    return DTensorSpec._convert_shard_order_to_StridedShard((ShardOrderEntry(tensor_dim=dim, mesh_dims=order),), placements, mesh)


def rank_program(backend, cases):
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import DTensor, Partial, Replicate, distribute_tensor

    from hspmd import resolve
    from hspmd.backends.plan_executor import execute_plan
    from hspmd.interop import annotation_for, from_dtensor, to_dtensor
    out = []
    for mesh_shape, ranks, names, order, target, shape in cases:
        mesh = DeviceMesh("cpu", torch.tensor(ranks).reshape(mesh_shape))
        placements = _placements(names, order, mesh)
        x = torch.arange(prod(shape), dtype=torch.float32).reshape(shape)
        plain = tuple(Replicate() if isinstance(p, Partial) else p for p in placements)
        local = distribute_tensor(x, mesh, [Replicate()] * mesh.ndim).redistribute(mesh, plain).to_local()
        if "P" in names:  # summands: the piece on coordinate 0 of the Partial mesh dim, a shift of it elsewhere
            coord = mesh.get_coordinate()[names.index("P")]
            local = (local if coord == 0 else torch.zeros_like(local)) + (1.0 if coord else -1.0)
        stride = torch.empty(shape, device="meta").stride()
        dtensor = DTensor.from_local(local, mesh, placements, run_check=False, shape=torch.Size(shape), stride=stride)
        annotation, mine = from_dtensor(dtensor)
        back = to_dtensor(mine, annotation, mesh)  # the global shape read off this rank's piece
        target_placements = _placements(target, None, mesh)
        landed = dtensor.redistribute(mesh, target_placements).to_local()
        plan = resolve(annotation, annotation_for(mesh, target_placements, shape), shape)
        backend.prepare_groups(plan.collective_groups())
        moved = execute_plan(plan, backend, mine)
        out.append((str(annotation), tuple(back.shape), back.placements == dtensor.placements,
                    torch.equal(back.to_local(), local), moved, landed))
    return out


@pytest.mark.multiprocess
def test_bridge_and_plans_match_dtensor_on_gloo_processes():
    results = run_multiprocess(rank_program, WORLD, CASES, timeout=180)
    for i, (_, _, _, _, _, shape) in enumerate(CASES):
        texts = {results[r][i][0] for r in range(WORLD)}
        assert len(texts) == 1, texts  # every rank states the same annotation
        for rank in range(WORLD):
            text, back_shape, same_placements, same_local, moved, landed = results[rank][i]
            assert back_shape == shape and same_placements and same_local, (i, rank, text)
            assert torch.equal(moved, landed), (i, rank, text, moved, landed)
    assert results[0][2][0] == "H0(2:2:2:1){@[0] | @[1] | @[2] | @[3]}"  # torch.chunk's 2,2,2,1 stated exactly
