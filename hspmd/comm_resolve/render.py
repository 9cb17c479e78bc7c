"""Plans as text a person can read: one line per step, then traffic per device and per link.

The functions read `Plan`, `FusedPlan` and `Step` values by their fields without importing them,
so that plan.py can use this module for the plans' own `explain()` / `str()`."""

from __future__ import annotations

from hspmd.annotations import Box


def seconds_text(t: float) -> str:
    if t == 0:
        return "0"
    for unit, scale in (("s", 1.0), ("ms", 1e-3), ("us", 1e-6)):
        if t >= scale:
            return f"{t / scale:.3g} {unit}"
    return f"{t / 1e-9:.3g} ns"


def bytes_text(n: float) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{n / scale:.3g} {unit}"
    return f"{int(n)} B"


def box_text(box: Box) -> str:
    return "[" + ", ".join(f"{a}:{b}" for a, b in box) + "]"


def groups_text(step, limit: int = 8) -> str:
    groups = step.groups
    text = " ".join("[" + ",".join(map(str, g)) + "]" for g in groups[:limit])
    return text + (f" ... (+{len(groups) - limit})" if len(groups) > limit else "")


def step_details(step) -> list[str]:
    lines = []
    for c in step.collectives:
        parts = "" if not c.parts else " parts " + " ".join(box_text(p) for p in c.parts)
        zeros = f" zero inputs {list(c.zero_inputs)}" if c.zero_inputs else ""
        lines.append(f"{c.kind} {list(c.devices)} box {box_text(c.box)}{parts}{zeros}")
    for t in step.transfers:
        what = "copy" if t.src == t.dst else "send"
        lines.append(f"{what} {t.src} -> {t.dst}: " + " ".join(box_text(b) for b in t.boxes))
    return lines


def _device_lines(plan) -> list[str]:
    sent, received = plan.bytes_sent, plan.bytes_received
    return [
        "bytes sent:     " + "  ".join(f"{d}: {bytes_text(n)}" for d, n in sent.items()),
        "bytes received: " + "  ".join(f"{d}: {bytes_text(n)}" for d, n in received.items()),
        "bytes by link:  " + ("  ".join(f"{k}: {bytes_text(n)}" for k, n in plan.bytes_by_link.items()) or "none"),
        f"estimated time: {seconds_text(plan.estimated_seconds)} (alpha-beta model, ring collectives)",
    ]


def plan_text(plan, details: bool = True) -> str:
    lines = [
        f"plan {plan.src} -> {plan.dst}",
        f"  shape {plan.shape}, {plan.dtype}, topology {plan.topology}",
    ]
    for i, (step, nbytes, t) in enumerate(zip(plan.steps, plan.step_bytes(), plan.step_seconds()), 1):
        where = f" subgroup {step.subgroup}" if step.subgroup is not None else ""
        lines.append(
            f"  {i}. {step.primitive}{where} (round {step.round}) groups {groups_text(step)}"
            f"  {bytes_text(nbytes)}, {seconds_text(t)}"
        )
        lines.append(f"       {step.src} -> {step.dst}")
        if details:
            lines += [f"       {line}" for line in step_details(step)]
    return "\n".join(lines + ["  " + line for line in _device_lines(plan)])


def fused_plan_text(plan) -> str:
    lines = [
        f"fused batched send-receive of {len(plan.moves)} tensors, {plan.dtype}, topology {plan.topology}",
        f"  {plan.messages} messages (one per device pair), {bytes_text(plan.total_bytes)} in all",
    ]
    return "\n".join(lines + ["  " + line for line in _device_lines(plan)])


__all__ = ["box_text", "bytes_text", "fused_plan_text", "groups_text", "plan_text", "seconds_text", "step_details"]
