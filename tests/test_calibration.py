"""Calibration fits (on synthetic probe data, no timing) and trace files."""

import gzip
import json
import math
import random
import statistics
import sys
from pathlib import Path

import pytest

from hspmd.errors import HSPMDError
from hspmd.planning import OpCosts, from_llama_config
from hspmd.models.llama import LlamaConfig
from hspmd.planning.model import KERNEL_CLASSES
from hspmd.runtime.policies import calibrate
from hspmd.runtime.policies.calibrate import (OpWork, StepWork, fit, fit_line, fit_op_costs, fit_steps, jitter_span,
                                             step_jitter)
from hspmd.runtime.policies.calibration import Calibration
from hspmd.runtime.policies.probes import ADD_SIZES, MATMUL_SIZES, MESSAGE_SIZES, PROBE_RUNS, WAKE_INTERVALS
from hspmd.cluster.emulation import WAIT_CHUNK_S
from hspmd.runtime.execution.emulation import BETWEEN_PASSES
from hspmd.runtime.execution.trace import Tracer, read_trace, write_trace


# Each probe run's work, written down here rather than counted by step_work (so the fit is checked
# against numbers the implementation did not produce): roofline seconds, dispatched instructions.
PROBE_WORK = dict(zip(PROBE_RUNS, (StepWork(2.1e-3, 150), StepWork(3.9e-3, 262), StepWork(4.0e-3, 291),
                                   StepWork(7.4e-3, 150))))


def synthetic_probe(peak=50e9, bandwidth=20e9, d_gemm=3e-6, d_elem=2e-6, per_instruction=40e-6, per_step=2e-3,
                    alpha=30e-6, beta=2e9, gamma=1.7):
    """Probe results of a machine with these rates (the micro-benchmarks' fixed times d_* are
    not fitted: on steps they are part of the per-instruction overhead); step times from
    PROBE_WORK."""
    steps = [gamma * w.roofline + per_instruction * w.instructions + per_step for w in PROBE_WORK.values()]
    return {"matmul": [2.0 * n ** 3 / peak + d_gemm for n in MATMUL_SIZES],
            "add": [12.0 * n / bandwidth + d_elem for n in ADD_SIZES],
            "steps": steps,
            "pingpong": [alpha + n / beta for n in MESSAGE_SIZES],
            "allreduce": [2 * alpha + n / beta for n in MESSAGE_SIZES]}


# Each probe run's ops, written down here too: (name, kind, class, roofline seconds, calls per step);
# the 4x micro-batch run has 4x the rooflines, which is what tells a kind's gamma from its fixed time.
def _ops(scale: float, calls: int = 1) -> tuple[OpWork, ...]:
    return (OpWork("q", "matmul", "gemm", 20e-6 * scale, calls), OpWork("k", "matmul", "gemm", 10e-6 * scale, calls),
            OpWork("a", "add", "elementwise", 4e-6 * scale, calls), OpWork("t", "transpose", "misc", 0.0, calls),
            OpWork("att", "causal_attention", "attn", 8e-6 * scale, calls))


PROBE_OPS = dict(zip(PROBE_RUNS, (_ops(1.0), _ops(1.0, 2), _ops(1.0) + tuple(OpWork(w.name + "2", w.kind, w.cls, w.roofline, 1)
                                                                             for w in _ops(1.0)), _ops(4.0))))
OP_FIXED = {"matmul": 12e-6, "add": 5e-6, "transpose": 7e-6, "causal_attention": 90e-6}
OP_GAMMA = {"matmul": 1.3, "add": 0.2, "transpose": 0.0, "causal_attention": 8.0}


PASSES = [1 + 2 * micro_batches for _, micro_batches, _ in PROBE_RUNS]  # forward and backward per micro-batch, update


def synthetic_op_times(per_step=1e-3, per_pass=3e-4):
    """Each probe run's op seconds (fixed + gamma x roofline), the work before its passes, and step
    seconds (the ops' sum + per_pass x passes + per_step)."""
    timed = [{w.name: OP_FIXED[w.kind] + OP_GAMMA[w.kind] * w.roofline for w in ops} | {BETWEEN_PASSES: per_pass}
             for ops in PROBE_OPS.values()]
    steps = [sum(w.calls * t[w.name] for w in ops) + per_pass * n + per_step
             for t, ops, n in zip(timed, PROBE_OPS.values(), PASSES)]
    return timed, steps


