"""`hspmd demo` (`make demo`): heterogeneous training of a small Llama on 4 local gloo processes.

Training changes strategy mid-run without a restart: a planned hot switch to a long-sequence
strategy and back (each one fused BSR of every weight and optimizer state), then rank 3's process
really dies (SIGKILL inside a step, as a failing GPU takes its process with it) and the other three
ranks notice, re-form their groups without it, recover its pieces from replicas and finish the run
(`hspmd run --elastic`). Before training it shows what hspmd works from: a few of the model's annotations under the
strategy (asymmetric unions across the two pipelines), the plan of the once-per-step gradient
synchronisation between the pipelines (as `hspmd explain` prints it) and the 1F1B schedule of the
two-stage pipeline. Then it runs `hspmd run -n 4 examples/llama/train.py` through the launcher
on token files (the shipped documents prepared as bytes at start, or --data: each rank reads only
its pipeline's rows, and the loader's position survives the switches and the recovery) and ends
with a summary: how the loss moved and where the checkpoint is. A last phase trains on a
long-tailed corpus with a strategy per step (examples/mixed_length): each step's chosen strategy,
its dispatch of sequences to pipelines and micro-batches, and the switches.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Sequence

from hspmd.arguments import ArgumentParser, non_negative_int, positive_int
from hspmd.errors import HSPMDError, error_line

STRATEGY = "name=hetero-4 ; layers=4 ; 2x4: R0,1 L0-3 ; 2x2: R2 L0-1 | R3 L2-3"
# For long sequences: every device on one pipeline (TP2 x PP2), the same 12 rows per step.
LONG_SEQUENCE_STRATEGY = "name=long-seq ; layers=4 ; 4x3: R0,1 L0-1 | R2,3 L2-3"
SHOWN_ANNOTATIONS = ("tokens", "embed", "layers.0.wq", "layers.0.wo", "layers.1.out", "lm_head")
HIDDEN = 64


def example_script(example: str = "llama") -> Path:
    """examples/<example>/train.py of the source tree this package runs from."""
    path = Path(__file__).resolve().parents[1] / "examples" / example / "train.py"
    if not path.is_file():
        raise HSPMDError(f"the demo needs the example {path}, which is not there: run it from a source checkout of hspmd")
    return path


def _rule(title: str) -> None:
    print(f"\n== {title} " + "=" * max(0, 78 - len(title)))


def show_plan() -> None:
    """The strategy, a few annotations, one communication plan and the schedule."""
    from hspmd.comm_resolve.explain import main as explain
    from hspmd.models.llama import LlamaConfig, llama_annotations
    from hspmd.models.llama_annotations import gradient_annotation
    from hspmd.specialize.schedules import describe_schedule
    from hspmd.specialize.strategy_render import describe_strategy
    from hspmd.specialize.strategy_text import parse_strategy

    strategy = parse_strategy(STRATEGY)
    _rule("strategy")
    print(f"  {STRATEGY}")
    print(describe_strategy(strategy).rstrip())
    _rule("annotations (the model is written once; these say how each tensor is laid out)")
    annotations = llama_annotations(LlamaConfig(layers=strategy.num_layers, hidden=HIDDEN), strategy)
    for name in SHOWN_ANNOTATIONS:
        print(f"  {name:14s} {annotations[name]}")
    gradient = gradient_annotation(strategy, 0, "column")
    print(f"  {'grad wq':14s} {gradient}   (one summand per pipeline until the step's sync)")
    _rule("plan of the gradient sync of layers.0.wq (hspmd explain)")
    sys.stdout.flush()
    explain([str(gradient), str(annotations["layers.0.wq"]), "--shape", f"{HIDDEN},{HIDDEN}"])
    _rule("1F1B schedule of pipeline 1 (rank 2 -> rank 3)")
    pipeline = strategy.pipelines[1]
    print(describe_schedule("1f1b", len(pipeline.stages), pipeline.micro_batches))


def show_recovery() -> None:
    """Elastic training at paper scale: GPU 31 of Table 7's C1 fails; the recovered strategy is
    the paper's C2, and every weight still has a copy in the other pipeline."""
    from hspmd.specialize.paper_strategies import paper_strategy
    from hspmd.specialize.strategy_text import format_strategy
    from hspmd.switching import recover_strategy

    _rule("elastic recovery at paper scale (Table 7): GPU 31 of C1 fails")
    c1 = paper_strategy("table7_c1")
    recovered = recover_strategy(c1, [31])
    print(f"  C1:        {format_strategy(c1)}")
    print(f"  recovered: {format_strategy(recovered)}")
    same = format_strategy(recovered).split(";", 1)[1] == format_strategy(paper_strategy("table7_c2")).split(";", 1)[1]
    print(f"  equal to the paper's C2: {same}; the lost stage's weights come from pipeline 0 (HD unions, ZeRO off)")


