"""HeartbeatMonitor on a real job store: a rank whose counter stands still for `interval` is named,
unless it marked itself leaving (its interpreter is exiting), which it may do for LEAVING_GRACE_S."""

from hspmd.backends import heartbeat
from hspmd.backends.heartbeat import HeartbeatMonitor, beat_key, leaving_key
from hspmd.backends.store import new_secret, open_store


def test_a_silent_rank_is_named_and_a_leaving_one_only_after_its_grace(monkeypatch):
    monkeypatch.setattr(heartbeat, "LEAVING_GRACE_S", 10.0)
    store = open_store("127.0.0.1", 0, True, new_secret().encode(), timeout=10)
    try:
        monitor = HeartbeatMonitor(store, [0, 1], interval=2.0, check_every=0.0)
        for rank in (0, 1):
            store.add(beat_key(rank), 1)
        assert monitor.stopped(now=100.0) == []  # first beats seen
        store.add(beat_key(1), 1)
        assert monitor.stopped(now=101.0) == []
        store.set(leaving_key(0), "1")  # rank 0 is exiting; rank 1 beats on
        store.add(beat_key(1), 1)
        assert monitor.stopped(now=102.5) == []  # rank 0 silent 2.5 s, over the interval: but leaving
        store.add(beat_key(1), 1)
        assert monitor.stopped(now=109.0) == []
        store.add(beat_key(1), 1)
        assert [rank for rank, _ in monitor.stopped(now=110.5)] == [0]  # silent past the grace: named
        assert monitor.stopped(now=113.0) == [(0, 13.0), (1, 2.5)]  # rank 1 stopped beating too, not leaving
        monitor.restarted(0)  # a new process in rank 0's slot is not leaving
        assert not store.check([leaving_key(0)])
    finally:
        store.server.close()