@pytest.fixture
def written_work(monkeypatch):
    """fit() counts each probe run's work with step_work and op_work; here it gets PROBE_WORK and
    PROBE_OPS instead."""
    monkeypatch.setattr(calibrate, "probe_trainer", lambda shape, *run: (run, None))
    monkeypatch.setattr(calibrate, "step_work", lambda run, cost: PROBE_WORK[run])
    monkeypatch.setattr(calibrate, "op_work", lambda run, cost: PROBE_OPS[run])


def test_op_costs_are_fitted_per_kind_from_the_ops_timings():
    timed, steps = synthetic_op_times()
    costs = fit_op_costs(list(PROBE_OPS.values()), timed, steps, PASSES)
    assert costs.fixed_of == pytest.approx(OP_FIXED) and costs.per_step == pytest.approx(1e-3)
    assert costs.per_pass == pytest.approx(3e-4) and costs.after_sleep == ()
    assert {k: g for k, g in costs.gamma if k != "transpose"} == pytest.approx({k: g for k, g in OP_GAMMA.items()
                                                                              if k != "transpose"})
    # an op the probes did not time is left out of its row, not read as free
    partial = [{n: t for n, t in run.items() if not n.startswith("att")} for run in timed]
    assert not fit_op_costs(list(PROBE_OPS.values()), partial, steps, PASSES).covers("causal_attention")
    with pytest.raises(HSPMDError, match="no probe op was timed"):
        fit_op_costs(list(PROBE_OPS.values()), [{} for _ in timed], steps, PASSES)


def test_fit_gives_op_costs_when_the_probes_timed_their_ops(written_work):
    timed, steps = synthetic_op_times()
    probe = {**synthetic_probe(), "ops": timed, "steps": steps}
    cal = fit([probe, probe])
    assert cal.op_costs is not None and cal.op_costs.fixed_of == pytest.approx(OP_FIXED)
    assert cal.op_costs.per_step == pytest.approx(1e-3) and cal.op_costs.after_sleep == ()
    # emulated step probes also time how much slower the work between two sleeps runs, by how
    # much work that is: per slowdown and interval the typical (trimmed mean) work and fraction
    # (never below 0), sorted by work
    rounds = [{8.0: [(0.001 * k, f), (0.004 * k, f / 2)], 20.0: [(0.002, 3 * f / 4), (0.016 * k, f / 4)]}
              for k, f in ((1.0, 0.8), (1.1, 1.2), (0.9, -0.4))]
    slower = fit([{**probe, "after_sleep": r} for r in rounds]).op_costs
    assert [pair for point in slower.after_sleep for pair in point] == pytest.approx(
        [0.001, 1.6 / 3, 0.002, 0.4, 0.004, 0.8 / 3, 0.016, 0.4 / 3])
    # more work between sleeps never runs slower on average (the slowest is right after waking):
    # a rise between the probes' points is pooled away; two slowdowns' points at one work share it
    rising = calibrate.after_sleep_curve([{8.0: [(0.001, 0.5), (0.002, 0.7), (0.004, 0.1)], 20.0: [(0.004, 0.3)]}])
    assert [pair for point in rising for pair in point] == pytest.approx([0.001, 0.6, 0.002, 0.6, 0.004, 0.2])
    # priced: the least work's fraction below it, log-linear between, the most's beyond
    assert [slower.slower_after(w) for w in (0.0, 0.001, 0.003, 0.016, 1.0)] == pytest.approx(
        [1.6 / 3, 1.6 / 3, 0.4 - 0.4 / 3 * math.log(1.5) / math.log(2), 0.4 / 3, 0.4 / 3])
    assert fit([synthetic_probe()]).op_costs is None  # probes without op timings: every op at `overhead`
    # the synthetic probes here, as the runs saved before the last probe run was added, hold the
    # first runs of PROBE_RUNS: they are fitted from those (a run saved so can be fitted again)
    assert len(probe["steps"]) == len(PROBE_RUNS) - 1 and PROBE_RUNS[-1] == (2, 1, 4)


def test_fit_recovers_the_parameters_of_synthetic_probes(written_work):
    cal = fit([synthetic_probe(), synthetic_probe()])
    assert cal.peak_flops == pytest.approx(50e9) and cal.bandwidth == pytest.approx(20e9)
    assert cal.overhead == pytest.approx(40e-6) and cal.step_overhead == pytest.approx(2e-3)
    assert cal.gamma == pytest.approx(1.7)
    assert cal.link_latency == pytest.approx(30e-6) and cal.link_bandwidth == pytest.approx(2e9)
    cost = cal.cost_model(from_llama_config(LlamaConfig(), 8), 2)
    assert cost.cluster.link(0, 1).latency == pytest.approx(30e-6) and cost.overhead == pytest.approx(40e-6)
    assert cost.step_overhead == pytest.approx(2e-3)
    efficiency = cost.efficiency_of(cost.device(0))
    assert all(efficiency.g(cls) == pytest.approx(1.7) and efficiency.d(cls) == 0.0 for cls in KERNEL_CLASSES)


