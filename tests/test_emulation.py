"""Emulated device types on this host: emulation only waits (the same losses, weights and bytes
as a run without it, equal to one device), a slower type waits and a faster one does not, a
message between nodes takes its link's time, a stage over its type's memory fails by name before
any weight changes, and nothing is emulated unless the cluster file asks."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import yaml
import torch

from hspmd.backends.local import LocalWorld
from hspmd.cli import main as cli_main
from hspmd.cluster import ClusterSpec, cluster_from_dict, cluster_from_yaml, cluster_to_dict
from hspmd.cluster.emulation import Emulation
from hspmd.errors import ClusterError, DeviceOutOfMemory, HSPMDError
from hspmd.models.llama import LlamaConfig, build_llama
from hspmd.ops import AdamW
from hspmd.runtime.execution.batches import MicroBatchLayout
from hspmd.runtime.execution.emulation import WAIT_CHUNK_S, EmulatedBackend, RankEmulator, emulated
from hspmd.runtime.execution.trace import Tracer
from hspmd.runtime.processes.multiprocess import run_multiprocess
from hspmd.runtime.training.trainer import Trainer
from hspmd.ops.context import in_token_order
from hspmd.specialize.strategy_text import parse_strategy

SEQ, LR = 8, 1e-2
CONFIG = dict(vocab=32, hidden=16, heads=2, ffn=32)
# two pipelines, each crossing from the fast node (ranks 0, 1) to the slow one (ranks 2, 3)
CROSSING = "layers=4 ; 2x2: R0 L0-1 | R2 L2-3 ; 2x2: R1 L0-1 | R3 L2-3"

CLUSTER_YAML = """
name: two-types
device_types:
  fast: {flops: {float32: 10.0e9}, hbm_bandwidth: 10.0e9, hbm_capacity: 1.0e9}
  slow: {flops: {float32: 4.0e9}, hbm_bandwidth: 4.0e9, hbm_capacity: 1.0e8}
links:
  host: {bandwidth: 5.0e9, latency: 1.0e-5}
  net: {bandwidth: 1.0e8, latency: 2.0e-3}
nodes:
  - {type: fast, devices: 2}
  - {type: slow, devices: 2}
