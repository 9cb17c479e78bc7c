"""Simulator level 2 (specialize()'s per-device programs, op by op, with resolved plans) against
level 1 (stage times from ModelSpec) on the tiny Llama."""

import math

import pytest

from hspmd.cluster import parse_cluster
from hspmd.cluster.emulation import WAIT_CHUNK_S
from hspmd.ir.shapes import Binding
from hspmd.models.llama import LlamaConfig, build_llama
from hspmd.planning import CostModel, Efficiency, from_llama_config
from hspmd.planning.device_sim import device_cost, plan_device_run, simulate_device_run, simulate_specialized
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


def test_the_work_between_an_emulated_devices_sleeps_is_priced_slower_by_how_much_it_is():
    """A stretch of w device seconds on a type of cpu_scale s is w / s of this host's CPU work and
    leaves w (1 - 1/s) to sleep, a chunk of WAIT_CHUNK_S at most at a time; it runs the op costs'
    fraction for that much host work between sleeps slower."""
    from dataclasses import replace

    from hspmd.planning import OpCosts

    _, config, _, _ = specialized("layers=4 ; 4x1: R0,1 L0-3")
    base = CostModel(parse_cluster("2x1"), from_llama_config(config, SEQ))
    ops = OpCosts({}, {}, after_sleep=((0.001, 0.8), (0.01, 0.3)))
    cost = replace(base, op_costs=ops, efficiency={"*": Efficiency(cpu_scale=5.0)})
    assert cost.sleep_after(0, 1.0) == pytest.approx(0.8)
    # 0.02 device seconds are 4 ms of host work: log-linear between the points
    assert cost.woken_work(0, 0.02) == pytest.approx(0.02 * (0.8 - 0.5 * math.log(4) / math.log(10)))
    # less work than the least measured runs its fraction slower, more than the most the most's
    assert cost.woken_work(0, 0.002) == pytest.approx(0.002 * 0.8)
    assert cost.woken_work(0, 0.2) == pytest.approx(0.2 * 0.3)
    # a stretch whose debt passes a chunk sleeps in chunks: its work comes a chunk's worth at a time
    chunked = replace(cost, op_costs=OpCosts({}, {}, after_sleep=((0.01, 0.8), (1.0, 0.2))))
    per_chunk = WAIT_CHUNK_S / 0.8 / 5  # host seconds of work whose debt is a chunk
    assert chunked.woken_work(0, 10.0) == pytest.approx(10.0 * chunked.op_costs.slower_after(per_chunk))
    assert chunked.woken_work(0, 10.0) > 10.0 * chunked.op_costs.slower_after(10.0 / 5)
    assert cost.woken_work(0, 0.0) == 0.0
    # a stretch opening with the framework's own work: its ops run on at the curve from there,
    # E(h + w) - E(h) with E(x) = x f(x) in host seconds; less than the stretch's own fraction adds
    curve = lambda x: x * ops.slower_after(x)  # noqa: E731
    assert cost.woken_work(0, 0.02, opening=0.005) == pytest.approx(5.0 * (curve(0.004) - curve(0.001)))
    assert 0 < cost.woken_work(0, 0.02, opening=0.005) < cost.woken_work(0, 0.02)
    assert cost.woken_work(0, 0.02, opening=0.02) == 0.0  # all of it the opening: it runs at its price
    assert chunked.woken_work(0, 10.0, opening=0.005) == chunked.woken_work(0, 10.0)  # chunks: their own stretches
    plain = replace(cost, efficiency={"*": Efficiency(cpu_scale=1.0)})  # a type that does not sleep
    assert plain.sleep_after(0, 1.0) == plain.woken_work(0, 0.5) == 0.0
    assert replace(cost, op_costs=None).woken_work(0, 0.5) == 0.0  # no op costs, nothing measured


