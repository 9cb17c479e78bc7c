"""`hspmd run`: per-rank output, fail-fast with the failing rank's error, no process left behind.

Most tests call the launcher in-process (ranks are still real processes); one goes through the
`hspmd` command line, where it also checks that Ctrl-C stops every rank."""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

from hspmd.backends.from_env import backend_from_env, check_backend
from hspmd.cli import main as cli_main
from hspmd.errors import HSPMDError
from hspmd.runtime.processes.launcher import main as launcher_main

REPO = Path(__file__).resolve().parents[1]


def hspmd_run(*args: str, **popen) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "hspmd.cli", "run", *args],
        cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **popen,
    )


def write_script(tmp_path: Path, body: str) -> Path:
    script = tmp_path / "job.py"
    script.write_text(textwrap.dedent(body))
    return script


def alive(pid: int) -> bool:
    """True for a running process; a zombie (already dead, waiting to be reaped) counts as gone."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return False
    return state != "Z"


def wait_for_files(folder: Path, names: list[str], timeout: float = 120.0) -> None:
    """A start-up hang detector (ranks import torch, which takes seconds alone and far longer on a
    busy machine), not a timing."""
    end = time.monotonic() + timeout
    while not all((folder / n).exists() and (folder / n).read_text() for n in names):
        assert time.monotonic() < end, f"ranks never wrote {names} to {folder}"
        time.sleep(0.05)


# Every rank records its pid; rank 0 also starts a grandchild; all of them would live for minutes.
RECORD_PIDS = """
    import os, subprocess, sys, time
    from pathlib import Path
    rank = int(os.environ["RANK"])
    pids = Path(sys.argv[1])
    if rank == 0:
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"])
        (pids / "grandchild").write_text(str(child.pid))
    (pids / f"rank{rank}").write_text(str(os.getpid()))