intra: {fast: host, slow: host}
inter: net
"""


def two_types(**emulate) -> ClusterSpec:
    cluster = cluster_from_yaml(CLUSTER_YAML)
    return cluster.with_emulation(Emulation(**{"reference": "fast", **emulate}) if emulate is not None else None)


def batches(steps: int, seed: int = 0):
    rows = MicroBatchLayout.of(parse_strategy(CROSSING)).global_batch_size
    gen = torch.Generator().manual_seed(seed)
    return [(torch.randint(0, CONFIG["vocab"], (rows, SEQ), generator=gen),
             torch.randint(0, CONFIG["vocab"], (rows, SEQ), generator=gen)) for _ in range(steps)]


def make_trainer(backend, text: str = CROSSING) -> Trainer:
    strategy = parse_strategy(text)
    model = build_llama(LlamaConfig(layers=strategy.num_layers, **CONFIG), [strategy], optimizer=AdamW(lr=LR))
    layout = MicroBatchLayout.of(strategy)
    return Trainer(model.graph, 0, backend, layout, schedule="1f1b", symbols={"S": SEQ, "T": layout.global_batch_size * SEQ})


def train_rank(backend, cluster, steps: int):
    """Train on one rank (emulated when the cluster says so): losses, final leaves, the bytes its
    schedule held (activations and send buffers, measured on the tensors), stats, emulated events."""
    torch.set_num_threads(1)
    backend = emulated(backend, cluster)
    trainer = make_trainer(backend)
    tracer = Tracer(backend.rank)
    trainer.tracer = tracer
    if isinstance(backend, EmulatedBackend):
        backend.emulator.tracer = tracer
    losses = [trainer.step({"tokens": x, "labels": y}) for x, y in batches(steps)]
    leaves = {k: v.clone() for k, v in trainer.state.leaves.items()}
    held = (trainer.last_run.peak_held_bytes, trainer.last_run.peak_pending_sends, trainer.last_run.peak_in_flight)
    stats = backend.emulator.stats() if isinstance(backend, EmulatedBackend) else None
    emulated_events = [e for e in tracer.events if e["cat"] == "emulated"]
    return losses, leaves, held, stats, emulated_events


def test_emulation_is_off_unless_the_cluster_asks():
    world = LocalWorld(range(4))
    plain = cluster_from_yaml(CLUSTER_YAML)
    assert plain.emulation is None and plain.slowdown(3) == 1.0 and plain.emulated_memory(3) is None
    assert all(emulated(b, plain) is b for b in world.backends.values())
    assert all(emulated(b, None) is b for b in world.backends.values())
    got = world.run(lambda b: getattr(make_trainer(b).backend, "emulator", None))
    assert set(got.values()) == {None}


def test_cluster_file_emulation_round_trips_and_names_its_mistakes():
    cluster = cluster_from_yaml(CLUSTER_YAML + "emulate: {reference: fast, memory_scale: 1.0e-3, "
                                              "host_link: {bandwidth: 2.0e9, latency: 3.0e-5}}\n")
    assert cluster.slowdown(0) == 1.0 and cluster.slowdown(2) == pytest.approx(2.5)
    assert cluster.emulated_memory(0) == pytest.approx(1.0e6) and cluster.emulated_memory(2) == pytest.approx(1.0e5)
    assert cluster_from_dict(cluster_to_dict(cluster)) == cluster
    assert "emulated on this host as fast" in cluster.summary()
    with pytest.raises(ClusterError, match="'slow' is 2.5x faster than the emulation's reference 'slow'|faster than"):
        cluster_from_yaml(CLUSTER_YAML + "emulate: {reference: slow}\n")
    with pytest.raises(ClusterError, match="emulate: unknown key.*speed"):
        cluster_from_yaml(CLUSTER_YAML + "emulate: {reference: fast, speed: 2}\n")
    with pytest.raises(ClusterError, match="device type 'tpu'"):
        cluster_from_yaml(CLUSTER_YAML + "emulate: {reference: tpu}\n")
    with pytest.raises(ClusterError, match="slowdown.slow: must be a number >= 1"):
        cluster_from_yaml(CLUSTER_YAML + "emulate: {reference: fast, slowdown: {slow: 0.5}}\n")


class Clocks:
    """A rank's (wall, CPU) clocks that a test moves by hand."""

    def __init__(self):
        self.wall_s, self.cpu_s = 0.0, 0.0

    def work(self, wall: float, cpu: float) -> None:
        self.wall_s += wall
        self.cpu_s += cpu

    def of(self) -> tuple:
        return (lambda: self.wall_s, lambda: self.cpu_s)