def test_a_record_of_some_probe_parts_is_one_more_sample_of_those_alone(written_work):
    # a benchmark samples the step probes (the op prices) more often than the rest: each key's
    # typical value is taken over the records that measured it
    timed, steps = synthetic_op_times()
    full = {**synthetic_probe(), "ops": timed, "steps": steps, "rank": 0, "round": 1}
    slow_ops = [{name: 1.5 * t for name, t in run.items()} for run in timed]
    step_only = [{"rank": 0, "round": 2 + k, "steps": [1.5 * t for t in steps], "ops": slow_ops} for k in range(3)]
    both = fit([full] + step_only)
    # the op prices are the typical of all four records (of four, no tenth to trim: their mean,
    # 1.375x), the micro-benchmarks and the links the full record's alone
    assert both.op_costs.fixed_of == pytest.approx({k: 1.375 * v for k, v in OP_FIXED.items()})
    assert both.peak_flops == pytest.approx(50e9) and both.link_latency == pytest.approx(30e-6)
    assert fit([full, full]).op_costs.fixed_of == pytest.approx(OP_FIXED)
    # records without any micro-benchmark are refused by name, not with a KeyError from inside
    with pytest.raises(HSPMDError, match="none of the 3 probe results measured 'matmul'"):
        fit(step_only)


def test_fit_steps_separates_kernel_efficiency_from_overheads_and_refuses_noise():
    work = [StepWork(r, n) for r, n in ((1e-3, 100), (2e-3, 200), (2e-3, 190), (4e-3, 100))]
    seconds = [2.0 * w.roofline + 30e-6 * w.instructions + 1e-3 for w in work]
    assert fit_steps(work, seconds) == pytest.approx((2.0, 30e-6, 1e-3))
    # a per-step term that would come out negative is left out, not clamped after the fit
    seconds = [2.0 * w.roofline + 30e-6 * w.instructions - 1e-4 for w in work]
    gamma, overhead, per_step = fit_steps(work, seconds)
    assert per_step == 0.0 and gamma > 0 and overhead > 0
    with pytest.raises(HSPMDError, match="too noisy"):
        fit_steps(work, [5e-3, 4e-3, 4e-3, 1e-3])
    # a large micro-batch slowed by load: gamma takes the time, the overhead may come out zero
    gamma, overhead, _ = fit_steps([StepWork(7.7e-4, 133), StepWork(1.44e-3, 254), StepWork(1.44e-3, 239),
                                    StepWork(2.77e-3, 133)], [9.49e-3, 12.46e-3, 12.42e-3, 19.71e-3])
    assert gamma > 1 and overhead >= 0


def test_the_step_overhead_and_the_loss_all_reduce_are_priced_once_per_step(written_work):
    # one more fixed millisecond per step moves both simulator levels by exactly that much (every
    # device pays it once, in the update phase); with several devices the step loss's all-reduce
    # is priced on the link too
    from dataclasses import replace

    from hspmd.planning.device_sim import simulate_llama
    from hspmd.planning.strategy_sim import simulate_strategy
    from hspmd.specialize.strategy_text import parse_strategy

    cal = fit([synthetic_probe()])
    model = from_llama_config(LlamaConfig(vocab=64, hidden=32, layers=2, heads=2, ffn=48), 16)
    for text in ("layers=2 ; 2x2: R0 L0-1", "layers=2 ; 2x2: R0 L0 | R1 L1 ; 2x2: R2 L0 | R3 L1"):
        strategy = parse_strategy(text)
        devices = len(strategy.all_ranks)
        base = cal.cost_model(model, devices)
        more = replace(base, step_overhead=base.step_overhead + 1e-3)
        for simulate in (simulate_strategy, simulate_llama):
            a, b = simulate(strategy, base).iteration, simulate(strategy, more).iteration
            assert b - a == pytest.approx(1e-3, rel=1e-6)
        loss = base.collective("all_reduce", 8.0, strategy.all_ranks) if devices > 1 else 0.0
        assert base.step_fixed(strategy.all_ranks) == pytest.approx(base.step_overhead + loss)
        assert (loss > 0) == (devices > 1)


