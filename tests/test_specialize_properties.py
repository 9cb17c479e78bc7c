"""Property test: random elementwise/matmul graphs with random valid leaf annotations either fail
deduction with an HSPMDError or run specialized (with comms to a common layout) to the reference."""

import torch
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

import hspmd.ops as O
from hspmd.annotations import Annotation, DistributedStates, Duplicate, Subgroup, shard, unshard
from hspmd.errors import HSPMDError
from hspmd.ir import Binding, Graph, comm, placeholder
from hspmd.backends.local import run_on_devices
from hspmd.runtime.run import DeviceState, run_forward
from hspmd.specialize.specialized import specialize_graph
from hspmd.testing import annotations

DEVICES = (0, 1, 2, 3)
OPS = {"add": (O.add, torch.add), "sub": (O.sub, torch.sub), "mul": (O.mul, torch.mul)}


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    x_ann=annotations(2, devices=DEVICES, max_hsize=2),
    y_ann=annotations(2, devices=DEVICES, max_hsize=2),
    w_ann=annotations(2, devices=DEVICES, max_hsize=2),
    op=st.sampled_from(sorted(OPS)),
    reshard_y=st.sampled_from([True, True, True, False]),
    replicate_w=st.sampled_from([True, True, True, False]),
    seed=st.integers(0, 2**16),
)
def test_random_graphs_deduce_or_fail_cleanly_and_match_the_reference(x_ann, y_ann, w_ann, op, reshard_y,
                                                                     replicate_w, seed):
    gen = torch.Generator().manual_seed(seed)
    xv, yv, wv = torch.randn(4, 6, generator=gen), torch.randn(4, 6, generator=gen), torch.randn(6, 5, generator=gen)
    g = Graph()
    x = placeholder(g, "x", (4, 6), annotation=x_ann)
    y = placeholder(g, "y", (4, 6), annotation=y_ann)
    w = placeholder(g, "w", (6, 5), annotation=w_ann)
    if reshard_y:
        y = comm(y, x_ann, name="y_like_x")
    if replicate_w:  # w whole on every subgroup of x's union: matmul then only needs x's K dim whole
        whole = Annotation(tuple(Subgroup(s.dg, DistributedStates((Duplicate(len(s.dg)),))) for s in x_ann.subgroups))
        w = comm(w, whole, name="w_on_x")
    out = OPS[op][0](x, y) @ w
    try:
        spec = specialize_graph(g, 0, Binding(), fetches=[out])
    except HSPMDError:
        event("rejected by deduction")
        return
    event("specialized and run")
    out_ann = spec.deduced[out]
    locals_ = {name: shard(v, a, seed=seed) for name, v, a in (("x", xv, x_ann), ("y", yv, y_ann), ("w", wv, w_ann))}

    def body(backend):
        exe = spec.executables[backend.rank]
        feeds = {n: locals_[n][backend.rank] for n in ("x", "y", "w") if backend.rank in locals_[n]}
        mb = run_forward(exe, backend, DeviceState({}), feeds, Binding())
        return mb.env.get(out.id)

    results = run_on_devices(body, spec.devices)
    got = unshard({d: v for d, v in results.items() if d in out_ann.devices}, out_ann, shape=(4, 5))
    torch.testing.assert_close(got, OPS[op][1](xv, yv) @ wv, rtol=1e-4, atol=1e-4)