def test_slow_type_waits_its_extra_time_and_the_fast_one_does_not():
    clocks = Clocks()
    slow = RankEmulator(0, "slow", 3.0, clocks=clocks.of())
    fast = RankEmulator(1, "fast", 1.0, clocks=clocks.of())
    for _ in range(10):
        clocks.work(0.002, 0.002)  # each op of 2 ms owes 3 x 2 - 2 ms, less than a chunk: owed, not yet slept
        slow.computed()
        fast.computed()
    assert slow.compute_wait_s == 0.0
    began = time.perf_counter()
    slow.settle()
    waited = time.perf_counter() - began
    # it slept at least what it owed, and oversleeping was credited (a busy host may wake it late)
    assert 0.039 <= slow.compute_wait_s <= 0.040 + 0.25 and waited >= 0.039
    assert fast.compute_wait_s == 0.0 and fast.ops == 0
    # work outside the op loop (the schedule, the trainer) is the device's too: settle owes it
    clocks.work(0.01, 0.01)
    slow.settle()
    assert 0.059 <= slow.compute_wait_s <= 0.060 + 0.5
    # time inside a communication is not compute: the marks restart when it returns
    clocks.work(0.05, 0.05)
    slow.mark()
    before = slow.compute_wait_s
    slow.settle()
    assert slow.compute_wait_s == before
    # a long stretch of ops sleeps in chunks of at least WAIT_CHUNK_S, before any communication
    for _ in range(int(WAIT_CHUNK_S / 0.004) + 5):
        clocks.work(0.002, 0.002)
        slow.computed()
    assert slow.compute_wait_s >= before + WAIT_CHUNK_S
    # with the chunk lifted (the wake-up probe's waking side) the debt waits for a communication
    lifted = RankEmulator(4, "slow", 3.0, clocks=clocks.of())
    lifted.chunk_s = float("inf")
    for _ in range(int(WAIT_CHUNK_S / 0.004) + 5):
        clocks.work(0.002, 0.002)
        lifted.computed()
    assert lifted.compute_wait_s == 0.0 and lifted.compute_sleeps == 0 and slow.compute_sleeps > 0
    # a debt forgiven (a probe switching how its device sleeps) is not slept at the next communication
    lifted.forgive_debt()
    lifted.settle()
    assert lifted.compute_sleeps == 0
    # sleeping in chunks alone (a diagnostic regime): a communication owes the debt without
    # sleeping it, and the chunk sleeps it once it is due
    chunked = RankEmulator(5, "slow", 3.0, clocks=clocks.of())
    chunked.sleeps_at_communications = False
    clocks.work(0.002, 0.002)
    chunked.computed()
    chunked.settle()
    assert chunked.compute_sleeps == 0
    for _ in range(int(WAIT_CHUNK_S / 0.004) + 5):
        clocks.work(0.002, 0.002)
        chunked.computed()
    assert chunked.compute_sleeps == 1 and chunked.compute_wait_s >= WAIT_CHUNK_S
    # the Python that drives a communication plan is the host's work, not the device's
    slow.settle()
    before = slow.compute_wait_s
    with slow.host_work():
        clocks.work(0.05, 0.05)
    slow.settle()
    assert slow.compute_wait_s == before
    # an op the busy host stretched (1 ms of CPU in 5 ms of wall time) owes 3 x 1 - 5 ms: credit,
    # which the next work uses up, across a communication too (the host's lateness is not the device's)
    busy = RankEmulator(2, "slow", 3.0, clocks=clocks.of())
    clocks.work(0.005, 0.001)
    busy.computed()
    busy.settle()
    clocks.work(0.001, 0.001)
    busy.computed()
    busy.settle()
    assert busy.compute_wait_s == 0.0
    clocks.work(0.001, 0.001)
    busy.computed()
    busy.settle()
    assert 0.0019 <= busy.compute_wait_s <= 0.25
    # credit is capped at one chunk: a long stall of the host does not buy the device free compute
    stalled = RankEmulator(3, "slow", 3.0, clocks=clocks.of())
    clocks.work(10.0, 0.0)
    stalled.settle()
    clocks.work(0.0, (WAIT_CHUNK_S + 0.01) / 3)
    stalled.settle()
    assert 0.0099 <= stalled.compute_wait_s <= 0.25


def test_a_timeline_mark_keeps_the_wall_time_the_device_was_idle_until_its_next_work():
    """RankEmulator.timeline (bench_stretches.py): a mark's seconds are the wall time from it to
    the next work, its communication's included; of marks in a row, each from its own moment."""
    from hspmd.runtime.execution.emulation import CHUNK_SLEPT, COMMUNICATED

    clocks = Clocks()
    device = RankEmulator(0, "slow", 3.0, clocks=clocks.of())
    device.timeline = []
    clocks.work(0.001, 0.001)
    device.computed(where="a")
    device.settle()
    clocks.work(0.004, 0.0)  # a communication's 4 ms
    device.mark()
    device.settle()
    clocks.work(0.003, 0.0)  # and the next's 3 ms
    device.mark()
    clocks.work(0.002, 0.002)
    device.computed(where="b")
    assert [n for n, _ in device.timeline] == ["a", COMMUNICATED, COMMUNICATED, "b"]
    assert device.timeline[1][1] == pytest.approx(0.007) and device.timeline[2][1] == pytest.approx(0.003)
    device.chunk_s = 0.001  # the next op's debt passes a chunk: slept, marked, idle until the work after
    clocks.work(0.002, 0.002)
    device.computed(where="c")
    clocks.work(0.0005, 0.0)
    device.mark()
    clocks.work(0.001, 0.001)
    device.computed(where="d")
    assert [n for n, _ in device.timeline[3:7]] == ["b", "c", CHUNK_SLEPT, "d"]
    assert device.timeline[5][1] == pytest.approx(0.0005)
    device.timeline = None  # off: nothing kept, nothing pending
    device.settle()
    clocks.work(0.001, 0.001)
    device.computed(where="e")