def test_a_stretch_after_an_idle_shorter_than_its_own_debt_wakes_as_that_idles_work_does():
    """`idle`: the wake-up costs what the curve gives for the work whose debt is that long, never
    more than for the stretch's own work; with an opening, both ends are taken at the shorter."""
    from dataclasses import replace

    from hspmd.planning import OpCosts

    _, config, _, _ = specialized("layers=4 ; 4x1: R0,1 L0-3")
    base = CostModel(parse_cluster("2x1"), from_llama_config(config, SEQ))
    ops = OpCosts({}, {}, after_sleep=((0.001, 0.8), (0.01, 0.3)))
    cost = replace(base, op_costs=ops, efficiency={"*": Efficiency(cpu_scale=5.0)})
    curve = lambda x: x * ops.slower_after(x)  # noqa: E731  (host seconds)
    short = cost.sleep_after(0, 0.005)  # the debt of 1 ms of host work
    assert cost.woken_work(0, 0.02, idle=short) == pytest.approx(5.0 * curve(0.001))
    assert cost.woken_work(0, 0.02, idle=short) < cost.woken_work(0, 0.02)
    # an idle as long as the stretch's own debt, or longer, changes nothing
    for idle in (cost.sleep_after(0, 0.02), 1.0):
        assert cost.woken_work(0, 0.02, idle=idle) == pytest.approx(cost.woken_work(0, 0.02))
    assert cost.woken_work(0, 0.02, idle=0.0) == 0.0
    assert cost.woken_work(0, 0.02, opening=0.002, idle=short) == pytest.approx(5.0 * (curve(0.001) - curve(0.0004)))
    assert cost.woken_work(0, 0.02, opening=0.01, idle=short) == 0.0  # the opening outlasts the wake-up


def test_a_cycles_stretch_is_idle_for_the_sleep_before_it_and_the_communications_since():
    """A last stage's 1F1B: the forward and backward run as one stretch after the short stretch
    that sends and receives; that stretch's debt and the receive are its idle. A communication
    right after another adds its seconds to the idle and cuts no work."""
    from dataclasses import replace

    from hspmd.planning import OpCosts
    from hspmd.planning.device_sim import PassSegments, _idle_before, _woken_passes, cycle_stretches

    _, config, _, _ = specialized("layers=4 ; 4x1: R0,1 L0-3")
    base = CostModel(parse_cluster("2x1"), from_llama_config(config, SEQ))
    ops = OpCosts({}, {}, per_pass=1e-5, after_sleep=((0.0001, 0.8), (0.01, 0.2)))
    cost = replace(base, op_costs=ops, efficiency={"*": Efficiency(cpu_scale=5.0)})
    forward, backward = PassSegments((0.001, 0.02), (0.004,)), PassSegments((0.03, 0.002), (0.0,))
    passes = (forward, backward)
    stretches = cycle_stretches([p.work for p in passes])
    assert stretches == [[(1, 1, 0.002), (0, 0, 0.001)], [(0, 1, 0.02), (1, 0, 0.03)]]
    assert _idle_before(cost, 0, stretches, 1, passes) == pytest.approx(cost.sleep_after(0, 0.003) + 0.004)
    assert _idle_before(cost, 0, stretches, 0, passes) == pytest.approx(cost.sleep_after(0, 0.05))
    added = _woken_passes(cost, 0, forward, backward, alternating=True)
    long = cost.woken_work(0, 0.05, idle=cost.sleep_after(0, 0.003) + 0.004)
    short = cost.woken_work(0, 0.003)  # the backward's tail first: no opening; after the long one's debt
    assert sum(added) == pytest.approx(long + short)
    assert long < cost.woken_work(0, 0.05)  # priced below the probe's curve at its own length
    # two communications in a row: the empty stretch between them is skipped, its seconds added
    three = (PassSegments((0.001, 0.0, 0.02), (0.004, 0.006)), PassSegments((0.03, 0.002), (0.0,)))
    cycle = cycle_stretches([p.work for p in three])
    first = next(i for i, s in enumerate(cycle) if (0, 2, 0.02) in s)
    assert _idle_before(cost, 0, cycle, first, three) == pytest.approx(cost.sleep_after(0, 0.003) + 0.004 + 0.006)
    assert _idle_before(cost, 0, [[(0, 0, 0.05)]], 0, (PassSegments((0.05,), ()),)) is None  # one stretch: its own debt