"""


def test_each_rank_output_is_prefixed_and_gets_torchrun_variables(tmp_path, capsys):
    script = write_script(tmp_path, """
        import os, sys
        print(f"hello from {os.environ['RANK']} of {os.environ['WORLD_SIZE']} local {os.environ['LOCAL_RANK']}"
              f" at {os.environ['MASTER_ADDR']} with {os.environ['HSPMD_BACKEND']} args {sys.argv[1:]}")
        print(f"note from {os.environ['RANK']}", file=sys.stderr)
    """)
    code = launcher_main(["-n", "3", str(script), "--flag", "x"])
    out, err = capsys.readouterr()
    assert code == 0, err
    for rank in range(3):
        assert f"[rank {rank}] hello from {rank} of 3 local {rank} at 127.0.0.1 with gloo args ['--flag', 'x']" in out
        assert f"[rank {rank}] note from {rank}" in err
    assert all(line.startswith("[rank ") for line in out.splitlines())


def test_a_failing_rank_stops_the_job_shows_its_error_and_leaves_no_process(tmp_path, capsys):
    pids = tmp_path / "pids"
    pids.mkdir()
    script = write_script(tmp_path, RECORD_PIDS + """
    if rank == 1:
        while not all((pids / f).exists() for f in ("rank0", "rank2", "grandchild")):
            time.sleep(0.02)
        raise RuntimeError("rank one exploded on purpose")
    if rank == 2:
        import signal
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # must be SIGKILLed after the grace period
    time.sleep(300)
    """)
    start = time.monotonic()
    code = launcher_main(["-n", "3", "--grace", "1", str(script), str(pids)])
    elapsed = time.monotonic() - start
    out, err = capsys.readouterr()
    assert code == 1
    assert "[rank 1] RuntimeError: rank one exploded on purpose" in err
    assert "rank 1 exited with exit code 1" in err
    assert err.rstrip().endswith("RuntimeError: rank one exploded on purpose")  # repeated in the summary
    # a hang detector, not a timing: without the SIGKILL after the 1 s grace, rank 2 sleeps 300 s
    assert elapsed < 150, f"job took {elapsed:.1f}s to stop: rank 2 was not killed after the grace period"
    recorded = [int((pids / name).read_text()) for name in ("rank0", "rank1", "rank2", "grandchild")]
    assert not [pid for pid in recorded if alive(pid)]


def test_interrupting_the_launcher_stops_every_rank(tmp_path):
    pids = tmp_path / "pids"
    pids.mkdir()
    script = write_script(tmp_path, RECORD_PIDS + """
    time.sleep(300)
    """)
    proc = hspmd_run("-n", "2", str(script), str(pids))
    wait_for_files(pids, ["rank0", "rank1", "grandchild"])
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=150)  # the ranks sleep 300 s unless they are stopped
    assert proc.returncode == 130
    assert "interrupted" in err
    recorded = [int((pids / name).read_text()) for name in ("rank0", "rank1", "grandchild")]
    assert not [pid for pid in recorded if alive(pid)]


def test_a_rank_killed_by_a_signal_fails_the_job(tmp_path, capsys):
    script = write_script(tmp_path, """
        import os, signal, time
        if os.environ["RANK"] == "0":
            os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(300)
    """)
    code = launcher_main(["-n", "2", "--grace", "1", str(script)])
    assert code == 128 + signal.SIGKILL
    err = capsys.readouterr().err
    assert "rank 0 exited with signal SIGKILL" in err


def test_a_missing_script_is_a_usage_error(tmp_path, capsys):
    assert cli_main(["run", "-n", "2", str(tmp_path / "nope.py")]) == 2
    err = capsys.readouterr().err
    assert "does not exist" in err and err.count("\n") == 1 and err.startswith("hspmd: error: ")
    assert cli_main(["run", "-n", "2"]) == 2
    assert "give the Python script every rank runs" in capsys.readouterr().err


@pytest.mark.multiprocess
def test_a_script_joins_the_job_through_init_from_env(tmp_path, capsys, monkeypatch):
    script = write_script(tmp_path, """
        import torch
        from hspmd.backends.torch_join import init_from_env
        backend = init_from_env(timeout=30)
        total = backend.all_reduce(torch.tensor([backend.rank + 1.0]), tuple(range(backend.world_size)))
        print(f"rank {backend.rank} of {backend.world_size} sum {total.item():g}")
        backend.shutdown()
    """)
    monkeypatch.setenv("PYTHONPATH", str(REPO))
    code = launcher_main(["-n", "2", str(script)])
    out, err = capsys.readouterr()
    assert code == 0, err
    assert "[rank 0] rank 0 of 2 sum 3" in out
    assert "[rank 1] rank 1 of 2 sum 3" in out


@pytest.mark.multiprocess
def test_a_script_joins_with_the_backend_hspmd_run_chose(tmp_path, capsys, monkeypatch):
    script = write_script(tmp_path, """
        import os, torch
        from hspmd.backends.from_env import backend_from_env
        backend = backend_from_env(timeout=30)
        total = backend.all_reduce(torch.tensor([backend.rank + 1.0]), tuple(range(backend.world_size)))
        print(os.environ["HSPMD_BACKEND"], type(backend).__name__, backend.device, f"sum {total.item():g}")
        backend.shutdown()
    """)
    monkeypatch.setenv("PYTHONPATH", str(REPO))
    code = launcher_main(["-n", "2", "--backend", "gloo", str(script)])
    out, err = capsys.readouterr()
    assert code == 0, err
    assert "[rank 0] gloo TorchDistBackend cpu sum 3" in out and "[rank 1] gloo TorchDistBackend cpu sum 3" in out


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU: the backends would start")
@pytest.mark.parametrize("backend", ["nccl", "cupy"])
def test_a_gpu_backend_without_a_gpu_is_refused_in_one_line_before_any_rank_starts(tmp_path, capsys, backend):
    started = tmp_path / "started"
    script = write_script(tmp_path, f"open({str(started)!r}, 'w').close()\n")
    assert cli_main(["run", "-n", "2", "--backend", backend, str(script)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("hspmd: error: backend ") and err.count("\n") == 1, err
    assert ("CuPy" if backend == "cupy" else "needs a CUDA GPU") in err
    assert not started.exists()


def test_check_backend_says_what_the_machine_lacks():
    check_backend("gloo", 64, cuda_devices=0, has_cupy=False)
    check_backend("nccl", 2, cuda_devices=2)
    check_backend("cupy", 2, cuda_devices=8, has_cupy=True)
    for args, kwargs, says in [
        (("nccl", 1), dict(cuda_devices=0), "needs a CUDA GPU and none is visible"),
        (("cupy", 1), dict(cuda_devices=0, has_cupy=True), "needs a CUDA GPU and none is visible"),
        (("cupy", 1), dict(cuda_devices=4, has_cupy=False), "needs CuPy with NCCL"),
        (("nccl", 4), dict(cuda_devices=2), "4 local ranks but 2 GPU"),
        (("mpi", 1), {}, "unknown backend 'mpi'"),
    ]:
        with pytest.raises(HSPMDError, match=says) as info:
            check_backend(*args, **kwargs)
        assert "\n" not in str(info.value)


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU")
def test_a_rank_asking_for_nccl_without_a_gpu_gets_one_line(monkeypatch):
    monkeypatch.setenv("HSPMD_BACKEND", "nccl")
    with pytest.raises(HSPMDError, match="needs a CUDA GPU") as info:
        backend_from_env()
    assert "\n" not in str(info.value)


def wait_until_dead(pids: list[int], timeout: float = 60.0) -> list[int]:
    """The pids still alive after waiting up to `timeout` s (a bound, not a speed test)."""
    end = time.monotonic() + timeout
    while [p for p in pids if alive(p)] and time.monotonic() < end:
        time.sleep(0.1)
    return [p for p in pids if alive(p)]


def test_no_rank_or_grandchild_survives_a_sigkilled_launcher(tmp_path):
    pids = tmp_path / "pids"
    pids.mkdir()
    script = write_script(tmp_path, RECORD_PIDS + """
    time.sleep(300)
    """)
    proc = hspmd_run("-n", "2", str(script), str(pids), start_new_session=True)
    wait_for_files(pids, ["rank0", "rank1", "grandchild"], timeout=90)
    proc.kill()
    proc.wait()
    recorded = [int((pids / name).read_text()) for name in ("rank0", "rank1", "grandchild")]
    assert wait_until_dead(recorded) == []


@pytest.mark.multiprocess
def test_a_frozen_rank_is_named_by_its_missing_heartbeat_not_left_to_time_out(tmp_path):
    """Rank 1 freezes (SIGSTOP) while rank 0 waits for it in an all_reduce whose timeout is 300 s:
    the launcher names rank 1 after the 2 s heartbeat, and rank 0 is not blamed."""
    script = write_script(tmp_path, """
        import os, signal, torch
        from hspmd.backends.torch_join import init_from_env
        backend = init_from_env("gloo")
        print("joined", flush=True)
        if backend.rank == 1:
            os.kill(os.getpid(), signal.SIGSTOP)
        backend.all_reduce(torch.ones(2), (0, 1))
    """)
    proc = hspmd_run("-n", "2", "--heartbeat", "2", str(script))
    out, err = proc.communicate(timeout=240)
    assert proc.returncode != 0
    assert "rank 1 stopped responding (no heartbeat" in err, err
    assert "rank 0 stopped" not in err and "rank 0 exited" not in err


@pytest.mark.multiprocess
def test_an_elastic_job_kills_a_frozen_rank_and_goes_on(tmp_path):
    """Rank 1 freezes; under --elastic its missing heartbeat gets it killed and its death announced
    (a frozen rank would otherwise keep the job waiting forever); rank 0 finishes the job."""
    script = write_script(tmp_path, """
        import os, signal, time
        from hspmd.backends.torch_join import init_from_env
        backend = init_from_env("gloo")
        if backend.rank == 1:
            os.kill(os.getpid(), signal.SIGSTOP)
        time.sleep(8)
        print("rank", backend.rank, "done", flush=True)
    """)
    proc = hspmd_run("-n", "2", "--elastic", "--heartbeat", "2", str(script))
    out, err = proc.communicate(timeout=240)
    assert proc.returncode == 0, err
    assert "rank 1 stopped responding (no heartbeat" in err and "killed it" in err, err
    assert "rank(s) [1] died (signal SIGKILL" in err, err
    assert "rank 0 done" in out and "rank 1 done" not in out


def test_a_rank_killed_by_a_signal_without_a_name_is_described_by_number():
    from hspmd.runtime.processes.rank_watch import describe_exit
    assert describe_exit(-40) == "signal 40"
    assert describe_exit(-9) == "signal SIGKILL"


def test_stopping_a_group_stops_what_its_leader_started_even_one_that_ignores_sigterm():
    """process_groups.stop_groups: SIGTERM to each leader's whole group, SIGKILL after the grace,
    every leader reaped and no process of its group left (a grandchild that ignores SIGTERM
    included); a signal handler cannot be set off the main thread, so none is."""
    import threading

    from hspmd.runtime.processes.process_groups import StopRequest, group_alive, install_stop_handlers, stop_groups

    code = ("import subprocess, sys, time\n"
            "child = subprocess.Popen([sys.executable, '-c', 'import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
            "print(1, flush=True); time.sleep(60)'], stdout=subprocess.PIPE)\n"
            "child.stdout.readline()\n"
            "print('started', flush=True)\n"
            "time.sleep(60)\n")
    leader = subprocess.Popen([sys.executable, "-c", code], start_new_session=True, stdout=subprocess.PIPE, text=True)
    assert leader.stdout.readline().strip() == "started"
    assert group_alive(leader.pid)
    start = time.monotonic()
    stop_groups([leader], grace=0.5)
    assert leader.returncode is not None and not group_alive(leader.pid)
    assert 0.5 <= time.monotonic() - start < 10.0  # the grandchild outlived SIGTERM until the grace ran out
    leader.stdout.close()
    handlers: list = []
    worker = threading.Thread(target=lambda: handlers.append(install_stop_handlers(StopRequest())))
    worker.start()
    worker.join()
    assert handlers == [{}]


@pytest.mark.multiprocess
def test_each_job_gets_its_own_secret_and_ranks_share_it(tmp_path, capsys):
    script = write_script(tmp_path, """
        import os
        print("secret", os.environ["HSPMD_JOB_SECRET"], os.environ["HSPMD_STORE_HOSTED"])
    """)
    secrets_seen = []
    for _ in range(2):
        assert launcher_main(["-n", "2", str(script)]) == 0
        out = capsys.readouterr().out
        lines = [line.split()[-2:] for line in out.splitlines() if "secret" in line]
        assert len(lines) == 2 and lines[0] == lines[1] and lines[0][1] == "1" and len(lines[0][0]) == 64
        secrets_seen.append(lines[0][0])
    assert secrets_seen[0] != secrets_seen[1]
