"""Specialization time per rank of a Llama-32B-shaped graph (60 layers, hidden 5120, 40 heads, FFN
27648, vocab 152064) as the job grows: Megatron-style DP x TP4 x PP4 on 48, 1,024 and 4,096 ranks
(DP 3, 64, 256), without and with ZeRO-1, plus the paper's Table 5 strategy (16 H800 + 32 H20 =
48 devices, ZeRO-1).

Per rank, cold (what one process of the job does, nothing shared with another rank): deduction,
instantiation of its own program (pruning, CommOp substitution, resolving the plans of its
CommOps) and pipeline discovery (the patterns of every per-micro-batch CommOp). Each measured rank
runs in a fresh process, as a rank of a job does, so no cache survives from another rank (the
module-level ones included: the memos of interned layouts, the resolver's bound and piece
tables; with them warm, as measured here before, 4,096 ranks looked ~20% cheaper); building the
graph (making the strategy's leaf annotations) is reported apart. The phases run with automatic garbage
collection paused, as specialize_graph runs them (hspmd/gc_pause.py); the per-rank total counts
the collection that closes the block. Times are CPU seconds of the process (the
work is single-threaded; on a shared machine wall time also counts waiting for a core), the sizes
are interleaved (each repetition runs every size once) and the ratio to 48 ranks is the median of
the per-repetition ratios. The figure to watch is that ratio at 1,024 and 4,096 (goal: within 2x).
Beside it, the size of the program the rank produced (its instructions, the members of its groups,
its parts of the plans) and the seconds per MB of it against the first size: the output itself
grows with the job, since a data-parallel group lists all its members.

Also: compiling every rank's program in one process and writing each as it is made
(iter_programs into write_programs) at 48, 1,024 and 4,096 ranks (quick: 48 and 256), per rank
and with the peak memory it adds, one node compiling only its 8 ranks' programs (ranks=), and one
rank reading its program back (what a rank of a compiled job does in place of
specializing); the size of one rank's program file (hspmd.specialize.program) at each size: as written
(this device's parts of the plans, each distinct annotation text once) against the same program
with whole plans and every tensor's annotation inline (how programs were written before); parsing
one 16,384-device annotation, and planning one all-to-all (S0 -> S1 on the same devices, n^2
messages by nature) on 256 and 1,024 devices.
Run: python benchmarks/bench_specialize.py [--quick] [--reps N]   (--quick: 48 and 1,024 ranks only;
--reps: interleaved repetitions, default 3)
"""

from __future__ import annotations

import gc
import json
import multiprocessing
import os
import statistics
import sys
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

from _common import table

from hspmd.annotations import parse
from hspmd.comm_resolve import resolve
from hspmd.ir import Binding
from hspmd.models.llama import LlamaConfig, build_llama
from hspmd.specialize.deduce import deduce
from hspmd.specialize.executable import instantiate, live_nodes
from hspmd.gc_pause import collector_paused
from hspmd.specialize.paper_strategies import paper_strategy
from hspmd.specialize.pipelines import discover_pipelines, expected_pipelines
from hspmd.specialize.program import DeviceProgram, device_program
from hspmd.runtime.programs.compiling import PROGRAM_FILE, iter_programs, write_programs
from hspmd.specialize.specialized import all_devices, per_micro_batch_pattern
from hspmd.specialize.strategy_build import uniform_strategy

NODE = 8  # ranks per node, for a node compiling its own programs
LLAMA_32B = LlamaConfig(vocab=152064, hidden=5120, layers=60, heads=40, ffn=27648)


def _clock(fn):
    """(fn(), CPU seconds of this process): specialization is single-threaded, and on a shared
    machine CPU time measures the work where wall time also counts waiting for a core."""
    start = time.process_time()
    out = fn()
    return out, time.process_time() - start


def one_rank(strategy, rank: int) -> dict[str, float]:
    """Seconds of each phase for `rank` specializing on its own (fresh graph, no shared cache)."""
    model, t_build = _clock(lambda: build_llama(LLAMA_32B, [strategy]))
    ratios = strategy.micro_batch_ratios
    binding = Binding.of({"B": sum(ratios), "S": 4096, "T": 4096 * strategy.global_batch_size}, ratios=ratios)
    seconds = {"build": t_build}

    def specialize():
        with collector_paused():  # as specialize_graph does; its closing collection counts in "rank"
            deduced, seconds["deduce"] = _clock(lambda: deduce(model.graph, 0))
            live, plans = live_nodes(model.graph), {}
            exe, seconds["instantiate"] = _clock(lambda: instantiate(deduced, rank, binding, live=live, plans=plans))
            pattern, seconds["discover"] = _clock(lambda: per_micro_batch_pattern(deduced, binding, live, None, plans))
            pipelines, t_pipelines = _clock(lambda: discover_pipelines(*pattern, all_devices(deduced)))
            seconds["discover"] += t_pipelines
        return exe, pipelines

    (exe, pipelines), seconds["rank"] = _clock(specialize)
    if [p.stages for p in pipelines] != [p.stages for p in expected_pipelines(strategy)]:
        raise SystemExit(f"rank {rank}: discovered pipelines differ from the strategy's")
    program_mb = len(json.dumps(_program(exe, strategy).to_dict())) / 1e6
    return seconds | {"ops": len(exe.instructions()), "nodes": len(model.graph.nodes), "program_mb": program_mb}