def test_a_pipeline_stage_that_waits_for_a_slower_one_is_priced_after_the_longer_idle():
    """peer_lags: the slowest stage's micro-batch less each device's own; device_costs prices a
    stage that waits again with its wait in the idle before the work after its receives, so its
    capped stretches wake as after a longer sleep; the slowest stage, and the step's
    communication, as they were."""
    from dataclasses import replace

    from hspmd.planning import OpCosts
    from hspmd.planning.device_sim import device_costs, peer_lags

    _, config, _, spec = specialized("layers=4 ; 4x2: R0 L0-0 | R1 L1-3")  # the last stage three times the first's layers
    base = CostModel(parse_cluster("2x1"), from_llama_config(config, SEQ))
    ops = OpCosts({}, {}, per_pass=1e-5, after_sleep=((1e-4, 1.0), (0.1, 0.05)))
    cost = replace(base, op_costs=ops, efficiency={"*": Efficiency(cpu_scale=8.0)})
    alone = {d: device_cost(exe, cost, spec.binding) for d, exe in spec.executables.items()}
    lags = peer_lags(spec, alone)
    busy = max(alone, key=lambda d: alone[d].forward + alone[d].backward)
    idle = min(alone, key=lambda d: alone[d].forward + alone[d].backward)
    assert lags[busy] == 0 and lags[idle] == pytest.approx(
        alone[busy].forward + alone[busy].backward - alone[idle].forward - alone[idle].backward)
    costs = device_costs(spec, cost)
    assert costs[busy] == alone[busy]
    waited = costs[idle].forward + costs[idle].backward
    assert waited > alone[idle].forward + alone[idle].backward  # its stretches after a receive no longer capped as short
    assert (costs[idle].forward_comm, costs[idle].backward_comm) == (alone[idle].forward_comm, alone[idle].backward_comm)
    unemulated = replace(cost, efficiency={"*": Efficiency(cpu_scale=1.0)})
    assert device_costs(spec, unemulated)[idle] == device_cost(spec.executables[idle], unemulated, spec.binding)


def test_passes_that_repeat_run_their_unslept_tails_into_the_next_pass():
    """cycle_stretches: a pass's last segment joins the next pass's first, the cycle's last the
    first; with no communication anywhere the cycle is one stretch."""
    from hspmd.planning.device_sim import cycle_stretches

    # a last stage's 1F1B: the forward (received, then computed) runs on into its backward (sent)
    assert sorted(cycle_stretches([[0.1, 2.0], [3.0, 0.2]])) == [[(0, 1, 2.0), (1, 0, 3.0)], [(1, 1, 0.2), (0, 0, 0.1)]]
    # data parallel: no communication, one stretch
    assert cycle_stretches([[2.0], [3.0]]) == [[(0, 0, 2.0), (1, 0, 3.0)]]
    # one pass with two collectives, repeating on its own (GPipe)
    assert sorted(cycle_stretches([[1.0, 2.0, 3.0]])) == [[(0, 1, 2.0)], [(0, 2, 3.0), (0, 0, 1.0)]]
    # a pass without communication between two that have some joins both neighbours' ends
    assert sorted(cycle_stretches([[1.0, 2.0], [5.0], [3.0, 4.0]])) == [[(0, 1, 2.0), (1, 0, 5.0), (2, 0, 3.0)],
                                                                       [(2, 1, 4.0), (0, 0, 1.0)]]


def test_level2_prices_the_op_kinds_its_op_costs_list_and_the_rest_as_before():
    """OpCosts: a transpose at its fixed time (x the type's cpu_scale) in place of one overhead,
    an add at its fixed time + its gamma x roofline, the work before each pass; on a type that
    sleeps (cpu_scale > 1) its work runs slower after each sleep: one before each communication,
    and the work no communication ends is one stretch. Kinds it does not list, communication and level 1 are priced as without
    it; level 2's per-step work is its own."""
    from dataclasses import replace

    from hspmd.planning import OpCosts
    from hspmd.planning.device_sim import op_kernel

    strategy, config, layout, spec = specialized("layers=4 ; 4x1: R0,1 L0-3")
    exe = spec.executables[0]
    base = CostModel(parse_cluster("2x1"), from_llama_config(config, SEQ), overhead=10e-6, step_overhead=5e-3)
    ops = OpCosts({"transpose": 1e-3, "add": 2e-4}, {"transpose": 0.0, "add": 3.0}, per_step=2e-3, per_pass=1e-4,
                  after_sleep=((1e-4, 0.5), (1.0, 0.1)))  # the less work between sleeps, the slower it runs
    priced = replace(base, op_costs=ops)
    scaled = replace(priced, efficiency={"*": Efficiency(cpu_scale=3.0)})
    unwoken = replace(base, op_costs=replace(ops, after_sleep=()), efficiency={"*": Efficiency(cpu_scale=3.0)})
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
    # every stretch between collectives runs slower by at most the fraction for its work (less
    # where the stretch before it, and so its sleep, was shorter): less than the least work's
    # fraction of the whole; the communication as it was
    work = device_cost(exe, unwoken, spec.binding)
    woken = slower.forward - work.forward
    compute = work.forward - work.forward_comm
    assert slower.forward_comm == work.forward_comm and 0 < woken < 0.5 * compute
    # with no communication a micro-batch's forward and backward run as one stretch (1F1B: they
    # take turns), opening with the forward's own work (per_pass) and slowed by the curve from
    # there, shared in proportion; GPipe's forwards run on into each other
    alone = device_cost(exe, unwoken, spec.binding, comm=False)
    assert alone.forward == pytest.approx(compute)
    one_stretch = device_cost(exe, scaled, spec.binding, comm=False)
    curve = lambda x: x * ops.slower_after(x)  # noqa: E731 (host seconds; the device's are 3x)
    both = alone.forward + alone.backward
    added = 3 * (curve(both / 3) - curve(1e-4))
    assert one_stretch.forward - alone.forward == pytest.approx(added * alone.forward / both)
    assert one_stretch.backward - alone.backward == pytest.approx(added * alone.backward / both)
    gpipe = device_cost(exe, scaled, spec.binding, comm=False, alternating=False)
    assert gpipe.forward - alone.forward == pytest.approx(3 * (curve(alone.forward / 3) - curve(1e-4)))
    assert after.forward_comm == before.forward_comm > 0
    assert simulate_strategy(strategy, priced).iteration == simulate_strategy(strategy, base).iteration
    assert priced.step_work(0, op_priced=True) == 2e-3 and scaled.step_work(0, op_priced=True) == 6e-3
    assert priced.step_work(0) == base.step_work(0) == 5e-3


