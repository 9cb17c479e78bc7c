"""Simulator level 2 (specialize()'s per-device programs, op by op, with resolved plans) against
level 1 (stage times from ModelSpec) on the tiny Llama."""

import math

import pytest

from hspmd.cluster import parse_cluster
from hspmd.cluster.emulation import WAIT_CHUNK_S
from hspmd.ir.shapes import Binding
from hspmd.models.llama import LlamaConfig, build_llama
from hspmd.planning import CostModel, Efficiency, from_llama_config
from hspmd.planning.device_sim import device_cost, plan_device_run, simulate_specialized
from hspmd.planning.strategy_sim import simulate_strategy
from hspmd.runtime.execution.batches import MicroBatchLayout
from hspmd.specialize.specialized import specialize_graph
from hspmd.specialize.strategy_text import parse_strategy

TINY = dict(vocab=64, hidden=64, heads=4, ffn=128)
SEQ = 32


def specialized(text):
    strategy = parse_strategy(text)
    config = LlamaConfig(layers=strategy.num_layers, **TINY)
    layout = MicroBatchLayout.of(strategy)
    binding = Binding.of({"B": sum(layout.sizes), "S": SEQ, "T": layout.global_batch_size * SEQ}, ratios=layout.sizes)
    spec = specialize_graph(build_llama(config, [strategy]).graph, 0, binding)
    return strategy, config, layout, spec


@pytest.mark.parametrize("delta", [0.0, 1e-5])
@pytest.mark.parametrize("text", ["layers=4 ; 4x2: R0 L0-1 | R1 L2-3",
                                  "layers=4 ; 2x2: R0 L0-3 ; 2x2: R1 L0-3",
                                  "layers=4 ; 4x1: R0,1 L0-3"])
def test_level1_and_level2_agree_within_5_percent_with_communication_zeroed(text, delta):
    strategy, config, layout, spec = specialized(text)
    eff = Efficiency(gamma={"gemm": 1.5, "elementwise": 1.2}, delta={k: delta for k in ("gemm", "attn", "elementwise", "norm", "misc")})
    cost = CostModel(parse_cluster("h800-h20:1+0"), from_llama_config(config, SEQ), {"*": eff})
    level2 = simulate_specialized(spec, cost, dict(enumerate(layout.counts)), comm=False)
    level1 = simulate_strategy(strategy, cost, comm=False)
    assert level2.iteration == pytest.approx(level1.iteration, rel=0.05)
    assert set(level1.per_rank) == set(level2.per_rank)


def test_level2_prices_communication_from_the_resolved_plans():
    strategy, config, layout, spec = specialized("layers=4 ; 4x1: R0,1 L0-3")
    cost = CostModel(parse_cluster("2x1"), from_llama_config(config, SEQ))
    with_comm = device_cost(spec.executables[0], cost, spec.binding)
    without = device_cost(spec.executables[0], cost, spec.binding, comm=False)
    link = cost.cluster.link(0, 1)
    # TP2 on one slow link: every per-layer all-reduce costs at least 2 latencies (ring of 2)
    assert with_comm.forward_comm >= 4 * 2 * 2 * link.latency and without.forward_comm == 0
    assert with_comm.forward == pytest.approx(without.forward + with_comm.forward_comm)
    pp = specialized("layers=4 ; 4x2: R0 L0-1 | R1 L2-3")[3]
    pipes, _, costs = plan_device_run(pp, cost, 4)
    nbytes = 2 * SEQ * config.hidden * 4  # one micro-batch's activation, float32
    assert pipes[0].links[0].forward == pytest.approx(link.latency + nbytes / link.bandwidth)
    assert costs[1].send_backward == pytest.approx(link.latency + nbytes / link.bandwidth)
    result = simulate_specialized(pp, cost, 4)
    assert result.iteration > 4 * (pipes[0].stages[0].forward + pipes[0].stages[0].backward)


