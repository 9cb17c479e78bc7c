"""Calibration fits (on synthetic probe data, no timing) and trace files."""

import json

import pytest

from hspmd.errors import HSPMDError
from hspmd.planning import from_llama_config
from hspmd.models.llama import LlamaConfig
from hspmd.runtime.calibrate import ADD_SIZES, MATMUL_SIZES, MESSAGE_SIZES, Calibration, fit, fit_line, probe_program
from hspmd.planning.device_sim import DISPATCHED, op_kernel
from hspmd.runtime.trace import Tracer, read_trace, write_trace


def synthetic_probe(peak=50e9, bandwidth=20e9, d_gemm=3e-6, d_elem=2e-6, per_instruction=40e-6, alpha=30e-6, beta=2e9):
    exe, binding = probe_program()
    program = exe.forward + exe.backward + exe.update
    roofline = 0.0
    for ins in program:
        k = op_kernel(exe, ins, binding)
        if k is not None:
            work = k.flops / peak if k.cls in ("gemm", "attn") else k.bytes / bandwidth
            roofline += k.count * (work + {"gemm": d_gemm, "attn": d_gemm, "misc": 0.0}.get(k.cls, d_elem))
    return {"matmul": [2.0 * n ** 3 / peak + d_gemm for n in MATMUL_SIZES],
            "add": [12.0 * n / bandwidth + d_elem for n in ADD_SIZES],
            "executor": roofline + per_instruction * sum(1 for ins in program if ins.role in DISPATCHED),
            "pingpong": [alpha + n / beta for n in MESSAGE_SIZES],
            "allreduce": [2 * alpha + n / beta for n in MESSAGE_SIZES]}


def test_fit_recovers_the_parameters_of_synthetic_probes():
    cal = fit([synthetic_probe(), synthetic_probe()])
    d = dict(cal.delta)
    assert cal.peak_flops == pytest.approx(50e9) and cal.bandwidth == pytest.approx(20e9)
    assert d["gemm"] == pytest.approx(3e-6) and d["elementwise"] == pytest.approx(2e-6)
    assert cal.overhead == pytest.approx(40e-6)
    assert cal.link_latency == pytest.approx(30e-6) and cal.link_bandwidth == pytest.approx(2e9)
    cost = cal.cost_model(from_llama_config(LlamaConfig(), 8), 2)
    assert cost.cluster.link(0, 1).latency == pytest.approx(30e-6) and cost.overhead == pytest.approx(40e-6)


def test_calibration_file_round_trip(tmp_path):
    cal = fit([synthetic_probe()])
    cal.save(tmp_path / "c.json")
    assert Calibration.load(tmp_path / "c.json") == cal
    (tmp_path / "bad.json").write_text("{}")
    with pytest.raises(HSPMDError, match="cannot read calibration file"):
        Calibration.load(tmp_path / "bad.json")


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
    from hspmd.runtime.calibrate import Probe

    probe = Probe(None)
    runs = [probe.once() for _ in range(2)]
    assert all(t > 0 for run in runs for key in ("matmul", "add") for t in run[key])
    assert all(run["executor"] > 0 and "pingpong" not in run for run in runs)
    calibration = fit(runs)
    assert calibration.peak_flops > 0 and calibration.bandwidth > 0 and calibration.overhead >= 0