def test_the_memory_tables_bookkeeping_is_not_the_devices_work():
    """Counting an op's outputs against the memory table takes host CPU time, its clock reads
    included (a thread's CPU clock is a system call: here each read costs 0.1 ms after it
    samples); the device owes its op's time only, as a device without the table does (else every
    emulated device with a memory runs its slowdown x the table slower)."""
    class ReadCostClocks(Clocks):
        def of(self) -> tuple:
            def cpu():
                now = self.cpu_s
                self.work(0.0, 1e-4)
                return now
            return (lambda: self.wall_s, cpu)

    clocks = {"counted": ReadCostClocks(), "plain": ReadCostClocks()}
    counted = RankEmulator(0, "slow", 3.0, capacity=1e6, clocks=clocks["counted"].of())
    plain = RankEmulator(1, "slow", 3.0, clocks=clocks["plain"].of())
    table_hold = counted._hold

    def slow_hold(values, where):  # the table's own work: 1 ms of CPU and of wall time
        clocks["counted"].work(0.001, 0.001)
        table_hold(values, where)

    counted._hold = slow_hold
    kept = []  # the ops' outputs, live
    for _ in range(5):
        for name, device in (("counted", counted), ("plain", plain)):
            clocks[name].work(0.002, 0.002)
            kept.append(torch.ones(4))
            device.computed(kept[-1:], "op")
    assert counted.op_cpu_s == pytest.approx(plain.op_cpu_s) and plain.op_cpu_s == pytest.approx(5 * 0.0021)
    assert counted.live_bytes == 5 * 16
    # the table still refuses what the device cannot hold, naming the op
    with pytest.raises(DeviceOutOfMemory, match="big"):
        counted.computed((torch.ones(300_000),), "big")


@pytest.mark.multiprocess
def test_emulated_run_equals_the_plain_run_and_only_waits():
    """Same losses and weights, bit for bit, on real gloo processes; the slow type waited, the
    fast did not; ranks that receive across nodes waited for the link; the waits are in the trace."""
    steps = 2
    # 30x, not the file's 2.5x: a loaded host can make a rank's real work several times slower than
    # its CPU time, which is credit the emulated device then owes nothing against (no wait to see)
    cluster = two_types(memory_scale=1.0, slowdowns={"slow": 30.0})
    plain = run_multiprocess(train_rank, 4, None, steps, timeout=180)
    emul = run_multiprocess(train_rank, 4, cluster, steps, timeout=180)
    for rank in range(4):
        assert plain[rank][0] == emul[rank][0]
        assert plain[rank][1].keys() == emul[rank][1].keys()
        for name, value in plain[rank][1].items():
            assert torch.equal(value, emul[rank][1][name]), (rank, name)
        assert plain[rank][2] == emul[rank][2]  # the same bytes held by activations and sends
    stats = {rank: emul[rank][3] for rank in range(4)}
    assert stats[0].compute_wait_s == 0.0 and stats[1].compute_wait_s == 0.0
    assert stats[2].compute_wait_s > 0 and stats[3].compute_wait_s > 0 and stats[2].ops > 0
    # every cross-node message waits at least the link's 2 ms latency; the last stages receive 2 per step
    assert all(stats[r].link_wait_s > 0 for r in range(4))
    assert all(0 < stats[r].peak_bytes <= stats[r].capacity for r in range(4))
    assert all(any(e["name"] == "emulated compute" for e in emul[r][4]) for r in (2, 3))
    assert all(plain[r][3] is None and not plain[r][4] for r in range(4))


def test_losses_equal_a_run_without_emulation_in_process():
    steps = 2
    plain = LocalWorld(range(4)).run(lambda b: train_rank(b, None, steps))
    emul = LocalWorld(range(4)).run(lambda b: train_rank(b, two_types(slowdowns={"slow": 1.5}), steps))
    for rank in range(4):
        assert plain[rank][0] == emul[rank][0]
        assert all(torch.equal(v, emul[rank][1][k]) for k, v in plain[rank][1].items())