def test_devices_that_wait_for_each_other_are_expected_to_wait_for_the_slowest_draw():
    """With OpCosts.jitter, level 2's iteration is the mean over jitter_draws of the step with
    each device's work (not its communication) slowed by its own draw: data parallel waits at
    its all-reduce for the larger of two draws (E ~ 1 + 0.56 jitter for two equal devices), one
    device for its own (E = 1 exactly: each device's draws average 1), an uneven split mostly
    for the busier device. The draws are the
    same on every call and for a device whoever runs beside it."""
    from dataclasses import replace
    from statistics import fmean, pstdev

    from hspmd.planning import OpCosts
    from hspmd.planning.device_sim import device_costs, device_memories, jitter_draws, stage_pipelines
    from hspmd.planning.simulator import simulate_pipelines

    draws = jitter_draws({0: 0.1, 1: 0.1})
    assert draws == jitter_draws({0: 0.1, 1: 0.1}) and [d[1] for d in draws] == [d[1] for d in jitter_draws({1: 0.1})]
    for device in (0, 1):
        factors = [d[device] for d in draws]
        assert fmean(factors) == pytest.approx(1.0) and pstdev(factors) == pytest.approx(0.1, rel=0.25)
    slowest = fmean(max(d.values()) for d in draws) - 1.0
    assert slowest == pytest.approx(0.1 / math.sqrt(math.pi), rel=0.25)

    def excess(text):
        """(iteration with jitter - without, the step's work of the busiest device)"""
        _, config, layout, spec = specialized(text)
        steady = CostModel(parse_cluster("2x1"), from_llama_config(config, SEQ), overhead=10e-6,
                           op_costs=OpCosts({}, {}, per_step=1e-3))
        jittery = replace(steady, op_costs=replace(steady.op_costs, jitter=0.1))
        counts = dict(enumerate(layout.counts))
        plain = simulate_specialized(spec, steady, counts)
        result, costs = simulate_device_run(spec, jittery, counts)
        assert result.peak_memory == plain.peak_memory
        doubled = simulate_pipelines(*stage_pipelines(spec, steady, device_costs(spec, steady), device_memories(spec), counts,
                                                      slowed={d: 2.0 for d in costs}))
        return result.iteration - plain.iteration, doubled.iteration - plain.iteration

    added, work = excess("layers=4 ; 2x2: R0 L0-3 ; 2x2: R1 L0-3")
    assert added == pytest.approx(slowest * work, rel=1e-6)
    added, work = excess("layers=4 ; 4x2: R0 L0-3")
    assert added == pytest.approx(0.0, abs=1e-12) and work > 0
    uneven, work_uneven = excess("layers=4 ; 3x2: R0 L0-3 ; 1x2: R1 L0-3")
    assert abs(uneven) < 0.3 * slowest * work_uneven


