"""The `hspmd` command: explain a reshard, launch a multi-process job, run the demo."""

from __future__ import annotations

import sys

USAGE = """usage: hspmd COMMAND ...

commands:
  explain SRC DST --shape 8,6 [--topology 2x4] [--json]   the communication plan between two annotations
  run -n N [--backend gloo|nccl] script.py [args ...]    launch N local processes (rendezvous on 127.0.0.1)
  demo                                                  the main job (heterogeneous multi-process training)
  checkpoint export-hf CHECKPOINT DIR [--config PATH]   a Llama checkpoint as a Hugging Face directory
  checkpoint inspect DIR | consolidate DIR OUT           sharded checkpoints: contents, or one plain file
  simulate STRATEGY [--cluster C] [--model M] [--png F] simulate one step: per-rank compute/comm/idle, memory
  show STRATEGY|TRACE [--trace T] [--png F]             strategy map, simulated and measured timelines
  calibrate [--out calibration.json]                    fit the cost model to this machine
  plan --cluster C --model M --global-batch N [--search dp|dfs|mcts|all] [--out plan.yaml]
                                                        search a strategy; compare with the uniform baseline
"""


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE)
        return 0
    command, rest = argv[0], argv[1:]
    if command == "explain":
        from hspmd.comm_resolve.explain import main as explain_main

        return explain_main(rest)
    if command == "run":
        from hspmd.runtime.launcher import main as run_main

        return run_main(rest)
    if command == "checkpoint":
        from hspmd.runtime.checkpoint_tool import main as checkpoint_main

        return checkpoint_main(rest)
    if command == "plan":
        from hspmd.planning.search.command import main as plan_main

        return plan_main(rest)
    if command == "demo":
        from hspmd.demo import main as demo_main

        return demo_main(rest)
    if command in ("simulate", "show", "calibrate"):
        from hspmd import show

        return {"simulate": show.simulate_main, "show": show.show_main, "calibrate": show.calibrate_main}[command](rest)
    print(f"hspmd: unknown command {command!r}\n\n{USAGE}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