def test_calibration_file_round_trip(tmp_path, written_work):
    timed, _ = synthetic_op_times()
    emulated = {**synthetic_probe(), "ops": timed, "after_sleep": {8.0: [(0.0005, 0.3), (0.004, 0.1)]}, "round": 1}
    two_ranks = [{**emulated, "rank": 0}, {**emulated, "rank": 1, "steps": [1.1 * t for t in emulated["steps"]]}]
    for probes in ([synthetic_probe()], [emulated], two_ranks):
        cal = fit(probes)
        cal.save(tmp_path / "c.json")
        assert Calibration.load(tmp_path / "c.json") == cal
    assert cal.op_costs.jitter > 0 and cal.op_costs.jitter_over > 0
    assert f"step jitter {cal.op_costs.jitter:.1%} over {cal.op_costs.jitter_over * 1e3:.1f} ms of work" in cal.describe()
    (tmp_path / "bad.json").write_text("{}")
    with pytest.raises(HSPMDError, match="cannot read calibration file"):
        Calibration.load(tmp_path / "bad.json")
    data = json.loads((tmp_path / "c.json").read_text())
    data["op_costs"]["fixed"]["add"] = -1.0
    (tmp_path / "bad.json").write_text(json.dumps(data))
    with pytest.raises(HSPMDError, match="bad.json.*fixed.*add=-1.0"):
        Calibration.load(tmp_path / "bad.json")
    data["op_costs"]["fixed"]["add"] = 1e-6
    data["op_costs"]["slower_between_sleeps"] = [[0.0, 0.1]]
    (tmp_path / "bad.json").write_text(json.dumps(data))
    with pytest.raises(HSPMDError, match="bad.json.*after_sleep: works must be > 0 seconds"):
        Calibration.load(tmp_path / "bad.json")
    data["op_costs"]["slower_between_sleeps"] = [[0.01, 0.1], [0.01, 0.2]]
    (tmp_path / "bad.json").write_text(json.dumps(data))
    with pytest.raises(HSPMDError, match="bad.json.*one fraction per work"):
        Calibration.load(tmp_path / "bad.json")
    # files from before (a fixed cost per sleep, by slowdown or by length) load without it
    del data["op_costs"]["slower_between_sleeps"]
    data["op_costs"]["wake_ups"] = [[8.0, 1e-4]]
    data["op_costs"]["wake_ups_after_sleep"] = [[0.01, 1e-4]]
    (tmp_path / "old.json").write_text(json.dumps(data))
    assert Calibration.load(tmp_path / "old.json").op_costs.after_sleep == ()
    data["op_costs"]["step_jitter"] = float("nan")
    (tmp_path / "bad.json").write_text(json.dumps(data))
    with pytest.raises(HSPMDError, match="bad.json.*jitter must be finite and >= 0"):
        Calibration.load(tmp_path / "bad.json")
    data["op_costs"]["step_jitter"] = 0.2
    data["op_costs"]["step_jitter_over"] = -1.0
    (tmp_path / "bad.json").write_text(json.dumps(data))
    with pytest.raises(HSPMDError, match="bad.json.*jitter_over must be finite and >= 0"):
        Calibration.load(tmp_path / "bad.json")
    del data["op_costs"]["step_jitter_over"]  # files from before the jitter's length was kept: unscaled
    (tmp_path / "old.json").write_text(json.dumps(data))
    assert Calibration.load(tmp_path / "old.json").op_costs.jitter_for(1.0) == 0.2
    del data["op_costs"]["step_jitter"]  # files from before the jitter was measured: none
    (tmp_path / "old.json").write_text(json.dumps(data))
    assert Calibration.load(tmp_path / "old.json").op_costs.jitter == 0.0


def test_the_step_jitter_is_each_ranks_own_spread_around_the_ranks_mean():
    """step_jitter: the step probes of ranks that ran them in the same round, each against the
    ranks' mean (load they share cancels); pooled, one rank's own relative standard deviation."""
    rng = random.Random(1)
    probes = []
    for r in range(300):
        shared = rng.uniform(0.5, 2.0)  # load both ranks met in this round
        probes += [{"rank": rank, "round": r, "steps": [shared * t * (1 + rng.gauss(0.0, 0.1)) for t in (1e-3, 4e-3)]}
                   for rank in (0, 1)]
    assert step_jitter(probes) == pytest.approx(0.1, rel=0.1)
    three = [{**p, "rank": 2} for p in probes if p["rank"] == 0]  # a third rank, the first's twin: less spread
    assert 0 < step_jitter(probes + three) < step_jitter(probes)
    # the shared load alone is no jitter; a rank alone in its rounds, or probes that do not say
    # whose they are (saved before they did), tell nothing
    assert step_jitter([{**p, "steps": [1e-3, 4e-3]} for p in probes]) == 0.0
    assert step_jitter([p for p in probes if p["rank"] == 0]) == 0.0
    assert step_jitter([{"steps": p["steps"]} for p in probes]) == 0.0


