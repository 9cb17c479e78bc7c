"""hspmd/gc_pause.py: automatic collection paused inside a specialization, nothing lost after it."""

import gc
import weakref

import pytest

from hspmd.gc_pause import collector_paused


class _Node:
    pass


def _cycle() -> weakref.ref:
    a, b = _Node(), _Node()
    a.other, b.other = b, a
    return weakref.ref(a)


def test_paused_inside_and_cyclic_garbage_made_inside_is_freed_on_leaving():
    assert gc.isenabled()
    with collector_paused():
        assert not gc.isenabled()
        dead = _cycle()
        assert dead() is not None  # only the collector frees a cycle, and it is paused
    assert gc.isenabled()
    assert dead() is None


def test_collection_turned_off_by_someone_else_stays_off():
    gc.disable()
    try:
        with collector_paused():
            assert not gc.isenabled()
        assert not gc.isenabled()
    finally:
        gc.enable()


def test_an_error_inside_turns_collection_back_on():
    with pytest.raises(ValueError):
        with collector_paused():
            raise ValueError("boom")
    assert gc.isenabled()


def test_nested_blocks_leave_collection_to_the_outer_one():
    with collector_paused():
        with collector_paused():
            pass
        assert not gc.isenabled()
    assert gc.isenabled()