def show_mixed_length(steps: int, data: str | None = None) -> int:
    """Mixed-length training (Hetu v2 §7.3): the paper's selection rule at 32K context, then
    4 gloo processes on the long-tailed corpus, each step's strategy, dispatch and switches."""
    from hspmd.planning.dispatch import select_entry
    from hspmd.planning.paper_pools import paper_pool
    from hspmd.runtime.processes.launcher import launch

    _rule("mixed-length training: a strategy per step (Hetu-B, Tables 11/12)")
    pool = paper_pool("table11")
    picks = ", ".join(f"{k}K -> {pool[select_entry(pool, k * 1024)].name}" for k in (3, 5, 15, 17, 31))
    print(f"  the paper's rule at 32K context (by the step's longest sequence): {picks}")
    script = example_script("mixed_length")
    _rule(f"training: hspmd run -n 4 {script.relative_to(script.parents[2])} --steps {steps}")
    sys.stdout.flush()
    code = launch([sys.executable, str(script), "--steps", str(steps), *(["--data", data] if data else [])], 4,
                  backend="gloo")
    if code != 0:
        print(f"hspmd demo: mixed-length training failed (exit code {code}); the failing rank's error is above",
              file=sys.stderr)
    return code


def main(argv: Sequence[str] | None = None) -> int:
    parser = ArgumentParser(prog="hspmd demo", description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=positive_int, default=60, help="training steps (default 60)")
    parser.add_argument("--schedule", default="1f1b", choices=("1f1b", "gpipe"))
    parser.add_argument("--switch-at", type=non_negative_int, default=20,
                        help="hot-switch to a long-sequence strategy after this step, back 20 steps later (0: never)")
    parser.add_argument("--kill-at", type=non_negative_int, default=50,
                        help="rank 3's process SIGKILLs itself inside this step; the others recover and finish (0: never)")
    parser.add_argument("--out", default=os.path.join("runs", "demo"), help="where the checkpoint and summary go")
    parser.add_argument("--data", default=None, metavar="PREFIX",
                        help="token files from `hspmd data prepare` for both trainings (default: the shipped documents, "
                             "prepared as bytes at start)")
    parser.add_argument("--mixed-steps", type=non_negative_int, default=6,
                        help="steps of the mixed-length phase (a strategy per step; 0: skip it)")
    args = parser.parse_args(list(sys.argv[1:] if argv is None else argv))
    from hspmd.runtime.processes.launcher import launch

    began = time.monotonic()
    try:
        script = example_script()
        show_plan()
        show_recovery()
    except HSPMDError as exc:
        print(f"hspmd: error: {error_line(exc)}", file=sys.stderr)
        return 2
    os.makedirs(args.out, exist_ok=True)
    checkpoint = os.path.join(args.out, "llama.safetensors")
    summary_path = os.path.join(args.out, "summary.json")
    if os.path.exists(summary_path):
        os.remove(summary_path)
    command = [sys.executable, str(script), "--steps", str(args.steps), "--schedule", args.schedule,
               "--strategy", STRATEGY, "--checkpoint", checkpoint, "--summary", summary_path,
               "--log-every", str(max(1, args.steps // 12))]
    if 0 < args.switch_at < args.steps:
        command += ["--switch", f"{args.switch_at}={LONG_SEQUENCE_STRATEGY}"]
        if args.switch_at + 20 < args.steps:
            command += ["--switch", f"{args.switch_at + 20}={STRATEGY}"]
    if 0 < args.kill_at <= args.steps:
        command += ["--kill", f"{args.kill_at}=3"]
    if args.data:
        command += ["--data", args.data]
    _rule(f"training: hspmd run -n 4 --elastic {script.relative_to(script.parents[2])} --steps {args.steps}")
    sys.stdout.flush()
    code = launch(command, 4, backend="gloo", elastic=True)
    if code != 0:
        print(f"hspmd demo: training failed (exit code {code}); the failing rank's error is above", file=sys.stderr)
        return code
    with open(summary_path, encoding="utf-8") as f:
        summary = json.load(f)
    losses = summary["losses"]
    _rule("summary")
    print(f"  loss went from {losses[0]:.4f} (step 1) to {losses[-1]:.4f} (step {summary['steps']}) "
          f"with {summary['schedule']} on {summary['world_size']} gloo processes")
    for failure in summary.get("failures", []):
        print(f"  rank(s) {failure['ranks']} died in step {failure['step']}; ranks {summary['survivors']} recovered in "
              f"{failure['recovery_seconds']:.2f}s without a restart and redid that step under {failure['strategy']}")
    if "data" in summary:
        data = json.loads(summary["data"])
        print(f"  data: each rank read only its pipeline's rows; the loader's position moved with the weights through "
              f"the switches and the recovery; next: epoch {data['epoch']}, sample {data['sample']}")
    print(f"  training {summary['seconds']:.1f}s, demo total {time.monotonic() - began:.1f}s")
    print(f"  checkpoint: {summary['checkpoint']}")
    shown = os.path.relpath(script) if not os.path.relpath(script).startswith("..") else str(script)
    print(f"  continue it: hspmd run -n 4 {shown} --strategy '{summary.get('final_strategy', STRATEGY)}' "
          f"--checkpoint {checkpoint} --resume --steps {args.steps + 20}")
    if args.mixed_steps > 0:
        code = show_mixed_length(args.mixed_steps, args.data)
        if code != 0:
            return code
    return 0


__all__ = ["main", "show_plan"]
