"""`hspmd plan` on the paper's cluster and model: the strategy it prints and writes is rated by the
simulator at least as fast as the paper's Table 5 strategy (the searches' common interface)."""

from hspmd.cli import main
from hspmd.cluster import parse_cluster
from hspmd.planning import CostModel, model_named
from hspmd.planning.search.command import main as plan_main
from hspmd.planning.strategy_sim import simulate_strategy
from hspmd.specialize.paper_strategies import paper_strategy
from hspmd.specialize.strategy_files import load_strategy
from hspmd.specialize.strategy_text import format_strategy


def test_plan_beats_table5_in_the_simulator(tmp_path, capsys):
    out, png = tmp_path / "plan.yaml", tmp_path / "plan.png"
    code = main(["plan", "--cluster", "hetu-h800-h20", "--model", "llama-32b-hetu", "--global-batch", "64",
                 "--search", "dfs", "--out", str(out), "--png", str(png)])
    printed = capsys.readouterr().out
    assert code == 0
    planned = load_strategy(out)
    assert format_strategy(planned) in printed and "uniform (" in printed and "vs uniform" in printed
    # the compact strategy map in the terminal: one row per stage of each pipeline shape, device types named
    rows = [line for line in printed.splitlines() if line.startswith("  S") and "|" in line]
    assert len(planned.pipelines[0].stages) <= len(rows) <= sum(len(p.stages) for p in planned.pipelines)
    assert all(f"L{s.layers.start}-{s.layers.stop - 1}" in "".join(rows) for s in planned.pipelines[0].stages)
    assert any("H800" in r for r in rows) and any("H20" in r for r in rows)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and f"wrote {png}" in printed
    cost = CostModel(parse_cluster("hetu-h800-h20"), model_named("llama-32b-hetu"))
    table5 = simulate_strategy(paper_strategy("table5_32b_16h800_32h20"), cost).iteration
    assert simulate_strategy(planned, cost).iteration <= table5
    assert planned.global_batch_size == 64 and len(planned.all_ranks) == 48


def test_plan_reports_bad_input(capsys):
    assert main(["plan", "--cluster", "nowhere", "--model", "llama-32b-hetu", "--global-batch", "8"]) == 2
    assert "unknown cluster" in capsys.readouterr().err
    assert plan_main(["--cluster", "hetu-h800-h20", "--model", "llama-tiny", "--global-batch", "8", "--png", "x.png"]) == 2
    assert "--png needs a drawing function" in capsys.readouterr().err
