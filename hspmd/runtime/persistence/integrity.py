"""File integrity for everything hspmd writes to disk and reads back: per-tensor checksums, atomic
durable writes, and clean-up of temporary files a killed writer left behind.

Reused by every checkpoint format (whole-tensor checkpoints, sharded checkpoints, model imports):

    digest = tensor_checksum(t)                     # stored next to the tensor, checked on load
    atomic_write(path, lambda tmp: save_file(..., tmp))

atomic_write makes a crash leave either the old file or the new one, never half a file: it writes a
temporary file beside the target, fsyncs it, renames it over the target and fsyncs the directory
(so the rename itself survives a power loss). A writer killed mid-save leaves `<name>.tmp-<pid>`;
the next atomic_write of that name removes such files whose process is gone.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from typing import Callable

import torch

CHECKSUM = "sha256"
_TMP = re.compile(r"\.tmp-([0-9]+)$")


def tensor_checksum(tensor: torch.Tensor) -> str:
    """sha256 of a tensor's dtype, shape and bytes (layout-independent: a strided view hashes like
    its contiguous copy); stored as hex text."""
    t = tensor.detach().to("cpu").contiguous()
    digest = hashlib.sha256(f"{str(t.dtype).removeprefix('torch.')}{tuple(t.shape)}".encode())
    if t.numel():
        digest.update(t.reshape(-1).view(torch.uint8).numpy().data)
    return digest.hexdigest()


def temporary_path(path: str) -> str:
    return f"{path}.tmp-{os.getpid()}"


def _process_alive(pid: int) -> bool:
    if pid == os.getpid():
        return False  # our own leftover: this process is not writing it now
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def remove_stale_temporaries(path: str | os.PathLike) -> list[str]:
    """Remove `<path>.tmp-<pid>` files whose writer process no longer runs; returns the removed
    paths. A live writer's file is left alone (pid reuse can keep a stale file until the next save)."""
    path = os.fspath(path)
    directory, base = os.path.split(os.path.abspath(path))
    removed = []
    try:
        names = os.listdir(directory)
    except OSError:
        return removed
    for name in names:
        if not name.startswith(base + ".tmp-"):
            continue
        match = _TMP.search(name)
        if match and name == f"{base}.tmp-{match[1]}" and not _process_alive(int(match[1])):
            try:
                os.remove(os.path.join(directory, name))
                removed.append(os.path.join(directory, name))
            except FileNotFoundError:
                pass
    return removed


def read_format_document(path: str, expected: str, error: type[Exception], unreadable: str) -> dict:
    """The JSON object in `path` whose "format" field is `expected` (a dataset's manifest, a
    sharded checkpoint's index). `error` names the file: `{path}: {unreadable} ({why})` when it
    cannot be read or parsed, `unknown format` when it holds something else."""
    try:
        with open(path, encoding="utf-8") as f:
            document = json.load(f)
    except (OSError, ValueError) as exc:
        raise error(f"{path}: {unreadable} ({exc})") from None
    if not isinstance(document, dict) or document.get("format") != expected:
        found = document.get("format") if isinstance(document, dict) else type(document).__name__
        raise error(f"{path}: unknown format {found!r} (expected {expected!r})")
    return document


def fsync_path(path: str, directory: bool = False) -> None:
    """Flush a file (or a directory's entries) to stable storage."""
    fd = os.open(path, os.O_RDONLY | (getattr(os, "O_DIRECTORY", 0) if directory else 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write(path: str | os.PathLike, write: Callable[[str], None]) -> None:
    """Call write(temporary path), then durably replace `path` with it (module docstring)."""
    path = os.fspath(path)
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    remove_stale_temporaries(path)
    tmp = temporary_path(path)
    try:
        write(tmp)
        fsync_path(tmp)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise
    fsync_path(directory, directory=True)


__all__ = ["CHECKSUM", "atomic_write", "fsync_path", "remove_stale_temporaries", "temporary_path", "tensor_checksum"]