def test_a_longer_step_varies_less_by_the_square_root_of_its_length():
    """OpCosts.jitter_for: the probes' jitter for work up to the `jitter_over` seconds it was
    measured over, beyond them jitter x sqrt(over / work); level 2 draws each device's factor
    with its own step's spread (device_sim.host_step_work), so data parallel on steps 4x the
    probes' waits for half the excess of the unscaled jitter."""
    from dataclasses import replace
    from statistics import pstdev

    from hspmd.planning import OpCosts
    from hspmd.planning.device_sim import device_costs, host_step_work, jitter_draws

    costs = OpCosts({}, {}, jitter=0.2, jitter_over=5e-3)
    assert costs.jitter_for(1e-3) == costs.jitter_for(5e-3) == 0.2
    assert costs.jitter_for(20e-3) == pytest.approx(0.1) and costs.jitter_for(80e-3) == pytest.approx(0.05)
    assert replace(costs, jitter_over=0.0).jitter_for(80e-3) == 0.2  # measured over nothing said: no scaling
    assert pstdev(d[0] for d in jitter_draws({0: 0.05, 1: 0.2})) == pytest.approx(0.05, rel=0.25)

    _, config, layout, spec = specialized("layers=4 ; 2x2: R0 L0-3 ; 2x2: R1 L0-3")
    steady = CostModel(parse_cluster("2x1"), from_llama_config(config, SEQ), overhead=10e-6,
                       op_costs=OpCosts({}, {}, per_step=1e-3))
    counts = dict(enumerate(layout.counts))
    plain = simulate_specialized(spec, steady, counts)
    work = host_step_work(spec, steady, device_costs(spec, steady), counts)
    assert set(work) == {0, 1} and work[0] == pytest.approx(work[1]) and work[0] > steady.op_costs.per_step

    def excess(jitter_over):
        jittery = replace(steady, op_costs=replace(steady.op_costs, jitter=0.2, jitter_over=jitter_over))
        return simulate_specialized(spec, jittery, counts).iteration - plain.iteration

    unscaled, quarter = excess(0.0), excess(work[0] / 4)
    assert unscaled > 0 and quarter == pytest.approx(unscaled / 2, rel=0.05)
    assert excess(work[0]) == pytest.approx(unscaled, rel=1e-9)


def test_level2_runs_with_some_devices_work_slowed_and_counts_the_steps_tail_in_a_devices_work():
    """simulate_device_run's `slowed`: a factor on a device's work (not its communication) in
    every jitter draw; factors of 1 change nothing, and a factor for a device the specialization
    lacks, or one that is not positive, is refused by name. host_step_work counts the step's own
    work with what its sleep before the step loss's all-reduce adds (step_tail_work), as the
    simulated step does."""
    from dataclasses import replace

    from hspmd.errors import HSPMDError
    from hspmd.planning import OpCosts
    from hspmd.planning.device_sim import device_costs, host_step_work, step_tail_work

    _, config, layout, spec = specialized("layers=4 ; 4x2: R0 L0-1 | R1 L2-3")
    counts = dict(enumerate(layout.counts))
    base = CostModel(parse_cluster("2x1"), from_llama_config(config, SEQ), overhead=10e-6)
    ops = OpCosts({}, {}, per_step=1e-3, per_pass=2e-4, after_sleep=((1e-4, 0.8), (1e-2, 0.1)), jitter=0.1)
    cost = replace(base, op_costs=ops, efficiency={"*": Efficiency(cpu_scale=4.0)})
    plain = simulate_device_run(spec, cost, counts)[0].iteration
    assert simulate_device_run(spec, cost, counts, slowed={0: 1.0, 1: 1.0})[0].iteration == pytest.approx(plain, rel=1e-12)
    later = simulate_device_run(spec, cost, counts, slowed={1: 1.5})[0].iteration
    both = simulate_device_run(spec, cost, counts, slowed={0: 1.5, 1: 1.5})[0].iteration
    assert plain < later < both < 1.5 * plain  # the links' time is not slowed
    for bad, named in (({2: 1.5}, "2: 1.5"), ({0: 0.0}, "0: 0.0"), ({1: math.inf}, "1: inf")):
        with pytest.raises(HSPMDError, match=f"slowed must map .* positive factors, got .*{named}"):
            simulate_device_run(spec, cost, counts, slowed=bad)

    costs = device_costs(spec, cost)
    work = host_step_work(spec, cost, costs, counts)
    for d, c in costs.items():
        passes = 4 * (c.forward - c.forward_comm + c.backward - c.backward_comm) + c.update - c.update_comm
        tail = step_tail_work(cost, d, c)
        assert work[d] * cost.cpu_scale(d) == pytest.approx(passes + tail)
        # the sleep before the step loss's all-reduce slows the update's tail and the step's own work
        assert tail > cost.step_work(d, op_priced=True) > 0