def test_the_jitter_is_said_over_the_probes_harmonic_mean_length():
    """jitter_span: the probes pool relative variances that fall as 1 / length, so the pooled
    jitter is the one of their harmonic mean's length; probes that measured nothing are left out."""
    assert jitter_span([2e-3, 6e-3]) == pytest.approx(3e-3)
    assert jitter_span([4e-3, 4e-3, 0.0]) == pytest.approx(4e-3)
    assert jitter_span([]) == 0.0
    rng = random.Random(2)
    lengths = (2e-3, 8e-3)
    probes = [{"rank": rank, "round": r, "steps": [t * (1 + rng.gauss(0.0, 0.1 * math.sqrt(4e-3 / t))) for t in lengths]}
              for r in range(2000) for rank in (0, 1)]
    costs = OpCosts({}, {}, jitter=step_jitter(probes), jitter_over=jitter_span(list(lengths)))
    assert costs.jitter_for(4e-3 * 4) == pytest.approx(0.05, rel=0.1)  # the spread the simulated probes were drawn with


def test_fit_line_refuses_noise_that_does_not_grow():
    assert fit_line([1, 2, 3], [3, 5, 7]) == pytest.approx((2.0, 1.0))
    with pytest.raises(HSPMDError, match="too noisy"):
        fit_line([1, 2, 3], [3, 2, 1])


def test_trace_file_round_trip(tmp_path):
    a, b = Tracer(0, origin=0.0), Tracer(1, origin=0.0)
    with a.span("F0", micro_batch=0):
        pass
    with b.span("update", "update"):
        pass
    write_trace(tmp_path / "t.json", [a.events, b.events])
    data = json.loads((tmp_path / "t.json").read_text())
    assert {e["ph"] for e in data["traceEvents"]} == {"M", "X"}
    back = read_trace(tmp_path / "t.json")
    assert list(back) == [0, 1] and back[0][0]["name"] == "F0" and back[1][0]["cat"] == "update"
    assert back[0][0]["dur"] >= 0 and back[0][0]["args"] == {"micro_batch": 0}
    (tmp_path / "empty.json").write_text('{"traceEvents": []}')
    with pytest.raises(HSPMDError, match="no complete"):
        read_trace(tmp_path / "empty.json")


def test_the_probes_run_on_this_machine_and_fit():
    # the real micro-benchmarks (one process, no gloo): every probe gives a positive time and the
    # fit gives a usable calibration; nothing here is a timing assertion
    from hspmd.runtime.policies.probes import Probe

    probe = Probe(None)
    runs = []
    for attempt in range(3):  # the typical of 4, 8, 12 runs: a burst of load on a shared machine passes
        runs += [probe.once() for _ in range(4)]
        assert all(t > 0 for run in runs for key in ("matmul", "add") for t in run[key])
        assert all(len(run["steps"]) == len(PROBE_RUNS) and min(run["steps"]) > 0 and "pingpong" not in run
                   for run in runs)
        try:
            calibration = fit(runs)
            break
        except HSPMDError as exc:  # only the documented noise refusal is retried
            if "too noisy" not in str(exc) or attempt == 2:
                raise
    assert calibration.peak_flops > 0 and calibration.bandwidth > 0
    assert calibration.gamma > 0 and calibration.overhead >= 0 and calibration.step_overhead >= 0
    # every op kind of the probe Llama's programs was timed and priced
    assert {"matmul", "causal_attention_grad", "rms_normalize", "adamw_update", "embedding"} <= set(calibration.op_costs.fixed_of)


