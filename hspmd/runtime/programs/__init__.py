"""Per-device programs as data: compiling a strategy into one DeviceProgram per rank, running a
program, and the `hspmd compile` / `hspmd run-programs` commands."""
