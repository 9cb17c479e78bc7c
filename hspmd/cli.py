"""The `hspmd` command: explain a reshard, launch a multi-process job, run the demo.

Every subcommand runs inside one wrapper (`main`): a user's mistake (an HSPMDError, including a
bad command line) prints one line `hspmd: error: ...` on stderr and exits 2, never a traceback; an
unexpected exception (a bug in hspmd) prints one line and exits 1, and HSPMD_TRACEBACK=1 shows
the traceback."""

from __future__ import annotations

import os
import sys
import traceback

from hspmd.errors import HSPMDError, UsageError, error_line
from hspmd.limits import brief

USAGE = """usage: hspmd COMMAND ...

commands:
  explain SRC DST --shape 8,6 [--topology 2x4] [--json]   the communication plan between two annotations
  run -n N [--backend gloo|nccl|cupy] script.py [args]  launch N local processes (rendezvous on 127.0.0.1)
  run --nnodes M --node-rank K --master-addr HOST -n N script.py   the same on each node of a multi-node job
  authority --addr HOST --port P                        an elastic multi-node job's store and membership authority
  demo                                                  the main job (heterogeneous multi-process training)
  checkpoint export-hf CHECKPOINT DIR [--config PATH]   a Llama checkpoint as a Hugging Face directory
  checkpoint inspect DIR | consolidate DIR OUT           sharded checkpoints: contents, or one plain file
  data prepare INPUT... --out PREFIX [--tokenizer DIR]  tokenize text into memory-mapped token files
  data inspect PREFIX [--verify]                        what a prepared dataset holds
  simulate STRATEGY [--cluster C] [--model M] [--png F] simulate one step: per-rank compute/comm/idle, memory
  show STRATEGY|TRACE [--trace T] [--png F]             strategy map, simulated and measured timelines
  calibrate [--out calibration.json]                    fit the cost model to this machine
  compile STRATEGY --out DIR [--print RANK]             one program (JSON) per rank of the tiny Llama
  run-programs DIR [--steps N]                          run them, one gloo process per rank, from the files alone
  plan --cluster C --model M --global-batch N [--search dp|dfs|mcts|all] [--out plan.yaml] [--png plan.png]
       [--calibration calibration.json]                 (emulated clusters: price ops with this host's measured costs)
                                                        search a strategy; compare with the uniform baseline
"""

EXIT_USAGE = 2
EXIT_BUG = 1


def _explain(rest: list[str]) -> int:
    from hspmd.comm_resolve.explain import main as explain_main

    return explain_main(rest)


def _run(rest: list[str]) -> int:
    from hspmd.runtime.processes.launcher import main as run_main

    return run_main(rest)


def _authority(rest: list[str]) -> int:
    from hspmd.runtime.processes.authority import main as authority_main

    return authority_main(rest)


def _checkpoint(rest: list[str]) -> int:
    from hspmd.runtime.persistence.checkpoint_tool import main as checkpoint_main

    return checkpoint_main(rest)


def _data(rest: list[str]) -> int:
    from hspmd.runtime.data.tool import main as data_main

    return data_main(rest)


def _demo(rest: list[str]) -> int:
    from hspmd.demo import main as demo_main

    return demo_main(rest)


def _programs_command(name: str):
    def command(rest: list[str]) -> int:
        from hspmd.runtime.programs import tool as program_tool

        return {"compile": program_tool.compile_main, "run-programs": program_tool.run_main}[name](rest)

    return command


def _plan(rest: list[str]) -> int:
    from hspmd.planning.search.command import main as plan_main

    def draw(strategy, cost, path) -> None:  # matplotlib is loaded only when a picture is asked for
        from hspmd.show import draw_plan

        draw_plan(strategy, cost, path)

    def calibrated(path, cluster, model):  # the calibration is a runtime value: read above the planning layer
        from hspmd.runtime.policies.calibration import Calibration

        return Calibration.load(path).cost_model_for(cluster, model)

    return plan_main(rest, draw=draw, calibrated=calibrated)


def _show_command(name: str):
    def command(rest: list[str]) -> int:
        from hspmd import show

        return {"simulate": show.simulate_main, "show": show.show_main, "calibrate": show.calibrate_main}[name](rest)

    return command


COMMANDS = {
    "explain": _explain,
    "run": _run,
    "authority": _authority,
    "checkpoint": _checkpoint,
    "data": _data,
    "demo": _demo,
    "plan": _plan,
    "compile": _programs_command("compile"),
    "run-programs": _programs_command("run-programs"),
    "simulate": _show_command("simulate"),
    "show": _show_command("show"),
    "calibrate": _show_command("calibrate"),
}


def _dispatch(argv: list[str]) -> int:
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE)
        return 0
    command, rest = argv[0], argv[1:]
    if command not in COMMANDS:
        raise UsageError(f"unknown command {brief(command)}; commands: {', '.join(COMMANDS)} (see hspmd --help)")
    return COMMANDS[command](rest)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        return _dispatch(argv)
    except HSPMDError as exc:
        print(f"hspmd: error: {error_line(exc)}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        print("hspmd: interrupted", file=sys.stderr)
        return 130
    except (SystemExit, GeneratorExit):
        raise
    except Exception as exc:  # a bug in hspmd, not the user's input: still one line
        if os.environ.get("HSPMD_TRACEBACK"):
            traceback.print_exc()
        print(f"hspmd: internal error: {type(exc).__name__}: {error_line(exc)} (HSPMD_TRACEBACK=1 shows where)",
              file=sys.stderr)
        return EXIT_BUG


if __name__ == "__main__":
    sys.exit(main())
