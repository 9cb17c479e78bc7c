"""`hspmd simulate` / `hspmd show`: tables in the terminal, PNG pictures, clear errors."""

import pytest

from hspmd.cli import main
from hspmd.runtime.execution.trace import Tracer, write_trace


def test_simulate_prints_the_breakdown_and_draws(tmp_path, capsys):
    png = tmp_path / "s.png"
    assert main(["simulate", "layers=4 ; 4x1: R0,1 L0-1 | R2 L2-3", "--cluster", "hetu-h800-h20", "--model",
                 "llama-32b-hetu", "--png", str(png)]) == 0
    out = capsys.readouterr().out
    assert "iteration" in out and "closed form" in out and "rank" in out
    assert png.stat().st_size > 10_000


def test_show_draws_a_strategy_against_a_trace(tmp_path):
    tracer = [Tracer(r, origin=0.0) for r in (0, 1)]
    for r, t in enumerate(tracer):
        for name in ("F0", "F1", "B0", "B1") if r == 0 else ("F0", "B0", "F1", "B1"):
            with t.span(name):
                pass
        with t.span("update", "update"):
            pass
    trace = tmp_path / "t.json"
    write_trace(trace, [t.events for t in tracer])
    png = tmp_path / "s.png"
    assert main(["show", "layers=2 ; 2x1: R0 L0 | R1 L1", "--model", "llama-tiny", "--cluster", "1x2",
                 "--trace", str(trace), "--png", str(png)]) == 0
    assert png.stat().st_size > 10_000
    assert main(["show", str(trace), "--png", str(tmp_path / "t.png")]) == 0


@pytest.mark.parametrize("args, message", [
    (["simulate", "layers=2 ; 2x1: R0 L0 | R1 L1", "--model", "llama-9"], "unknown model"),
    (["simulate", "layers=2 ; 2x1: R0 L0 | R1 L1", "--cluster", "h900"], "unknown cluster"),
    (["simulate", "layers=2 ; 2x1: R0 L0 | R1 L1", "--schedule", "1f1b:1,2"], "increases"),
    (["show", "missing.json"], "hspmd show"),
])
def test_bad_input_is_one_clear_line(args, message, capsys):
    assert main(args) == 2
    assert message in capsys.readouterr().err