def _program(exe, strategy) -> DeviceProgram:
    """What the rank produced, as the program file it would write (its size measures the output:
    the rank's instructions, its groups' members and its parts of the plans)."""
    return device_program(exe, seed=0, place=None, feeds=(), global_batch=strategy.global_batch_size,
                          devices=(exe.device,), groups=(), loss=None, loss_summand=False)


def fresh_rank(strategy, rank: int) -> dict[str, float]:
    """one_rank in a process of its own (spawned: nothing inherited), as a job's rank runs."""
    with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
        return pool.submit(one_rank, strategy, rank).result()


def scaling(sizes, reps: int = 3) -> None:
    """Interleaved: each repetition times one rank (first, middle, last in turn) of every size, each
    in a fresh process, so that the per-repetition ratios to the first size see the same machine load."""
    runs: dict[str, list[dict]] = {label: [] for label, _ in sizes}
    load_before = os.getloadavg()[0]
    for rep in range(reps):
        for label, strategy in sizes:
            n = len(strategy.all_ranks)
            runs[label].append(fresh_rank(strategy, (0, n // 2 + 1, n - 1)[rep % 3]))
        print(f"  repetition {rep + 1} of {reps} done", file=sys.stderr, flush=True)
    base = runs[sizes[0][0]]
    rows = []
    for label, strategy in sizes:
        mine = runs[label]
        per_rank = [r["rank"] for r in mine]
        ratios = sorted(r["rank"] / b["rank"] for r, b in zip(mine, base))
        per_mb = sorted((r["rank"] / r["program_mb"]) / (b["rank"] / b["program_mb"]) for r, b in zip(mine, base))
        phase = {k: statistics.median(r[k] for r in mine) for k in ("build", "deduce", "instantiate", "discover")}
        rows.append([label, len(strategy.all_ranks), f"{statistics.median(per_rank):.3f}",
                     f"{statistics.median(ratios):.2f}x ({ratios[0]:.2f}-{ratios[-1]:.2f})",
                     f"{phase['deduce']:.3f}", f"{phase['instantiate']:.3f}", f"{phase['discover']:.3f}",
                     f"{phase['build']:.2f}", f"{mine[0]['ops']}/{mine[0]['nodes']}",
                     f"{statistics.median(r['program_mb'] for r in mine):.2f}",
                     f"{statistics.median(per_mb):.2f}x ({per_mb[0]:.2f}-{per_mb[-1]:.2f})"])
    print(f"\nPer-rank specialization, cold (a fresh process per rank), CPU s (deduction + instantiation + pipeline discovery), "
          f"{reps} interleaved repetitions (ranks first/middle/last), load average {load_before:.1f} before, "
          f"{os.getloadavg()[0]:.1f} after:")
    print(table(["strategy", "ranks", "per rank s", f"vs {sizes[0][0]} (spread)", "deduce", "instantiate",
                 "discover", "build (apart)", "ops on rank 0", "program MB", "s per program MB vs first"], rows))


def program_sizes(sizes) -> None:
    """Bytes of rank 0's program as written, and as it was with whole plans and inline annotations."""
    rows, base = [], None
    for label, strategy in sizes:
        model = build_llama(LLAMA_32B, [strategy])
        ratios = strategy.micro_batch_ratios
        binding = Binding.of({"B": sum(ratios), "S": 4096, "T": 4096 * strategy.global_batch_size}, ratios=ratios)
        with collector_paused():
            deduced = deduce(model.graph, 0)
            live, plans = live_nodes(model.graph), {}
            exe = instantiate(deduced, 0, binding, live=live, plans=plans)
            program = _program(exe, strategy)
            data = program.to_dict()
            parts = len(json.dumps(data))
            whole_plans = dict.fromkeys(exe.plan(i.node, binding) for i in exe.instructions()
                                        if i.node.opdef.is_comm and i.role != "identity")
            data["plans"] = [p.to_dict() for p in whole_plans]
            for t, info in zip(data["tensors"], program.tensors):
                t["annotation"] = info.annotation
            del data["annotations"]
            whole = len(json.dumps(data))
        base = base or parts
        rows.append([label, len(strategy.all_ranks), f"{parts / 1e6:.2f}", f"{parts / base:.2f}x", f"{whole / 1e6:.2f}",
                     f"{whole / parts:.1f}x", len(program.plans)])
    print("\nRank 0's program file (MB): as written (its parts of the plans, annotation texts once) and with "
          "whole plans and inline annotations:")
    print(table(["strategy", "ranks", "program MB", f"vs {sizes[0][0]}", "whole MB", "whole / parts", "plans"], rows))


def _resident_kb(key: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(key + ":"))


def _peak_mb(fn):
    """(fn(), the most resident memory it added, MB): Linux's peak-RSS mark is reset first
    (clear_refs 5), so the figure is this call's, not an earlier section's."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    start = _resident_kb("VmRSS")
    out = fn()
    return out, (_resident_kb("VmHWM") - start) / 1024


def compiled_job(sizes) -> None:
    """What sharing the work across the job costs instead: one process compiles every rank's
    program (deduction and every plan once, each rank's program cut from them) and writes them one
    by one as they are made (iter_programs into write_programs, so one program is held at a time),
    and a rank reads its own back (what a rank of a compiled job does in place of specializing)."""
    rows, base = [], None
    for label, strategy in sizes:
        model = build_llama(LLAMA_32B, [strategy])
        symbols = {"S": 4096, "T": 4096 * strategy.global_batch_size}
        gc.collect()
        with tempfile.TemporaryDirectory() as out:
            (_, seconds), peak = _peak_mb(lambda: _clock(
                lambda: write_programs(iter_programs(model.graph, 0, strategy, symbols=symbols), out)))
            text = (Path(out) / PROGRAM_FILE.format(rank=0)).read_text()
        n = len(strategy.all_ranks)
        gc.collect()
        _, read = _clock(lambda: DeviceProgram.from_json(text))
        with tempfile.TemporaryDirectory() as out:  # one node compiling its own 8 ranks, setup included
            _, node = _clock(lambda: write_programs(
                iter_programs(model.graph, 0, strategy, symbols=symbols, ranks=range(NODE)), out))
        cold = fresh_rank(strategy, 0)["rank"]  # the same rank specializing on its own, side by side
        per_rank = seconds / n * 1e3
        base = base or per_rank
        rows.append([label, n, f"{seconds:.1f}", f"{per_rank:.1f}", f"{per_rank / base:.2f}x", f"{peak:.0f}",
                     f"{read:.3f}", f"{node / NODE:.3f}", f"{cold:.3f}", f"{read / cold:.2f}x",
                     f"{node / NODE / cold:.2f}x",
                     f"{len(text) / 1e6:.2f}"])
    print("\nCompiling and writing every rank's program in one process (CPU s in all, ms per rank, peak memory "
          f"added); one rank reading its program back, a node compiling its {NODE} ranks (s per rank) and the same "
          "rank specializing cold (CPU s):")
    print(table(["strategy", "ranks", "compile s", "per rank ms", f"vs {sizes[0][0]}", "peak MB", "read s",
                 f"node of {NODE} s", "cold s", "read / cold", "node / cold", "program MB"], rows))


def parse_and_all_to_all(a2a_sizes) -> None:
    gc.collect()  # the sections before leave garbage that automatic collections would walk while parsing
    ids = ",".join(map(str, range(16384)))
    _, t_list = _clock(lambda: parse(f"S0:16384@[{ids}]"))
    _, t_range = _clock(lambda: parse("S0:16384@[0-16383]"))
    union = "H0{" + " | ".join(f"S1:4@[{4 * i}-{4 * i + 3}]" for i in range(4096)) + "}"
    _, t_union = _clock(lambda: parse(union))
    print("\nParsing 16,384 devices: "
          f"one group listed id by id {t_list:.3f} s, as a range {t_range:.4f} s, "
          f"a union of 4,096 TP4 subgroups {t_union:.3f} s")
    for n in a2a_sizes:
        plan, t = _clock(lambda: resolve(f"S0:{n}@[0-{n - 1}]", f"S1:{n}@[0-{n - 1}]", (4 * n, 4 * n)))
        messages = sum(1 for s in plan.steps for t_ in s.transfers if t_.src != t_.dst)
        print(f"All-to-all S0:{n} -> S1:{n}: {t:.3f} s to plan, {messages} messages "
              f"({t / max(messages, 1) * 1e6:.1f} us per message)")


def main() -> int:
    quick = "--quick" in sys.argv[1:]
    reps = int(sys.argv[sys.argv.index("--reps") + 1]) if "--reps" in sys.argv[1:] else 3
    dps = (3, 64) if quick else (3, 64, 256)
    for zero in (False, True):
        sizes = [(f"DP{dp} x TP4 x PP4{', ZeRO-1' if zero else ''}",
                  uniform_strategy(60, dp=dp, tp=4, pp=4, micro_batches=4, zero=zero)) for dp in dps]
        if zero:
            sizes.insert(1, ("Table 5 (16 H800 + 32 H20), ZeRO-1", paper_strategy("table5_32b_16h800_32h20")))
        scaling(sizes, reps)
    program_sizes(sizes)
    compiled_job([(f"DP{dp} x TP4 x PP4, ZeRO-1", uniform_strategy(60, dp=dp, tp=4, pp=4, micro_batches=4, zero=True))
                  for dp in ((3, 16) if quick else (3, 64, 256))])
    parse_and_all_to_all([256] if quick else [256, 1024])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
