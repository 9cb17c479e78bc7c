"""File integrity helpers shared by every checkpoint format: per-tensor checksums,
durable atomic writes (fsync of the file before the rename, of the directory after), and removal
of temporary files left by writers that are no longer running."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from hspmd.runtime.persistence import integrity
from hspmd.runtime.persistence.integrity import atomic_write, remove_stale_temporaries, tensor_checksum


def test_checksums_do_not_depend_on_layout_but_on_dtype_shape_and_bytes():
    t = torch.randn(4, 6)
    assert tensor_checksum(t.t()) == tensor_checksum(t.t().contiguous())
    assert tensor_checksum(t) != tensor_checksum(t.reshape(6, 4))
    assert tensor_checksum(t) != tensor_checksum(t.double())
    assert tensor_checksum(torch.zeros(0)) != tensor_checksum(torch.zeros(0, 2))
    flipped = t.clone()
    flipped.view(torch.int32)[1, 2] ^= 1
    assert tensor_checksum(flipped) != tensor_checksum(t)
    assert tensor_checksum(torch.ones(3, dtype=torch.bfloat16)) == tensor_checksum(torch.ones(3, dtype=torch.bfloat16))


def test_atomic_write_fsyncs_the_file_before_the_rename_and_the_directory_after(tmp_path, monkeypatch):
    events = []
    real_fsync, real_replace = os.fsync, os.replace
    monkeypatch.setattr(integrity.os, "fsync", lambda fd: (events.append(("fsync", os.readlink(f"/proc/self/fd/{fd}"))), real_fsync(fd)))
    monkeypatch.setattr(integrity.os, "replace", lambda a, b: (events.append(("replace", b)), real_replace(a, b)))
    path = tmp_path / "out.bin"
    atomic_write(path, lambda tmp: open(tmp, "wb").write(b"data"))
    assert [e[0] for e in events] == ["fsync", "replace", "fsync"]
    assert events[0][1].startswith(str(path) + ".tmp-") and events[2][1] == str(tmp_path)
    assert path.read_bytes() == b"data"


def test_a_failing_write_keeps_the_old_file_and_leaves_no_temporary(tmp_path):
    path = tmp_path / "out.bin"
    path.write_bytes(b"old")

    def broken(tmp):
        open(tmp, "wb").write(b"half")
        raise OSError("disk full")

    with pytest.raises(OSError):
        atomic_write(path, broken)
    assert path.read_bytes() == b"old" and os.listdir(tmp_path) == ["out.bin"]


def test_temporaries_of_dead_writers_are_removed_and_live_ones_kept(tmp_path):
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    path = tmp_path / "ck.safetensors"
    stale = tmp_path / f"ck.safetensors.tmp-{int(dead.stdout)}"
    live = tmp_path / f"ck.safetensors.tmp-{os.getppid()}"
    other = tmp_path / "other.safetensors.tmp-1"
    for f in (stale, live, other):
        f.write_bytes(b"partial")
    atomic_write(path, lambda tmp: open(tmp, "wb").write(b"new"))
    assert not stale.exists() and live.exists() and other.exists()
    assert remove_stale_temporaries(path) == [] and path.read_bytes() == b"new"
