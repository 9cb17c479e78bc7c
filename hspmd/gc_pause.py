"""Planning pauses the cyclic garbage collector and runs one young collection at the end.

Specializing a large job, or planning one large reshard, makes hundreds of thousands of objects
(annotations, plans, messages, programs) and almost no cyclic garbage, in a process that already
holds the graph. CPython collects every 700 net allocations and runs a full collection each time
the long-lived objects grow by a quarter, walking the whole heap, graph included: at 4,096 ranks
that was a third of a rank's specialization time, and 60% of planning one all-to-all over 256
devices (65,280 messages), and it finds nothing to free. `collector_paused` turns automatic
collection off for the block and, on leaving it, collects the youngest generation once (the
objects the block made: cyclic garbage among them is freed there), so the block pays one walk of
what it made instead of many walks of everything. Reference counting frees the rest as usual.
Used by `specialize_graph`, `comm_resolve.resolve` and `resolve_many`; a base module, so that
every layer may.
"""

from __future__ import annotations

import gc
from contextlib import contextmanager
from typing import Iterator


@contextmanager
def collector_paused() -> Iterator[None]:
    """Automatic collection off inside the block, one collection of the youngest generation at its
    end. Does nothing where collection is already off (the caller's choice, or an enclosing block:
    another thread may be inside one), so it never turns on what someone else turned off."""
    if not gc.isenabled():
        yield
        return
    gc.disable()
    try:
        yield
    finally:
        gc.enable()
        gc.collect(0)


__all__ = ["collector_paused"]
