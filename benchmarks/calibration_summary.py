"""Where the simulator misses, over many saved runs of bench_calibration.py.

One run's MAPE mixes the model's systematic misses with that run's noise (its steps' and its
calibration's, a few points each). Over many saved runs the noise averages out and what is left
is the model's: per host and emulated kind, each strategy's mean step error and the spread
around it, and each rank's mean device CPU error, with level 2 as the simulator is now (as
`bench_calibration.py --repredict` does for one run); for the sets that kept every rank's device
CPU, also level 2's error given it (_calibration_accuracy.given_device_cpu: what the schedule,
the communications and the waits miss, apart from the device CPU's pricing). A change to the cost model is judged by
what it does to these means on every host, not by one run's MAPE.

    python benchmarks/calibration_summary.py [--refit] benchmarks/saved/calibration/*.json.gz

`--refit` fits every run's calibration again from the probes it saved (runs saved without
probes are then left out, and said so). Runs are grouped by host as their file names name it,
by the first word (the saved runs' convention: `vm2core-...`, `xeon16-...`); the CPUs a run
saved in its `host` field are printed beside.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _calibration_accuracy as accuracy  # noqa: E402
from _common import table  # noqa: E402


@dataclass(frozen=True)
class SetErrors:
    """Level 2's relative errors on one saved set: its step per strategy and, emulated, each
    rank's device CPU per (strategy, rank); `mape` over its strategies, in percent; `given`: its
    step per strategy given every rank's measured device CPU (None: the set kept not every
    rank's)."""

    host: str
    cpus: str
    kind: str
    path: str
    mape: float
    step: dict[str, float]
    device_cpu: dict[tuple[str, int], float]
    given: dict[str, float] | None = None


def host_of(path: str) -> str:
    """The host a saved run was measured on, as its file name's first word names it."""
    return Path(path).name.split("-")[0]


def set_errors(path: str, saved: dict, refit: bool = False) -> SetErrors:
    """Level 2's errors on one set of the run saved at `path` (_calibration_accuracy.saved_set)."""
    name, cluster, calibration, _, _, measured = accuracy.saved_set(path, saved, refit)
    predicted = accuracy.predict(calibration, cluster)
    step = {n: (predicted[n][0] - measured[n]) / measured[n] for n in accuracy.STRATEGIES}
    measured_cpu = {(n, rank): cpu for n, rank, cpu in accuracy.saved_device_cpu(saved)}
    device_cpu = {(n, rank): (predicted[n][3].get(rank, 0.0) - cpu) / cpu for (n, rank), cpu in measured_cpu.items()}
    given = None
    if cluster is not None and all((n, rank) in measured_cpu for n, p in predicted.items() for rank in p[3]):
        steps = accuracy.given_device_cpu(calibration, cluster, measured_cpu)
        given = {n: (steps[n] - measured[n]) / measured[n] for n in accuracy.STRATEGIES}
    kind = name.removeprefix("emulated-pair-") if name else "plain"
    mape = 100 * statistics.mean(abs(e) for e in step.values())
    return SetErrors(host_of(path), saved.get("host", ""), kind, path, mape, step, device_cpu, given)


def mean_and_spread(values: list[float]) -> tuple[float, float]:
    """(mean, standard deviation over the sets; 0 for one set)."""
    return statistics.mean(values), statistics.stdev(values) if len(values) > 1 else 0.0


def summarize(sets: list[SetErrors]) -> dict[tuple[str, str], dict]:
    """Per (host, kind): the sets' MAPEs, and per strategy (and per strategy and rank) the mean
    error and its spread over the sets; the same given each rank's measured device CPU, over the
    sets that kept it."""
    groups: dict[tuple[str, str], list[SetErrors]] = defaultdict(list)
    for s in sets:
        groups[s.host, s.kind].append(s)
    out = {}
    for key, group in sorted(groups.items()):
        cpu_keys = sorted({k for s in group for k in s.device_cpu}, key=lambda k: (list(accuracy.STRATEGIES).index(k[0]), k[1]))
        given = [s.given for s in group if s.given is not None]
        out[key] = {"sets": len(group), "cpus": sorted({s.cpus for s in group if s.cpus}), "mape": [s.mape for s in group],
                    "step": {n: mean_and_spread([s.step[n] for s in group]) for n in accuracy.STRATEGIES},
                    "device_cpu": {k: mean_and_spread([s.device_cpu[k] for s in group if k in s.device_cpu]) for k in cpu_keys},
                    "given_mape": [100 * statistics.mean(abs(e) for e in g.values()) for g in given],
                    "given": {n: mean_and_spread([g[n] for g in given]) for n in accuracy.STRATEGIES} if given else {}}
    return out


def print_summary(summary: dict[tuple[str, str], dict]) -> None:
    for (host, kind), group in summary.items():
        mapes = group["mape"]
        cpus = f" ({'; '.join(group['cpus'])})" if group["cpus"] else ""
        print(f"\n== {host}{cpus}, {kind}: {group['sets']} sets, level 2 MAPE {statistics.mean(mapes):.1f}% on average "
              f"({min(mapes):.1f}-{max(mapes):.1f}%)")
        if group["given_mape"]:
            given_mapes = group["given_mape"]
            print(f"given each rank's measured device CPU (kept by {len(given_mapes)} of the sets): MAPE "
                  f"{statistics.mean(given_mapes):.1f}% on average ({min(given_mapes):.1f}-{max(given_mapes):.1f}%)")
        ranks = sorted({rank for _, rank in group["device_cpu"]})
        rows = []
        for n, (mean, spread) in group["step"].items():
            cpu = [group["device_cpu"].get((n, rank)) for rank in ranks]
            given = group["given"].get(n)
            rows.append([n, f"{mean:+.1%} ({spread:.1%})"] + [f"{c[0]:+.1%} ({c[1]:.1%})" if c else "" for c in cpu]
                        + ([f"{given[0]:+.1%} ({given[1]:.1%})"] if given else []))
        print(table(["strategy", "step error (spread)"] + [f"rank {rank} device CPU error (spread)" for rank in ranks]
                    + (["step error given device CPU (spread)"] if group["given"] else []), rows))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("runs", nargs="+", metavar="JSON", help="runs saved by bench_calibration.py --json (.json or .json.gz)")
    p.add_argument("--refit", action="store_true", help="fit every run's calibration again from its saved probes")
    p.add_argument("--json", default=None, help="write the summary here")
    args = p.parse_args(argv)
    sets, left_out = [], []
    for path in args.runs:
        for saved in accuracy.read_saved(path):
            if args.refit and not saved.get("probes"):
                left_out.append(path)
                continue
            sets.append(set_errors(path, saved, args.refit))
    if not sets:
        raise SystemExit("calibration_summary: no set to summarise" + (" (none saved its probes, which --refit needs)" if left_out else ""))
    summary = summarize(sets)
    print_summary(summary)
    if left_out:
        print(f"\nleft out (saved no probes, which --refit needs): {', '.join(sorted(set(left_out)))}")
    if args.json:
        groups = [{"host": host, "kind": kind, **group,
                   "device_cpu": {f"{n} rank {rank}": v for (n, rank), v in group["device_cpu"].items()}}
                  for (host, kind), group in summary.items()]
        Path(args.json).write_text(json.dumps(groups, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
