"""Graph IR and DSL: building, symbolic shapes, annotations per strategy, errors at build time."""

import pytest
import torch

import hspmd.ops as O
from hspmd.errors import AnnotationError, DeductionError, HSPMDError, ShapeError
from hspmd.ir import Binding, comm, parameter, placeholder, symbols
from hspmd.ops import Graph
from hspmd.specialize.deduce import deduce


def test_build_and_print_a_graph_with_symbolic_shapes():
    g = Graph("mlp")
    B, S = symbols("B S")
    x = placeholder(g, "x", (B, S, 8), annotation="S0:2@[0,1]")
    w = parameter(g, "w", (8, 4), annotation="D:2@[0,1]")
    y = x @ w
    z = (y * 2.0 + 1.0).sum(2)
    assert y.shape == (B, S, 4) and z.shape == (B, S)
    text = str(g)
    assert "x = placeholder()" in text and "matmul(x, w)" in text and "ann=S0:2@[0,1]" in text


def test_symbol_mismatch_is_rejected_when_the_graph_is_built():
    g = Graph()
    B, S = symbols("B S")
    a = placeholder(g, "a", (B, 4))
    b = placeholder(g, "b", (S, 4))
    with pytest.raises(ShapeError, match="do not broadcast"):
        a + b
    w = parameter(g, "w", (5, 3))
    with pytest.raises(ShapeError, match="contracted dims"):
        a @ w
    with pytest.raises(ShapeError, match="cannot view"):
        O.reshape(a, (B, 5))


def test_reshape_accepts_symbolic_merges_and_minus_one():
    g = Graph()
    B, S = symbols("B S")
    x = placeholder(g, "x", (B, S, 8))
    y = O.reshape(x, (-1, 8))
    assert y.shape[1] == 8 and str(y.shape[0]) == "B*S"
    assert O.reshape(y, (B, S, 2, 4)).shape == (B, S, 2, 4)


def test_strategies_are_explicit_and_can_be_added_later():
    g = Graph()
    x = placeholder(g, "x", (4, 8), annotation="S0:2@[0,1]")
    w = parameter(g, "w", (8, 8), annotation="D:2@[0,1]")
    y = comm(x @ w, "D:2@[0,1]", name="gather")
    first = deduce(g, 0)
    assert str(first[y]) == "D:2@[0,1]"
    index = g.add_strategy({"x": "@[0]", "w": "@[0]", "gather": "@[0]"})
    assert index == 1 and g.num_strategies == 2
    second = deduce(g, 1)
    assert str(second[g.node("matmul").output]) == "@[0]"
    assert str(deduce(g, 0).of("matmul")) == "S0:2@[0,1]"  # strategy 0 untouched
    with pytest.raises(AnnotationError, match="needs an annotation for strategy 2"):
        g.add_strategy({"x": "@[0]"})
    with pytest.raises(DeductionError, match="no strategy 5"):
        deduce(g, 5)


def test_annotation_count_must_match_the_strategies():
    g = Graph()
    placeholder(g, "x", (4,), annotation=["@[0]", "@[1]"])
    with pytest.raises(AnnotationError, match="one per strategy"):
        placeholder(g, "y", (4,), annotation="@[0]")


def test_missing_annotation_names_the_leaf():
    g = Graph()
    placeholder(g, "x", (4,), annotation="@[0]")
    placeholder(g, "y", (4,))
    with pytest.raises(DeductionError, match="placeholder y has no annotation for strategy 0"):
        deduce(g, 0)


def test_duplicate_node_names_are_an_error_and_scopes_prefix_names():
    g = Graph()
    placeholder(g, "x", (4,))
    with pytest.raises(HSPMDError, match="already has a node named 'x'"):
        placeholder(g, "x", (4,))
    with g.scope("block"):
        p = parameter(g, "block.w", (4,))
        y = O.relu(p)
    assert y.node.name == "block.relu"


def test_binding_evaluates_symbolic_dims_and_names_missing_symbols():
    B, S = symbols("B S")
    b = Binding.of({"B": 3, "S": 5})
    assert b.shape((B, S * 2, 4)) == (3, 10, 4)
    with pytest.raises(ShapeError, match=r"symbol\(s\) \['T'\]"):
        Binding.of({"B": 1}).shape((B, symbols("T")[0]))


def test_parameters_need_concrete_shapes():
    g = Graph()
    (B,) = symbols("B")
    with pytest.raises(HSPMDError, match="must be concrete"):
        parameter(g, "w", (B, 4))


def test_inputs_from_another_graph_are_rejected():
    g1, g2 = Graph("a"), Graph("b")
    x = placeholder(g1, "x", (4,))
    y = placeholder(g2, "y", (4,))
    with pytest.raises(HSPMDError, match="input y belongs to graph b, not a"):
        x + y


def test_parameter_initial_values_are_deterministic_per_name():
    from hspmd.ir import initial_value, normal

    g = Graph()
    w = parameter(g, "w", (3, 3), init=normal(1.0))
    v = parameter(g, "v", (3, 3), init=normal(1.0))
    # the same name in another graph, created in another order, starts from the same value
    other = Graph("other")
    parameter(other, "v", (3, 3), init=normal(1.0))
    w_again = parameter(other, "w", (3, 3), init=normal(1.0))
    assert torch.equal(initial_value(w.node), initial_value(w_again.node))
    assert initial_value(w.node).std() > 0.5, "normal(1.0) draws, not zeros"
    assert not torch.equal(initial_value(w.node), initial_value(v.node))
    assert not torch.equal(initial_value(w.node, seed=1), initial_value(w.node))


def test_tensor_operator_methods_come_from_the_graph_not_from_global_state():
    """hspmd.ops is imported (it once filled a global table at import); a plain IR graph still has
    no operator methods, a graph given a table uses exactly that table, hspmd.Graph the standard one."""
    from hspmd.ir.graph import Graph as IRGraph

    plain = IRGraph("plain")
    x = placeholder(plain, "x", (2, 3))
    with pytest.raises(HSPMDError, match="graph plain was built without tensor operators"):
        x + x
    assert O.add(x, x).node.kind == "add"  # the op itself needs no table
    own = IRGraph("own", operators={"add": lambda a, b: ("added", a.name, b)})
    y = placeholder(own, "y", (2, 3))
    assert y + 1 == ("added", "y", 1)
    std = Graph("std")
    z = placeholder(std, "z", (2, 3))
    assert (z @ placeholder(std, "w", (3, 4))).node.kind == "matmul" and std.operators is O.TENSOR_OPERATORS