def test_an_emulated_devices_sleeps_are_priced_by_their_length():
    """A stretch of w device seconds on a type of cpu_scale s leaves w (1 - 1/s) to sleep: in
    chunks of WAIT_CHUNK_S and, when a communication ends it, the rest; each sleep's wake-up is
    the op costs' at its length (x s). Work no communication ends is carried into later chunks."""
    from dataclasses import replace

    from hspmd.planning import OpCosts

    _, config, _, _ = specialized("layers=4 ; 4x1: R0,1 L0-3")
    base = CostModel(parse_cluster("2x1"), from_llama_config(config, SEQ))
    ops = OpCosts({}, {}, wake_ups=((0.01, 1e-4), (0.1, 3e-4)))
    cost = replace(base, op_costs=ops, efficiency={"*": Efficiency(cpu_scale=5.0)})
    assert cost.sleep_after(0, 1.0) == pytest.approx(0.8)
    assert cost.wake_up(0, 0.05) == pytest.approx((1e-4 + 2e-4 * math.log(5) / math.log(10)) * 5)
    assert cost.wake_up(0, 10.0) == cost.wake_up(0, WAIT_CHUNK_S) == pytest.approx(3e-4 * 5)  # a sleep is a chunk at most
    # 0.5 s of work: 0.4 s to sleep, and a chunk's wake-up (1.5 ms of work) adds 1.2 ms to it per
    # chunk: one chunk and ~0.15 s before the communication, whose wake-up is the next stretch's;
    # carried on, ~1.6 chunks
    debt = 0.4 / (1 - 3e-4 * 5 * 0.8 / WAIT_CHUNK_S)
    assert cost.wake_ups_over(0, 0.5) == pytest.approx((2 * 3e-4 * 5, 3e-4 * 5))
    assert cost.wake_ups_over(0, 0.5, communicates=False).total == pytest.approx(debt / WAIT_CHUNK_S * 3e-4 * 5)
    short = cost.wake_ups_over(0, 0.05)  # 0.04 s asleep: one wake-up, log-linear between the points
    assert short.total == short.last == pytest.approx((1e-4 + 2e-4 * math.log(4) / math.log(10)) * 5)
    assert cost.wake_ups_over(0, 0.0) == (0.0, 0.0)
    plain = replace(cost, efficiency={"*": Efficiency(cpu_scale=1.0)})  # a type that does not sleep
    assert plain.sleep_after(0, 1.0) == plain.wake_up(0, 0.05) == plain.wake_ups_over(0, 0.5).total == 0.0


def test_level2_prices_the_op_kinds_its_op_costs_list_and_the_rest_as_before():
    """OpCosts: a transpose at its fixed time (x the type's cpu_scale) in place of one overhead,
    an add at its fixed time + its gamma x roofline, the work before each pass; on a type that
    sleeps (cpu_scale > 1) a wake-up per communication too, and the work no communication ends
    is slept in chunks. Kinds it does not list, communication and level 1 are priced as without
    it; level 2's per-step work is its own."""
    from dataclasses import replace

    from hspmd.planning import OpCosts
    from hspmd.planning.device_sim import op_kernel

    strategy, config, layout, spec = specialized("layers=4 ; 4x1: R0,1 L0-3")
    exe = spec.executables[0]
    base = CostModel(parse_cluster("2x1"), from_llama_config(config, SEQ), overhead=10e-6, step_overhead=5e-3)
    ops = OpCosts({"transpose": 1e-3, "add": 2e-4}, {"transpose": 0.0, "add": 3.0}, per_step=2e-3, per_pass=1e-4,
                  wake_ups=((1e-9, 5e-5),))  # 5e-5 of CPU after any sleep (x cpu_scale 3)
    priced = replace(base, op_costs=ops)
    scaled = replace(priced, efficiency={"*": Efficiency(cpu_scale=3.0)})
    unwoken = replace(base, op_costs=replace(ops, wake_ups=()), efficiency={"*": Efficiency(cpu_scale=3.0)})
    forward = [ins for ins in exe.forward if ins.role == "compute"]
    transposes = sum(ins.node.kind == "transpose" for ins in forward)
    collectives = sum(ins.role == "collective" for ins in exe.forward)
    adds = [op_kernel(exe, ins, spec.binding) for ins in forward if ins.node.kind == "add"]
    assert transposes > 0 and adds and collectives > 0
    roofline = sum(base.roofline(k, base.device(0)) for k in adds)
    before, after, slower = (device_cost(exe, c, spec.binding) for c in (base, priced, scaled))
    was = transposes * 10e-6 + sum(base.kernel_time(k, 0) + 10e-6 for k in adds)
    fixed = transposes * 1e-3 + len(adds) * 2e-4 + 1e-4
    assert after.forward - before.forward == pytest.approx(fixed + 3.0 * roofline - was)
    # a wake-up per collective (the pass's work comes before the first, and each wake-up is work
    # the next sleep pays off); what follows the last one is carried on, as a fraction of a chunk
    woken = slower.forward - after.forward - 2 * fixed
    assert collectives * 3 * 5e-5 < woken < (collectives + 1) * 3 * 5e-5
    assert slower.forward - device_cost(exe, unwoken, spec.binding).forward == pytest.approx(woken)
    # with no communication the whole forward is one stretch: its debt (work less the host's CPU
    # time, 2/3 of it, and the chunks' own wake-ups) is slept in chunks of WAIT_CHUNK_S
    alone = device_cost(exe, unwoken, spec.binding, comm=False).forward
    debt = alone * (2 / 3) / (1 - 3 * 5e-5 * (2 / 3) / WAIT_CHUNK_S)
    assert device_cost(exe, scaled, spec.binding, comm=False).forward - alone == pytest.approx(
        debt / WAIT_CHUNK_S * 3 * 5e-5)
    assert after.forward_comm == before.forward_comm > 0
    assert simulate_strategy(strategy, priced).iteration == simulate_strategy(strategy, base).iteration
    assert priced.step_work(0, op_priced=True) == 2e-3 and scaled.step_work(0, op_priced=True) == 6e-3
    assert priced.step_work(0) == base.step_work(0) == 5e-3
