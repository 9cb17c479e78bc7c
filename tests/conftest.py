"""Suite-wide hypothesis defaults: no per-example deadline (CI machines are slow and shared;
example counts are set per property, and speed is measured in benchmarks/, not here), and a fixed
seed per property (Hypothesis's own advice for CI): a property that counts what it accepted asserts
the same counts on every run. `HSPMD_EXPLORE=1` draws fresh examples for a local hunt."""

import os

from hypothesis import HealthCheck, settings

pytest_plugins = ["tests.job_store"]  # the `store` fixture of the store tests

settings.register_profile("hspmd", deadline=None, suppress_health_check=[HealthCheck.too_slow],
                          derandomize=os.environ.get("HSPMD_EXPLORE") != "1")
settings.load_profile("hspmd")


def pytest_collection_modifyitems(config, items):
    """The long elastic suite (20 kill points, about 20 s each) runs only when asked for by marker
    (`make elastic`: -m elastic_full); `make test` runs its few chosen points instead."""
    if "elastic_full" in (config.getoption("markexpr") or ""):
        return
    kept = [item for item in items if item.get_closest_marker("elastic_full") is None]
    if len(kept) != len(items):
        config.hook.pytest_deselected(items=[item for item in items if item not in kept])
        items[:] = kept