def over_memory_rank(backend, cluster):
    """Rank of a job whose slow type cannot hold a micro-batch's activations: what it raised and
    whether its weights were still the initial ones when it did."""
    torch.set_num_threads(1)
    backend = emulated(backend, cluster)
    trainer = make_trainer(backend)
    initial = {k: v.clone() for k, v in trainer.state.leaves.items()}
    x, y = batches(1)[0]
    try:
        trainer.step({"tokens": x, "labels": y})
        error = None
    except DeviceOutOfMemory as exc:
        error = exc
    except HSPMDError as exc:  # a peer's failure reaches the others as a communication error
        error = exc
    unchanged = all(torch.equal(v, trainer.state.leaves[k]) for k, v in initial.items())
    leaves = sum(v.untyped_storage().nbytes() for v in initial.values())
    return error, unchanged, leaves


def test_a_stage_over_its_memory_fails_by_name_before_any_weight_changes():
    """The slow type's memory holds its weights and optimizer states but not one micro-batch's
    activations: its ranks raise DeviceOutOfMemory naming the rank, the type and the bytes, in
    the forward, before any update; every rank's weights are the initial ones."""
    probe = LocalWorld(range(4)).run(lambda b: over_memory_rank(b, two_types(memory_scale=1.0)))
    assert all(error is None for error, _, _ in probe.values())
    leaves = max(probe[r][2] for r in (2, 3))
    # the slow type's capacity = its leaves + a little: the first activations go over; the fast
    # type has 10x the memory, more than it needs
    scale = (leaves + 4096) / 1.0e8
    world = LocalWorld(range(4), timeout=20)
    results: dict = {}

    def body(backend):
        results[backend.rank] = over_memory_rank(backend, two_types(memory_scale=scale))
        if results[backend.rank][0] is not None:
            raise results[backend.rank][0]

    with pytest.raises(HSPMDError) as info:
        world.run(body)
    raised = [r for r, (error, _, _) in results.items() if isinstance(error, DeviceOutOfMemory)]
    assert raised and set(raised) <= {2, 3}
    error = results[raised[0]][0]
    assert error.rank == raised[0] and error.device_type == "slow" and error.needed > error.capacity
    assert f"rank {raised[0]} (slow): out of device memory" in str(error) and "bytes live" in str(error)
    assert all(unchanged for _, unchanged, _ in results.values())
    assert isinstance(info.value, HSPMDError)


SCRIPT = Path(__file__).resolve().parents[1] / "examples" / "llama" / "train.py"
TWO_TYPES = Path(__file__).resolve().parents[1] / "examples" / "clusters" / "emulated-two-types.yaml"


