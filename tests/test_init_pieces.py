"""Initialization without the whole tensor: every piece is made on its own and equals the same box
of the single-device initialization."""

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from hspmd.ir import initial_value, normal, parameter, uniform
from hspmd.ops import Graph
from hspmd.ir.init import box_chunks, constant, make_piece, uniform_bits
from hspmd.models.llama import LlamaConfig, build_llama
from hspmd.ir import Binding
from hspmd.runtime.execution.run import DeviceState
from hspmd.specialize.specialized import specialize_graph
from hspmd.specialize.strategy_text import parse_strategy


@st.composite
def shape_and_box(draw):
    shape = tuple(draw(st.lists(st.integers(1, 7), min_size=0, max_size=4)))
    box = []
    for n in shape:
        a = draw(st.integers(0, n))
        box.append((a, draw(st.integers(a, n))))
    return shape, tuple(box)


@settings(max_examples=300)
@given(shape_and_box(), st.sampled_from([normal(0.5, 1.0), uniform(2.0)]), st.integers(0, 2**31))
def test_a_box_equals_the_same_box_of_the_whole(case, init, seed):
    shape, box = case
    whole = init.make(shape, tuple((0, n) for n in shape), seed)
    piece = init.make(shape, box, seed)
    assert torch.equal(piece, whole[tuple(slice(a, b) for a, b in box)])


@settings(max_examples=300)
@given(shape_and_box(), st.integers(1, 60), st.sampled_from([normal(0.5, 1.0), uniform(2.0), constant(3.0)]),
       st.sampled_from([torch.float32, torch.bfloat16, torch.float64]))
def test_a_piece_made_in_chunks_equals_it_made_at_once(case, chunk, init, dtype):
    shape, box = case
    pieces = list(box_chunks(box, chunk))
    covered = torch.zeros(tuple(b - a for a, b in box), dtype=torch.int64)
    for sub in pieces:  # the chunks tile the box exactly, none over the limit unless one element
        assert all(a <= c <= d <= b for (a, b), (c, d) in zip(box, sub))
        assert torch.Size([d - c for c, d in sub]).numel() <= chunk or all(d - c == 1 for c, d in sub)
        covered[tuple(slice(c - a, d - a) for (a, _), (c, d) in zip(box, sub))] += 1
    assert bool((covered == 1).all())
    made = make_piece(init, shape, box, 11, dtype, chunk=chunk)
    assert made.dtype == dtype and torch.equal(made, init.make(shape, box, 11).to(dtype))


def test_a_piece_of_a_huge_weight_is_made_without_the_whole():
    g = Graph("huge")
    w = parameter(g, "w", (10**6, 10**6), init=normal(1.0))  # 4 TB whole in float32
    piece = initial_value(w.node, seed=3, box=((999_998, 10**6), (5, 9)))
    assert piece.shape == (2, 4) and piece.dtype == torch.float32
    assert torch.equal(piece, initial_value(w.node, seed=3, box=((999_998, 10**6), (5, 9))))
    assert not torch.equal(piece, initial_value(w.node, seed=4, box=((999_998, 10**6), (5, 9))))


def test_the_generator_is_uniform_and_normal_is_normal():
    u = uniform_bits(11, 0, (200_000,), ((0, 200_000),))
    assert 0.0 < float(u.min()) and float(u.max()) < 1.0
    assert abs(float(u.mean()) - 0.5) < 0.005
    counts = torch.histc(u, bins=10, min=0, max=1)
    assert float(counts.min()) > 19_000 and float(counts.max()) < 21_000
    g = Graph("n")
    x = initial_value(parameter(g, "x", (400, 500), init=normal(2.0, 1.0)).node).double()
    assert abs(float(x.mean()) - 1.0) < 0.02 and abs(float(x.std()) - 2.0) < 0.02
    assert abs(float(((x - 1.0) / 2.0).pow(4).mean()) - 3.0) < 0.1  # kurtosis of a normal
    # neighbouring elements and neighbouring streams are uncorrelated
    assert abs(float(torch.corrcoef(torch.stack([u[:-1], u[1:]]))[0, 1])) < 0.01
    v = uniform_bits(11, 1, (200_000,), ((0, 200_000),))
    assert abs(float(torch.corrcoef(torch.stack([u, v]))[0, 1])) < 0.01


def test_every_rank_of_a_heterogeneous_strategy_starts_with_its_box_of_the_single_device_weights():
    strategy = parse_strategy("2x1: R0,1 L0-1 | R2 L2-3 ; 1x2: R3 L0-3")
    model = build_llama(LlamaConfig(layers=strategy.num_layers), [strategy])
    spec = specialize_graph(model.graph, 0, Binding.of({"B": 3, "S": 4, "T": 12 * 4}, ratios=strategy.micro_batch_ratios))
    seen = 0
    for _device, exe in spec.executables.items():
        state = DeviceState.initial(exe, seed=5)
        for node in exe.held_leaves:
            box = exe.box(node.output, exe.binding)
            whole = initial_value(node, seed=5)
            assert torch.equal(state.leaves[node.name], whole[tuple(slice(a, b) for a, b in box)])
            seen += 1
    assert seen > 0
