"""The graph IR and the DSL that builds single-device-view graphs."""

from hspmd.ir.dsl import comm, gradient_annotation, initial_value, parameter, placeholder, state
from hspmd.ir.graph import Derived, Graph, Node, OpDef, Tensor
from hspmd.ir.init import Initializer, constant, normal, ones, uniform, zeros
from hspmd.ir.shapes import Binding, symbols

__all__ = [
    "Binding", "Derived", "Graph", "Initializer", "Node", "OpDef", "Tensor", "comm", "constant",
    "gradient_annotation", "initial_value", "normal", "ones", "parameter", "placeholder", "state", "symbols",
    "uniform", "zeros",
]
