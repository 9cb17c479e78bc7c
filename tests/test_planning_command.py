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


EMULATED = "examples/clusters/emulated-two-types.yaml"


def _uniform_predicted(printed: str) -> float:
    row = next(line for line in printed.splitlines() if "uniform (" in line)
    return float(row.split("│")[2])


def test_plan_prices_with_a_calibration(tmp_path, capsys):
    """--calibration makes the planner price ops with the file's measured costs: the uniform split's
    predicted time is the calibrated cost model's, and a file with a costlier executor raises it."""
    from hspmd.planning.search.command import uniform_baseline
    from hspmd.planning.search.costed import cluster_problem
    from hspmd.runtime.policies.calibration import Calibration

    cluster, model = parse_cluster(EMULATED), model_named("llama-tiny")
    predicted = {}
    for name, overhead in (("cheap", 1e-5), ("costly", 1e-3)):
        cal = Calibration(peak_flops=2e9, bandwidth=4e9, overhead=overhead, link_latency=2e-5, link_bandwidth=1e9,
                          step_overhead=1e-3, gamma=1.5)
        path = tmp_path / f"{name}.json"
        cal.save(path)
        code = main(["plan", "--cluster", EMULATED, "--model", "llama-tiny", "--global-batch", "8", "--search", "dp",
                     "--calibration", str(path)])
        assert code == 0
        predicted[name] = _uniform_predicted(capsys.readouterr().out)
        expected = uniform_baseline(cluster_problem(cal.cost_model_for(cluster, model), 8, recompute=True))[1].time
        assert abs(predicted[name] - expected) <= 1e-3 * expected
    assert main(["plan", "--cluster", EMULATED, "--model", "llama-tiny", "--global-batch", "8", "--search", "dp"]) == 0
    nominal = _uniform_predicted(capsys.readouterr().out)
    assert predicted["costly"] > 2 * predicted["cheap"] and nominal != predicted["cheap"]


def test_plan_calibration_bad_input(tmp_path, capsys):
    args = ["plan", "--cluster", EMULATED, "--model", "llama-tiny", "--global-batch", "8", "--search", "dp", "--calibration"]
    corrupt, negative = tmp_path / "corrupt.json", tmp_path / "negative.json"
    corrupt.write_text("{not json")
    negative.write_text('{"peak_flops": -1, "bandwidth": 1e9, "overhead": 0, "link_latency": 0, "link_bandwidth": 1e9}')
    for path, words in ((tmp_path / "missing.json", "missing.json"), (corrupt, "JSONDecodeError"),
                        (negative, "peak_flops=-1.0")):
        assert main(args + [str(path)]) == 2
        err = capsys.readouterr().err
        assert err.startswith("hspmd: error: ") and words in err and err.count("\n") == 1
    assert main(["plan", "--cluster", "hetu-h800-h20", "--model", "llama-tiny", "--global-batch", "8",
                 "--calibration", str(negative)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("hspmd: error: ") and "no emulate block" in err


THREE_TYPES = "examples/clusters/emulated-three-types.yaml"


def _plan_three_types(tmp_path, capsys, name: str, overhead: float, step_overhead: float):
    """`hspmd plan` on the three-type emulated cluster priced with a made-up calibration: the
    strategy it wrote, and its cost model."""
    from hspmd.runtime.policies.calibration import Calibration

    cal = Calibration(peak_flops=2e9, bandwidth=4e9, overhead=overhead, link_latency=2e-5, link_bandwidth=1e9,
                      step_overhead=step_overhead, gamma=1.5)
    path, out = tmp_path / f"{name}.json", tmp_path / f"{name}.yaml"
    cal.save(path)
    code = main(["plan", "--cluster", THREE_TYPES, "--model", "llama-tiny", "--global-batch", "16", "--no-recompute",
                 "--iterations", "300", "--calibration", str(path), "--out", str(out)])
    assert code == 0
    return load_strategy(out), cal.cost_model_for(parse_cluster(THREE_TYPES), model_named("llama-tiny")), capsys.readouterr().out


def test_plan_writes_what_the_simulator_rates_fastest_not_what_the_formula_does(tmp_path, capsys):
    """Where the searches' objective and the level-1 simulator disagree, the written strategy is the
    simulator's fastest of the searches' answers and the uniform split: MCTS's answer has the least
    predicted time but simulates slower than DP's (per-step overheads), and under a costly per-op
    overhead every search's answer simulates slower than the uniform split, which is written."""
    from hspmd.planning.search.command import best_result, run_searches, uniform_baseline
    from hspmd.planning.search.costed import cluster_problem

    for name, overhead, step_overhead in (("steps", 1e-5, 1e-2), ("ops", 1e-3, 1e-3)):
        written, cost, printed = _plan_three_types(tmp_path, capsys, name, overhead, step_overhead)
        problem = cluster_problem(cost, 16, recompute=False)
        results = run_searches(problem, ("dp", "dfs", "mcts"), iterations=300)
        uniform = uniform_baseline(problem)[0]
        simulated = {k: simulate_strategy(r.strategy, cost).iteration for k, r in results.items()}
        simulated["uniform"] = simulate_strategy(uniform, cost).iteration
        formula_pick = simulate_strategy(best_result(results).strategy, cost).iteration
        assert simulate_strategy(written, cost).iteration == min(simulated.values()) < formula_pick, simulated
        if name == "ops":
            assert format_strategy(written) == format_strategy(uniform) and "chosen: the uniform split" in printed
        else:
            assert min(simulated.values()) < simulated["uniform"] and "chosen: dp" in printed
