"""A cheap per-rank trace of a real run, as Chrome trace JSON (Perfetto and chrome://tracing open it).

Each rank records complete events ("ph": "X") with wall-clock microseconds since a shared origin:
F<m> / B<m> per micro-batch of its schedule (category "compute"), the step's update (gradient
sync + optimizer, category "update"), and whatever else a caller wraps in `span`. Recording is two
perf_counter() calls and a list append per event; with no tracer nothing is recorded.

    tracer = Tracer(rank)                      # origin: time.time() at construction
    trainer.tracer = tracer                    # the trainer records F/B and the update
    ...
    write_trace(path, [tracer.events for every rank])   # e.g. gathered by run_multiprocess

`read_trace(path)` gives the events back per rank, which `hspmd show` draws.
"""

from __future__ import annotations

import json
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Iterable, Iterator

from hspmd.errors import HSPMDError


class Tracer:
    """Records this rank's events; `origin` (seconds since the epoch) aligns ranks' clocks."""

    def __init__(self, rank: int, origin: float | None = None):
        self.rank = rank
        self.origin = time.time() if origin is None else origin
        self._offset = time.time() - time.perf_counter()
        self.events: list[dict] = []

    def now_us(self) -> float:
        return (time.perf_counter() + self._offset - self.origin) * 1e6

    @contextmanager
    def span(self, name: str, cat: str = "compute", **args) -> Iterator[None]:
        start = self.now_us()
        try:
            yield
        finally:
            self.events.append({"name": name, "cat": cat, "ph": "X", "ts": start, "dur": self.now_us() - start,
                                "pid": self.rank, "tid": 0, **({"args": args} if args else {})})

    def clear(self) -> None:
        self.events.clear()


def write_trace(path: str | Path, per_rank: Iterable[Iterable[dict]]) -> None:
    """One Chrome trace file of every rank's events (one process row per rank)."""
    events = []
    for rank_events in per_rank:
        events.extend(rank_events)
    ranks = sorted({e["pid"] for e in events})
    meta = [{"name": "process_name", "ph": "M", "pid": r, "args": {"name": f"rank {r}"}} for r in ranks]
    Path(path).write_text(json.dumps({"traceEvents": meta + events, "displayTimeUnit": "ms"}))


def read_trace(path: str | Path) -> dict[int, list[dict]]:
    """{rank: complete events sorted by start} from a Chrome trace file."""
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, ValueError) as e:
        raise HSPMDError(f"cannot read trace {path}: {e}") from None
    events = data.get("traceEvents", data) if isinstance(data, dict) else data
    out: dict[int, list[dict]] = {}
    for e in events:
        if isinstance(e, dict) and e.get("ph") == "X":
            out.setdefault(int(e.get("pid", 0)), []).append(e)
    if not out:
        raise HSPMDError(f"trace {path} has no complete ('X') events")
    return {r: sorted(v, key=lambda e: e["ts"]) for r, v in sorted(out.items())}


__all__ = ["Tracer", "read_trace", "write_trace"]