def test_emulated_step_probes_run_as_a_slower_device_and_count_its_cpu_time():
    # the step probes of an emulated calibration run as an emulated device (sleeping in chunks,
    # as an emulated rank's steps run between communications): each owes its slowdown and
    # reports the CPU time the device owed; nothing here is a timing assertion
    from hspmd.runtime.execution.emulation import emulation_of
    from hspmd.runtime.policies.probes import Probe

    with pytest.raises(HSPMDError, match="slowdown > 1"):
        Probe(None, emulate=1.0)
    # (8x: a debt that a loaded host's slower wall time does not wipe out, so the waking side sleeps)
    probe = Probe(None, cpu_time=True, emulate=8.0, wake_at=(1.0, 10.0))
    devices = [emulation_of(trainer.backend) for trainer, _ in probe.trainers]
    waking = emulation_of(probe.trainers[PROBE_RUNS.index((2, 1, 1))][0].backend)
    run = probe.once()
    assert len(run["steps"]) == len(PROBE_RUNS) and min(run["steps"]) > 0
    assert all(d is not None and d.slowdown == 8.0 and d.op_cpu_s > 0 for d in devices)
    # the wake-up probe's device slept where it asked, and went back to sleeping in chunks
    assert waking.compute_sleeps > 0 and all(d.chunk_s == WAIT_CHUNK_S and not d.wake_every for d in devices)
    # the wake-up probe ran at the reference's slowdown and the other sleeping type's (not at 1x),
    # and left the device at its own slowdown
    assert sorted(run["after_sleep"]) == [8.0, 10.0]
    # one (work, fraction) per interval, the work between sleeps growing with the interval
    for points in run["after_sleep"].values():
        works = [work for work, _ in points]
        assert len(points) == len(WAKE_INTERVALS) and min(works) > 0 and works == sorted(works)
    # the step probes alone: another sample of the op prices, numbered as the next round
    steps_only = probe.once(parts=("steps",))
    assert set(steps_only) == {"rank", "round", "steps", "ops"} and steps_only["round"] == run["round"] + 1
    assert len(steps_only["ops"]) == len(PROBE_RUNS) and min(steps_only["steps"]) > 0
    with pytest.raises(HSPMDError, match=r"unknown part\(s\) \['warp'\]"):
        probe.once(parts=("steps", "warp"))


