"""Suite-wide hypothesis defaults: no per-example deadline (CI machines are slow and shared;
example counts are set per property, and speed is measured in benchmarks/, not here)."""

from hypothesis import HealthCheck, settings

settings.register_profile("hspmd", deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.load_profile("hspmd")
