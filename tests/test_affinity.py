"""Pinning local ranks to CPUs: the slices (pure), run_multiprocess's ranks and `hspmd run --pin-cpus`."""

from __future__ import annotations

import os
import textwrap

import pytest
from hypothesis import given, settings, strategies as st

from hspmd.errors import HSPMDError
from hspmd.runtime.processes.affinity import available_cpus, cpu_slices
from hspmd.runtime.processes.launcher import main as launcher_main
from hspmd.runtime.processes.multiprocess import run_multiprocess

pytestmark = pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="CPU affinity is Linux-only")


@settings(max_examples=300, deadline=None)
@given(cpus=st.lists(st.integers(0, 511), min_size=1, max_size=64, unique=True), nprocs=st.integers(1, 80))
def test_slices_are_disjoint_and_cover_every_cpu_or_share_one_cpu_each(cpus, nprocs):
    slices = cpu_slices(cpus, nprocs)
    assert len(slices) == nprocs and all(slices)
    if nprocs <= len(cpus):
        assert [c for s in slices for c in s] == cpus  # disjoint, contiguous, in order, all of them
        assert max(map(len, slices)) - min(map(len, slices)) <= 1
    else:
        assert all(len(s) == 1 for s in slices)
        assert {s[0] for s in slices} == set(cpus)  # every CPU used, each rank always on one


def test_no_cpu_or_no_rank_is_refused_by_name():
    with pytest.raises(HSPMDError, match="cpu_slices"):
        cpu_slices([], 2)
    with pytest.raises(HSPMDError, match="0 ranks"):
        cpu_slices([0, 1], 0)


def report_affinity(backend):
    return sorted(os.sched_getaffinity(0))


@pytest.mark.multiprocess
@pytest.mark.parametrize("nprocs", [2, 3])
def test_run_multiprocess_pins_each_rank_to_its_slice(nprocs):
    expected = [sorted(s) for s in cpu_slices(available_cpus(), nprocs)]
    assert run_multiprocess(report_affinity, nprocs, pin_cpus=True) == expected
    unpinned = run_multiprocess(report_affinity, nprocs)
    assert unpinned == [sorted(available_cpus())] * nprocs


@pytest.mark.multiprocess
def test_hspmd_run_pin_cpus_pins_each_rank(tmp_path, capsys):
    script = tmp_path / "job.py"
    script.write_text(textwrap.dedent("""
        import os
        print(f"rank {os.environ['RANK']} cpus {sorted(os.sched_getaffinity(0))}")
    """))
    assert launcher_main(["-n", "2", "--pin-cpus", str(script)]) == 0
    out = capsys.readouterr().out
    for rank, cpus in enumerate(cpu_slices(available_cpus(), 2)):
        assert f"[rank {rank}] rank {rank} cpus {sorted(cpus)}" in out