def test_run_with_a_cluster_is_refused_in_one_line_when_it_does_not_fit(tmp_path, capsys):
    assert cli_main(["run", "-n", "5", "--cluster", str(TWO_TYPES), str(SCRIPT)]) == 2
    assert "-n 5 ranks but cluster emulated-two-types has 4 devices" in capsys.readouterr().err
    bad = tmp_path / "bad.yaml"
    bad.write_text(TWO_TYPES.read_text().replace("slowdown: {fast: 4,", "slowdown: {fast: 0.5,"))
    assert cli_main(["run", "--cluster", str(bad), str(SCRIPT)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "emulate.slowdown.fast: must be a number >= 1" in err[0]


@pytest.mark.multiprocess
def test_plan_then_run_under_emulation_prints_measured_next_to_simulated(tmp_path, capsys):
    """`hspmd plan --cluster C` writes a strategy, `hspmd run --cluster C` trains it with every rank
    as its emulated type (one rank per device), and the summary has the measured step time beside
    the simulated one and each rank's emulated waits."""
    plan = tmp_path / "plan.yaml"
    assert cli_main(["plan", "--cluster", str(TWO_TYPES), "--model", "llama-tiny", "--global-batch", "4",
                     "--search", "dp", "--out", str(plan)]) == 0
    summary, trace = tmp_path / "summary.json", tmp_path / "trace.json"
    code = cli_main(["run", "--cluster", str(TWO_TYPES), str(SCRIPT), "--strategy-file", str(plan), "--steps", "3",
                     "--checkpoint", str(tmp_path / "c.safetensors"), "--summary", str(summary), "--trace", str(trace)])
    out = capsys.readouterr().out
    assert code == 0
    assert "step time: measured" in out and "simulated" in out and "rank 3 emulated slow x10" in out
    data = json.loads(summary.read_text())
    assert data["measured_step_s"] > 0 and data["simulated_step_s"] > 0
    by_rank = {e["rank"]: e for e in data["emulation"]}
    assert set(by_rank) == {0, 1, 2, 3}
    slow = [r for r in by_rank if by_rank[r]["device_type"] == "slow"]
    assert slow == [2, 3]
    used = {int(r) for p in yaml.safe_load(plan.read_text())["pipelines"] for s in p["stages"]
            for r in str(s["ranks"]).split(",")}
    # every rank waits (the file dilates the fast type 4x too), each op the slow type 2.5x as long
    assert all(by_rank[r]["compute_wait_s"] > 0 for r in used)
    events = json.loads(trace.read_text())["traceEvents"]
    assert {e["pid"] for e in events if e.get("cat") == "emulated"} & set(slow)


def test_an_emulated_calibration_probes_at_the_reference_types_slowdown():
    from hspmd.runtime.policies.calibrate import emulated_reference

    assert emulated_reference(None) is None and emulated_reference(cluster_from_yaml(CLUSTER_YAML)) is None
    assert emulated_reference(two_types()) is None  # the reference runs at this host's own pace
    assert emulated_reference(two_types(slowdowns={"fast": 4.0, "slow": 10.0})) == 4.0


def test_calibration_prices_the_emulated_types_at_the_file_ratios():
    """This host's fit is the reference type; the slow type gets its rates / 2.5 and 1.5 x the
    per-instruction overhead per kernel; links inside a node are the fitted host link; a dilated
    reference (slowdown given) divides its own rates too."""
    from hspmd.planning import model_named
    from hspmd.planning.strategy_sim import simulate_strategy
    from hspmd.runtime.policies.calibrate import simulated_step
    from hspmd.runtime.policies.calibration import Calibration

    cal = Calibration(peak_flops=4e10, bandwidth=2e10, overhead=1e-4, link_latency=1e-4, link_bandwidth=1e9,
                      step_overhead=1e-3, gamma=3.0)
    cluster = cluster_from_yaml(CLUSTER_YAML + "emulate: {reference: fast}\n")
    cost = cal.cost_model_for(cluster, model_named("llama-tiny"))
    assert cost.cluster.type_named("slow").peak_flops("float32") == pytest.approx(4e10 / 2.5)
    assert cost.cluster.type_named("fast").hbm_bandwidth == pytest.approx(2e10)
    assert cost.efficiency_of(cost.cluster.type_named("slow")).d("gemm") == pytest.approx(1.5e-4)
    assert cost.efficiency_of(cost.cluster.type_named("fast")).d("gemm") == 0.0
    assert cost.cluster.link(0, 1).name == "gloo" and cost.cluster.link(0, 2).name == "net"
    dilated = cal.cost_model_for(cluster_from_yaml(TWO_TYPES.read_text()), model_named("llama-tiny"))
    assert dilated.cluster.type_named("fast").peak_flops("float32") == pytest.approx(4e10 / 4)
    assert dilated.cluster.type_named("slow").peak_flops("float32") == pytest.approx(4e10 / 10)
    on_fast = parse_strategy("layers=4 ; 4x1: R0 L0-3")
    on_slow = parse_strategy("layers=4 ; 4x1: R2 L0-3")
    fast, slow = simulate_strategy(on_fast, cost).iteration, simulate_strategy(on_slow, cost).iteration
    assert 2.0 < slow / fast < 2.6  # the per-step overhead is not slowed
    assert simulated_step(on_slow, cluster, model_named("llama-tiny"), cal)[0] == pytest.approx(slow)
    with pytest.raises(HSPMDError, match="no emulate block"):
        cal.cost_model_for(cluster.with_emulation(None), model_named("llama-tiny"))


def test_cpu_time_probes_do_not_count_what_the_host_does_elsewhere():
    """Emulated devices follow each op's CPU time, and so can the calibration's compute probes: a
    call that waits (the host busy with others) costs wall time but next to no CPU time."""
    from hspmd.runtime.policies.probes import median_seconds

    wall = median_seconds(lambda: time.sleep(0.01), 3)
    cpu = median_seconds(lambda: time.sleep(0.01), 3, clock=time.thread_time)
    assert wall >= 0.009 and cpu < 0.005


@pytest.mark.multiprocess
def test_a_cluster_the_simulator_cannot_price_still_trains_and_says_why(tmp_path, capsys):
    """A cluster file without the model's dtype (no float32 peak), not emulated: the job trains as
    before and the summary says why no simulated time stands beside the measured one."""
    plain = tmp_path / "bf16-only.yaml"
    plain.write_text(CLUSTER_YAML.replace("{float32: 10.0e9}", "{bfloat16: 10.0e9}").replace("{float32: 4.0e9}",
                                                                                               "{bfloat16: 4.0e9}"))
    code = cli_main(["run", "-n", "2", "--cluster", str(plain), str(SCRIPT), "--steps", "2", "--hidden", "16",
                     "--heads", "2", "--ffn", "32", "--seq", "8", "--strategy", "layers=2 ; 2x2: R0 L0-1 ; 2x2: R1 L0-1",
                     "--checkpoint", str(tmp_path / "c.safetensors")])
    out = capsys.readouterr().out
    assert code == 0
    assert "step time: measured" in out and "not simulated" in out and "float32" in out


def test_a_cp_group_across_the_types_trains_alike_under_emulation():
    """CP4 over both nodes with shares by speed (the fast ranks take more tokens): the emulated
    run's losses and weights equal the plain run's (its gradient sync reduce-scatters through the
    emulated backend)."""
    text = "layers=2 ; 1x1: R0-3 L0-1 cp4=6,6,2,2"
    batch = in_token_order({k: torch.randint(0, CONFIG["vocab"], (1, 16), generator=torch.Generator().manual_seed(i))
                            for i, k in enumerate(("tokens", "labels"))}, torch.arange(16))

    def rank(backend, cluster):
        backend = emulated(backend, cluster)
        strategy = parse_strategy(text)
        model = build_llama(LlamaConfig(layers=2, **CONFIG), [strategy], optimizer=AdamW(lr=LR))
        trainer = Trainer(model.graph, 0, backend, strategy, symbols={"S": 16, "T": 16})
        return [trainer.step(batch) for _ in range(2)], {k: v.clone() for k, v in trainer.state.leaves.items()}

    plain = LocalWorld(range(4)).run(lambda b: rank(b, None))
    emul = LocalWorld(range(4)).run(lambda b: rank(b, two_types(slowdowns={"slow": 1.5})))
    for r in range(4):
        assert plain[r][0] == emul[r][0] and plain[r][0][0] is not None
        assert all(torch.equal(v, emul[r][1][k]) for k, v in plain[r][1].items())


def test_the_op_hook_times_each_op_and_nothing_before_its_pass():
    """With op_seconds set, an emulated device records every compute op of a step by name, once
    per call, each with its own CPU time: work between passes (here 50 ms of CPU burnt before the
    step) is recorded apart (BETWEEN_PASSES), not put on the pass's first op."""
    from hspmd.runtime.execution.emulation import BETWEEN_PASSES, emulation_of
    from hspmd.runtime.policies.probes import Probe

    probe = Probe(None, cpu_time=True)
    trainer, batch = probe.trainers[1]  # one layer, two micro-batches
    device = emulation_of(trainer.backend)
    trainer.step(batch)
    device.op_seconds = {}
    end = time.thread_time() + 0.05
    while time.thread_time() < end:
        pass
    trainer.step(batch)
    exe = trainer.exe
    calls = {ins.node.name: 2 for ins in exe.forward + exe.backward if ins.role == "compute"}
    calls.update({ins.node.name: 1 for ins in exe.update if ins.role == "compute"})
    between = device.op_seconds.pop(BETWEEN_PASSES)
    assert {name: len(times) for name, times in device.op_seconds.items()} == calls
    assert max(t for times in device.op_seconds.values() for t in times) < 0.02
    assert len(between) == 5 and max(between) >= 0.045  # 2 forward, 2 backward, the update; the burn before the first
