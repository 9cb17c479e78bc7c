"""The simulator-accuracy tools beside bench_calibration.py: the summary of level 2's errors over
many saved runs (benchmarks/calibration_summary.py) and the op prices' check by model depth and
micro-batch size on one device (benchmarks/bench_op_prices.py)."""

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

from hspmd.errors import HSPMDError
from hspmd.planning import OpCosts
from hspmd.runtime.policies.calibration import Calibration
from hspmd.runtime.policies.probes import ProbeShape

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


def load(name: str):
    spec = importlib.util.spec_from_file_location(f"{name}_under_test", BENCHMARKS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up by name
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def summary():
    return load("calibration_summary")


def saved_run(bench, calibration, cluster, predicted, scale: float, **extra) -> dict:
    """A saved set whose every strategy measured `scale` x its level 2 step, and rank 0's device
    CPU of DP2 twice what level 2 prices."""
    cpu = {"DP2": {"0": {"measured": 2 * predicted["DP2"][3][0], "level2": 0.0}, "slowest": 1}}
    return {"cluster": cluster.name, "dilation": 8.0, "calibration": calibration.to_dict(),
            "measured": {n: scale * p[0] for n, p in predicted.items()}, "figures": {"device_cpu": cpu}, **extra}


def test_the_summary_averages_each_strategys_error_over_the_runs_of_a_host(tmp_path, capsys, summary):
    """Per host and kind, each strategy's mean step error and its spread over the sets, each
    rank's mean device CPU error; a run's file name's first word names its host, and the CPUs
    it saved are shown beside; a run without probes is left out of a refit, and said so."""
    bench = summary.accuracy
    costs = OpCosts({"matmul": 1e-5, "add": 4e-6}, {"matmul": 1.5, "add": 1.0}, per_step=1e-4, per_pass=5e-5,
                    after_sleep=((1e-4, 0.5), (1e-2, 0.1)))
    calibration = Calibration(1e11, 1e10, 2e-5, 1e-4, 1e9, 1e-3, 1.5, costs)
    cluster = bench.emulated_pair("heterogeneous", 8.0)
    predicted = bench.predict(calibration, cluster)
    # two runs of one host 20% and 10% under (their measured steps 1.25x and 1/0.9 x level 2's)
    (tmp_path / "vmA-first.json").write_text(json.dumps([saved_run(bench, calibration, cluster, predicted, 1.25)]))
    (tmp_path / "vmA-second.json").write_text(json.dumps(saved_run(bench, calibration, cluster, predicted, 1 / 0.9)))
    (tmp_path / "xeon-1.json").write_text(json.dumps([saved_run(bench, calibration, cluster, predicted, 1.0, host="Xeon, 16 CPUs")]))
    paths = [str(tmp_path / name) for name in ("vmA-first.json", "vmA-second.json", "xeon-1.json")]
    summary.main([*paths, "--json", str(tmp_path / "summary.json")])
    groups = {(g["host"], g["kind"]): g for g in json.loads((tmp_path / "summary.json").read_text())}
    assert set(groups) == {("vmA", "heterogeneous"), ("xeon", "heterogeneous")}
    vm, xeon = groups["vmA", "heterogeneous"], groups["xeon", "heterogeneous"]
    assert vm["cpus"] == [] and xeon["cpus"] == ["Xeon, 16 CPUs"]
    assert vm["sets"] == 2 and vm["mape"] == pytest.approx([20.0, 10.0])
    for mean, spread in vm["step"].values():
        assert mean == pytest.approx(-0.15) and spread == pytest.approx(0.0707107, rel=1e-5)
    assert vm["device_cpu"] == {"DP2 rank 0": pytest.approx([-0.5, 0.0])}
    assert xeon["sets"] == 1 and all(m == pytest.approx(0.0) and s == 0.0 for m, s in xeon["step"].values())
    printed = capsys.readouterr().out
    assert "== vmA, heterogeneous: 2 sets, level 2 MAPE 15.0% on average (10.0-20.0%)" in printed
    assert "-15.0% (7.1%)" in printed and "-50.0% (0.0%)" in printed
    assert vm["given_mape"] == [] and vm["given"] == {}  # neither kept every rank's device CPU
    # a run that kept every rank's device CPU, each as level 2 prices it: given it, level 2's own step
    every = {n: {str(rank): {"measured": cpu} for rank, cpu in p[3].items()} for n, p in predicted.items()}
    (tmp_path / "vmB-1.json").write_text(json.dumps({**saved_run(bench, calibration, cluster, predicted, 1.25),
                                                     "figures": {"device_cpu": every}}))
    summary.main([str(tmp_path / "vmB-1.json"), "--json", str(tmp_path / "given.json")])
    (given,) = json.loads((tmp_path / "given.json").read_text())
    assert given["given_mape"] == [pytest.approx(20.0)] and given["mape"] == [pytest.approx(20.0)]
    assert all(mean == pytest.approx(-0.2) for mean, _ in given["given"].values())
    assert "given each rank's measured device CPU (kept by 1 of the sets): MAPE 20.0%" in capsys.readouterr().out
    # --refit needs the probes a run saved: runs without them are left out, by name
    with pytest.raises(SystemExit, match="no set to summarise .none saved its probes"):
        summary.main([*paths, "--refit"])


def test_the_op_prices_check_refuses_a_layout_it_cannot_build():
    """bench_op_prices --shapes: M micro-batches of N sequences, N a multiple of the probe's rows."""
    module = load("bench_op_prices")
    shape = ProbeShape()
    assert module.layout_of("2x4", shape) == (2, 1) and module.layout_of("1x16", shape) == (1, 4)
    for bad in ("2by4", "1x6", "0x4", "1x2"):
        with pytest.raises(HSPMDError, match=f"--shapes: '{bad}'"):
            module.layout_of(bad, shape)


def test_the_op_prices_check_narrows_the_stack_to_a_tensor_parallel_shard():
    """bench_op_prices --width HEADS,FFN: the stack's layer as a TP rank's shard (its heads keep the
    layer's head size, so attention is that fraction of the layer's); bad widths refused by name."""
    module = load("bench_op_prices")
    shape = ProbeShape()
    assert module.stack_shape(None, shape) == shape
    shard = module.stack_shape("2,64", shape)
    config = shard.config(4)
    assert (config.heads, config.ffn, config.head_dim) == (2, 64, shape.hidden // shape.heads)
    assert config.heads * config.head_dim * 2 == shape.config(4).heads * shape.config(4).head_dim
    for bad in ("2", "3,64", "2,100", "0,64", "two,64"):
        with pytest.raises(HSPMDError, match="--width"):
            module.stack_shape(bad, shape)


def test_the_op_prices_check_prices_a_measured_step(tmp_path):
    """One round, one model: the probes are fitted and the step priced against what it measured
    (run as its own process: it pins itself to a CPU)."""
    out = tmp_path / "prices.json"
    done = subprocess.run([sys.executable, str(BENCHMARKS / "bench_op_prices.py"), "--layers", "2", "--shapes", "1x4,2x4",
                           "--rounds", "1", "--json", str(out)], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    figures = json.loads(out.read_text())
    configs = {(c["layers"], c["shape"]): c for c in figures["configs"]}
    assert set(configs) == {(2, "1x4"), (2, "2x4")}
    for c in configs.values():
        assert c["measured"] > 0 and c["level2"] > 0 and len(c["steps"]) == 1 and c["peak_bytes"] > 0
    assert configs[2, "2x4"]["level2"] > configs[2, "1x4"]["level2"]  # two micro-batches price more work than one
    assert "device CPU ms" in done.stdout and "calibration:" in done.stdout


def test_a_timeline_splits_into_the_stretches_between_its_marks():
    """bench_stretches.split_stretches: cut at every communication and chunk slept, a mark right
    after another cutting nothing; each stretch knows what it followed and whether a pass's own
    work opened it."""
    module = load("bench_stretches")
    from hspmd.runtime.execution.emulation import BETWEEN_PASSES, CHUNK_SLEPT, COMMUNICATED
    timeline = [(BETWEEN_PASSES, 1.0), ("a", 2.0), ("b", 3.0), (COMMUNICATED, 0.0), (COMMUNICATED, 0.0), ("c", 4.0),
                (BETWEEN_PASSES, 0.5), ("d", 1.0), (CHUNK_SLEPT, 0.0), ("e", 6.0), (COMMUNICATED, 0.0)]
    stretches = module.split_stretches(timeline)
    assert [(s.after, s.opens_pass, [n for n, _ in s.ops], s.passes, s.pass_count) for s in stretches] == [
        (module.STEP_START, True, ["a", "b"], 1.0, 1),
        (COMMUNICATED, False, ["c", "d"], 0.5, 1),
        (CHUNK_SLEPT, False, ["e"], 0.0, 0)]
    assert stretches[1].kind == "after a communication, an op first"
    assert stretches[0].kind == "at the step's start, a pass start first"
    assert module.split_stretches([]) == [] and module.split_stretches([(COMMUNICATED, 0.0)]) == []


def test_the_stretch_check_prices_each_kind_of_stretch(tmp_path):
    """One round of two strategies on the emulated pair (time dilated 2x, not the benchmark's 8x,
    to keep it short): every rank's stretches priced, TP2's after its collectives, the pipeline's
    after its sends and receives (run as its own processes)."""
    out = tmp_path / "stretches.json"
    done = subprocess.run([sys.executable, str(BENCHMARKS / "bench_stretches.py"), "--strategies", "TP2,PP2 1F1B",
                           "--rounds", "1", "--dilation", "2", "--json", str(out)], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    figures = json.loads(out.read_text())["stretches"]
    for name in ("TP2", "PP2 1F1B"):
        for rank in ("0", "1"):
            kinds = figures[name][rank]
            after = kinds["after a communication, an op first"]
            assert after["stretches"] > 0 and after["ops"] > 0 and after["ops_priced"] > 0 and after["unpriced"] == 0
    # 85 communications a step (21 a micro-batch's, and the loss's), four right after another and the last ending the step
    assert figures["TP2"]["0"]["after a communication, an op first"]["stretches"] == 85 - 4 - 1
    assert "curve adds" in done.stdout and "level 2 adds" in done.stdout
    # a saved run priced again (its probes fitted as the code is now): the same stretches
    again = subprocess.run([sys.executable, str(BENCHMARKS / "bench_stretches.py"), "--reprice", str(out)],
                           capture_output=True, text=True, timeout=300)
    assert again.returncode == 0, again.stderr[-2000:]
    assert "re-priced" in again.stdout and again.stdout.count("after a communication, an op first") == 4


def test_the_stretch_check_refuses_an_unknown_strategy():
    done = subprocess.run([sys.executable, str(BENCHMARKS / "bench_stretches.py"), "--strategies", "TP3"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode != 0 and "--strategies: unknown ['TP3']" in done.stderr