@pytest.fixture
def bench():
    """benchmarks/_calibration_accuracy.py as a module: the calibration bench's strategies, its
    predictions, accuracy and noise, and its saved runs read again."""
    import importlib.util

    folder = Path(__file__).resolve().parents[1] / "benchmarks"
    if str(folder) not in sys.path:
        sys.path.insert(0, str(folder))  # as the benchmarks run: beside their _common
    spec = importlib.util.spec_from_file_location("calibration_accuracy_under_test", folder / "_calibration_accuracy.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_bench_reports_how_far_its_own_noise_moves_what_it_measured(bench):
    """measurement_noise: a bootstrap of the rounds' typical step against it; none for steps
    that never vary, less the more rounds the same noise is measured over, the same every call."""
    rng = random.Random(3)
    noisy = lambda rounds: {n: [base * rng.lognormvariate(0.0, 0.2) for _ in range(rounds)]  # noqa: E731
                            for n, base in (("a", 0.2), ("b", 0.5))}
    assert bench.measurement_noise({"a": [0.2] * 6, "b": [0.5] * 6}) == 0.0
    few, many = noisy(6), noisy(96)
    assert bench.measurement_noise(few) == bench.measurement_noise(few) > bench.measurement_noise(many) > 0.0
    assert bench.measurement_noise(many) == pytest.approx(bench.measurement_noise(few) / 4, rel=0.5)


def test_the_bench_reports_how_far_the_calibrations_own_sampling_moves_its_predictions(written_work, bench):
    """calibration_noise: fits to the probe rounds drawn again (a round: each rank's record of every
    probe and the records of some parts after it), their predictions against the fit to all."""
    timed, steps = synthetic_op_times()

    def run(scales):
        records = []
        for rank in (0, 1):
            number = 0
            for scale in scales:  # a round's full record, then a turn's step probes
                number += 1
                records.append({**synthetic_probe(), "ops": timed, "steps": [scale * t for t in steps], "rank": rank,
                                "round": number})
                number += 1
                records.append({"ops": [{n: scale * t for n, t in run.items()} for run in timed],
                                "steps": [scale * t for t in steps], "rank": rank, "round": number})
        return records

    varied = run([1.0, 1.4, 0.8, 1.1])
    rounds = bench.probe_rounds(varied)
    assert [len(r) for r in rounds] == [4] * 4 and all({p["rank"] for p in r} == {0, 1} for r in rounds)
    assert all(r[0]["steps"] == r[1]["steps"] and "matmul" in r[0] and "matmul" not in r[1] for r in rounds)
    cluster = bench.emulated_pair("homogeneous", 8.0)
    assert bench.calibration_noise(run([1.0] * 4), cluster, resamples=3) == 0.0  # rounds alike: nothing to move
    noisy = bench.calibration_noise(varied, cluster, resamples=3)
    assert noisy > 1.0 and bench.calibration_noise(varied, cluster, resamples=3) == noisy  # seeded


def test_a_saved_bench_run_is_predicted_again_with_its_own_calibration(tmp_path, capsys, monkeypatch, written_work, bench):
    """bench_calibration --repredict: a run's saved measurements and calibration, predicted by the
    simulator as it is now (a cost-model change checked without a new, noisy run); with --refit
    the calibration fitted again from the run's saved probes."""

    costs = OpCosts({"matmul": 1e-5, "add": 4e-6}, {"matmul": 1.5, "add": 1.0}, per_step=1e-4, per_pass=5e-5,
                    after_sleep=((1e-4, 0.5), (1e-2, 0.1)))
    calibration = Calibration(1e11, 1e10, 2e-5, 1e-4, 1e9, 1e-3, 1.5, costs)
    cluster = bench.emulated_pair("heterogeneous", 8.0)
    predicted = bench.predict(calibration, cluster)
    measured = {name: 1.25 * p[0] for name, p in predicted.items()}  # every strategy 25% slower than priced
    cpu = {"DP2": {"0": {"measured": 2 * predicted["DP2"][3][0], "level2": 0.0}, "slowest": 1}}
    saved = [{"cluster": cluster.name, "dilation": 8.0, "calibration": calibration.to_dict(), "measured": measured,
              "figures": {"device_cpu": cpu}}]
    (tmp_path / "run.json").write_text(json.dumps(saved))
    out = bench.repredict(str(tmp_path / "run.json"))
    assert out[0]["figures"]["all level 2"]["mape"] == pytest.approx(20.0)
    assert out[0]["figures"]["all level 2"]["spearman"] == pytest.approx(1.0)
    printed = capsys.readouterr().out
    assert "re-predicted: emulated-pair-heterogeneous" in printed and "-50.0%" in printed  # DP2 rank 0's device CPU
    assert "noise" not in out[0]["figures"]  # a run saved without its rounds' steps
    (tmp_path / "stepped.json").write_text(json.dumps([{**saved[0], "steps": {n: [[m] * 3, [m / 2] * 3] for n, m in measured.items()}}]))
    assert bench.repredict(str(tmp_path / "stepped.json"))[0]["figures"]["noise"] == {"mape": 0.0, "rounds": 3}
    # --refit: the probes the run saved (JSON's string keys for the wake-up probe's slowdowns), fitted
    # again; a run saved before the probes said whose they were saved rank 0's rounds, then rank 1's
    timed, steps = synthetic_op_times()
    probe = {**synthetic_probe(), "ops": timed, "steps": steps, "after_sleep": {8.0: [(1e-4, 0.4), (1e-2, 0.1)]}}
    other = {**probe, "steps": [1.2 * t for t in steps]}
    refit_calibration = fit([{**probe, "rank": 0, "round": 0}, {**other, "rank": 1, "round": 0}])
    assert refit_calibration.op_costs.jitter > 0
    refitted = bench.predict(refit_calibration, cluster)
    saved[0].update(probes=json.loads(json.dumps([probe, other])), measured={n: 1.25 * p[0] for n, p in refitted.items()})
    (tmp_path / "probed.json").write_text(json.dumps(saved))
    monkeypatch.setattr(bench, "CALIBRATION_RESAMPLES", 2)
    refit_figures = bench.repredict(str(tmp_path / "probed.json"), refit=True)[0]["figures"]
    assert refit_figures["all level 2"]["mape"] == pytest.approx(20.0)
    assert refit_figures["calibration_noise"]["rounds"] == 1 and refit_figures["calibration_noise"]["mape"] >= 0.0
    assert bench.repredict(str(tmp_path / "probed.json"))[0]["figures"]["all level 2"]["mape"] != pytest.approx(20.0)
    # the saved runs with their probes are kept compressed
    (tmp_path / "probed.json.gz").write_bytes(gzip.compress(json.dumps(saved).encode()))
    assert bench.repredict(str(tmp_path / "probed.json.gz"), refit=True)[0]["figures"]["all level 2"]["mape"] == pytest.approx(20.0)
    with pytest.raises(SystemExit, match="run.json saved no probes"):
        bench.repredict(str(tmp_path / "run.json"), refit=True)
    (tmp_path / "other.json").write_text(json.dumps([{**saved[0], "measured": {"DP2": 1.0}}]))
    with pytest.raises(SystemExit, match="other.json: not a saved run of this benchmark: KeyError"):
        bench.repredict(str(tmp_path / "other.json"))


def test_a_ranks_breakdown_is_its_typical_step_not_its_mean(bench):
    """The per-rank breakdown (step, compute waits, link waits, device CPU) is summarised as the
    steps are (fitting.typical): one stalled round of several times the others' must not stand
    for the run, as a mean lets it; a saved run with its parts is read the same way, an older one
    by the figure it saved."""
    steps = [0.50, 0.52, 0.48, 0.51, 0.49, 0.50, 0.52, 0.48, 0.51, 1.60]
    parts = [(0.9 * s, 0.0, 0.1 * s) for s in steps]
    step, wait, link, cpu = bench.rank_breakdown(steps, parts)
    assert step == pytest.approx(0.50375) and cpu == pytest.approx(0.050375) and link == 0.0
    assert statistics.mean(p[2] for p in parts) > 1.2 * cpu  # what the mean said
    saved = {"steps": {"DP2": [steps, steps[:4]]}, "parts": {"DP2": [parts, parts[:4]]},
             "figures": {"device_cpu": {"DP2": {"0": {"measured": 1.0}, "slowest": 0}}}}
    read = bench.saved_device_cpu(saved)
    assert [(n, r) for n, r, _ in read] == [("DP2", 0), ("DP2", 1)] and read[0][2] == pytest.approx(cpu)
    del saved["parts"]
    assert bench.saved_device_cpu(saved) == [("DP2", 0, 1.0)]


def test_the_bench_splits_a_device_cpu_error_into_op_prices_and_after_sleep_pricing(bench):
    """--split-wake: a rank's device CPU as run (sleeping before each communication) and slept in
    chunks alone (as the op probes' steps are); the measured after-sleep share is their ratio, the
    op prices' error level 2 without its after-sleep pricing against the chunked step, and the two
    errors a level 2 error is made of can be told apart even where they cancel."""
    key = ("TP2", 0)
    # the ops run 20% over their prices, and level 2 prices the sleeps at +60% where they add +33%
    rows = bench.wake_split_rows({key: 0.080}, {key: 0.060}, {key: 0.080}, {key: 0.050})
    assert rows == [["TP2", "0", "80.00", "60.00", "+33.3%", "+60.0%", "-16.7%", "+0.0%"]]
    assert bench.WAKE_SPLIT_HEADERS[4:7] == ["after-sleep", "level 2 after-sleep", "op prices' error"]


def test_level2_given_each_ranks_measured_device_cpu_tells_the_schedules_error_from_the_prices(bench, capsys):
    """_calibration_accuracy.given_device_cpu: level 2's step with every rank's work scaled to its
    measured device CPU. Given the device CPU level 2 itself prices, it is level 2's own step;
    a rank that measured more work makes its strategy's step longer, by less than that rank's
    factor (its communication is not slowed); print_cpu_split prints and returns both MAPEs."""
    costs = OpCosts({"matmul": 1e-5, "add": 4e-6}, {"matmul": 1.5, "add": 1.0}, per_step=1e-4, per_pass=5e-5,
                    after_sleep=((1e-4, 0.5), (1e-2, 0.1)), jitter=0.1)
    calibration = Calibration(1e11, 1e10, 2e-5, 1e-4, 1e9, 1e-3, 1.5, costs)
    cluster = bench.emulated_pair("heterogeneous", 8.0)
    predicted = bench.predict(calibration, cluster)
    priced = {(n, rank): cpu for n, p in predicted.items() for rank, cpu in p[3].items()}
    assert len(priced) == 2 * len(bench.STRATEGIES)
    given = bench.given_device_cpu(calibration, cluster, priced)
    assert given == {n: pytest.approx(p[0], rel=1e-9) for n, p in predicted.items()}
    slower = bench.given_device_cpu(calibration, cluster, {**priced, ("PP2 1F1B", 1): 1.5 * priced["PP2 1F1B", 1],
                                                          ("DP2", 0): 1.5 * priced["DP2", 0], ("DP2", 1): 1.5 * priced["DP2", 1]})
    for name in ("PP2 1F1B", "DP2"):
        assert predicted[name][0] < slower[name] < 1.5 * predicted[name][0]
    assert all(slower[n] == pytest.approx(given[n], rel=1e-9) for n in bench.STRATEGIES if n not in ("PP2 1F1B", "DP2"))
    measured = {n: 1.1 * p[0] for n, p in predicted.items()}
    figures = bench.print_cpu_split(calibration, cluster, measured, predicted, priced)
    assert figures["level2"] == pytest.approx(100 / 11) and figures["given_device_cpu"] == pytest.approx(100 / 11)
    assert "given each rank's measured device CPU 9.1%" in capsys.readouterr().out
