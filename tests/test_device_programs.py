"""Per-device programs as plain data (hspmd.specialize.program): every rank's program written to
JSON and run from that file alone in its own gloo process trains exactly like the graph-based
Trainer on the same processes and like one device (loss, gradients, updated weights), under DP,
TP, PP with 1F1B and a heterogeneous strategy; load(dump(p)) == p; a damaged file is refused with
the field named."""

from __future__ import annotations

import json
import os
import tempfile

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import hspmd.ops as O
from hspmd import cli
from hspmd.annotations import Annotation, DistributedStates, Duplicate, Subgroup
from hspmd.backends.backend import Backend
from hspmd.backends.local import LocalWorld
from hspmd.errors import HSPMDError
from hspmd.ir import Binding, comm, initial_value, parameter, placeholder
from hspmd.models.llama import LlamaConfig, build_llama
from hspmd.models.llama_reference import reference_training
from hspmd.ops import AdamW, Graph
from hspmd.ops.registry import OPERATORS
from hspmd.runtime.execution.batches import MicroBatchLayout
from hspmd.runtime.training.inprocess import InProcessJob
from hspmd.runtime.processes.multiprocess import run_multiprocess
from hspmd.runtime.programs.tool import synthetic_batches
from hspmd.runtime.programs.runner import ProgramRunner
import hspmd.runtime.programs.compiling as programs_module
from hspmd.runtime.programs.compiling import compile_programs, iter_programs, read_program, write_programs
from hspmd.runtime.training.trainer import Trainer
from hspmd.specialize.program import DeviceProgram, ProgramError, device_program
from hspmd.specialize.specialized import specialize_graph
from hspmd.specialize.strategy_text import parse_strategy
from hspmd.testing import annotations, assert_weights_close

SEQ, LR, STEPS = 8, 1e-2, 2
CONFIG = dict(vocab=32, hidden=16, heads=2, ffn=32)
STRATEGIES = {
    "dp": "layers=2 ; 2x1: R0 L0-1 ; 2x1: R1 L0-1",
    "tp": "layers=2 ; 2x1: R0,1 L0-1",
    "pp-1f1b": "layers=4 ; 4x1: R0 L0-1 | R1 L2-3",
    "hetero": "layers=4 ; 2x2: R0,1 L0-3 ; 3x1: R2 L0-1 | R3 L2-3",
}


def _model(text: str):
    strategy = parse_strategy(text)
    model = build_llama(LlamaConfig(layers=strategy.num_layers, **CONFIG), [strategy], optimizer=AdamW(lr=LR))
    layout = MicroBatchLayout.of(strategy)
    return model, layout, {"S": SEQ, "T": layout.global_batch_size * SEQ}


def _batches(layout: MicroBatchLayout, seed: int = 5):
    gen = torch.Generator().manual_seed(seed)
    rows = layout.global_batch_size
    return [{"tokens": torch.randint(0, CONFIG["vocab"], (rows, SEQ), generator=gen),
             "labels": torch.randint(0, CONFIG["vocab"], (rows, SEQ), generator=gen)} for _ in range(STEPS)]


def _assemble(pieces_by_rank) -> dict[str, torch.Tensor]:
    """Whole tensors from every rank's (box, piece); overlapping pieces (replicas) must agree exactly."""
    boxes: dict[str, list] = {}
    for pieces in pieces_by_rank:
        for name, (box, value) in pieces.items():
            boxes.setdefault(name, []).append((box, value))
    out = {}
    for name, parts in boxes.items():
        shape = tuple(max(box[d][1] for box, _ in parts) for d in range(len(parts[0][0])))
        whole, seen = torch.zeros(shape, dtype=parts[0][1].dtype), torch.zeros(shape, dtype=torch.bool)
        for box, value in parts:
            where = tuple(slice(a, b) for a, b in box)
            overlap = seen[where]
            assert torch.equal(whole[where][overlap], value[overlap]), f"replicas of {name} disagree"
            whole[where], seen[where] = value, True
        assert bool(seen.all()), f"the pieces of {name} do not cover it"
        out[name] = whole
    return out


# ---- every rank from its JSON file in its own gloo process -----------------------------------------

def program_and_trainer_rank(backend: Backend, directory: str, text: str):
    """Run the program from this rank's file alone; then, for comparison, the graph-based Trainer."""
    torch.set_num_threads(1)
    runner = ProgramRunner(read_program(directory, backend.rank), backend)
    _, layout, _ = _model(text)
    data = _batches(layout)
    losses, grads = [], []
    for batch in data:
        losses.append(runner.step(batch))
        grads.append(runner.gradient_pieces())
    program = (losses, grads, runner.pieces())
    model, layout, symbols = _model(text)
    trainer = Trainer(model.graph, 0, backend, layout, schedule="1f1b", symbols=symbols)
    graph_losses, graph_grads = [], []
    for batch in data:
        graph_losses.append(trainer.step(batch))
        graph_grads.append(trainer.gradients())
    return program, (graph_losses, graph_grads, trainer.state_dict())


@pytest.mark.multiprocess
@pytest.mark.parametrize("name", sorted(STRATEGIES))
def test_programs_from_json_in_separate_processes_equal_the_graph_run_and_one_device(name):
    text = STRATEGIES[name]
    model, layout, symbols = _model(text)
    programs = compile_programs(model.graph, 0, layout, "1f1b", symbols)
    if name == "pp-1f1b":
        assert [str(a) for a in programs[0].place.order][:3] == ["F0", "F1", "B0"]
    with tempfile.TemporaryDirectory() as tmp:
        write_programs(programs, tmp)
        assert sorted(os.listdir(tmp)) == [f"rank{r}.json" for r in sorted(programs)]
        results = run_multiprocess(program_and_trainer_rank, len(programs), tmp, text, timeout=180)
    (losses, _, _), (graph_losses, graph_grads, graph_state) = results[0]
    assert all(r[0][0] == losses for r in results), "the step loss is the same on every rank"
    # the program and the Trainer run the same ops on the same backend: identical results
    assert losses == graph_losses
    for step in range(STEPS):
        grads = _assemble(r[0][1][step] for r in results)
        assert grads.keys() == graph_grads[step].keys()
        for k, v in grads.items():
            assert torch.equal(v, graph_grads[step][k]), k
    state = _assemble(r[0][2] for r in results)
    assert state.keys() == graph_state.keys() and any("exp_avg" in k for k in state)
    for k, v in state.items():
        assert torch.equal(v, graph_state[k]), k
    # and one device
    ref_model = build_llama(LlamaConfig(layers=model.config.layers, **CONFIG), [parse_strategy(
        f"layers={model.config.layers} ; 1x1: R0 L0-{model.config.layers - 1}")])
    initial = {n.name: initial_value(n) for n in ref_model.graph.parameters}
    data = _batches(layout)
    history, final = reference_training(initial, lambda s: (data[s]["tokens"], data[s]["labels"]),
                                        model.config.layers, CONFIG["heads"], STEPS, lr=LR)
    assert losses == pytest.approx([h[0] for h in history], rel=1e-5, abs=1e-6)
    for step in range(STEPS):
        grads = _assemble(r[0][1][step] for r in results)
        for k, g in history[step][1].items():
            torch.testing.assert_close(grads[k], g, rtol=1e-4, atol=1e-5)
    assert max(float((final[k] - initial[k]).abs().max()) for k in initial) > LR
    for k, v in final.items():
        assert_weights_close(state[k], v, LR, k)


# ---- a planned strategy: per-pipeline schedules and warm-up vectors, recompute by stage -------------

# pipeline 0: H-1F1B with warm-up (3, 1), its TP2 first stage recomputes (collectives inside the
# stage run again); pipeline 1: GPipe, its last stage recomputes
PLANNED = "layers=4 ; 4x1 h1f1b=3,1: R0,1 L0-1 recompute | R2 L2-3 ; 3x1 gpipe: R3 L0-1 | R4 L2-3 recompute"


def planned_rank(backend: Backend, directory: str | None, programs=None):
    """This rank's program (from its file, or given) and the Trainer on the same strategy: losses,
    gradients and pieces of both, and what each ran (place, order, recomputation, measured peaks)."""
    torch.set_num_threads(1)
    model, layout, symbols = _model(PLANNED)
    program = read_program(directory, backend.rank) if directory else programs[backend.rank]
    runner = ProgramRunner(program, backend)
    runner.measure = True
    trainer = Trainer(model.graph, 0, backend, parse_strategy(PLANNED), symbols=symbols)
    out = []
    for run in (runner, trainer):
        losses, grads, peaks = [], [], []
        for batch in _batches(layout):
            losses.append(run.step(batch))
            grads.append(run.gradient_pieces() if run is runner else run.gradients())
            last = run.last_run
            peaks.append(None if last is None else (last.peak_in_flight, last.peak_held_bytes))
        out.append((losses, grads, runner.pieces() if run is runner else trainer.state_dict(), peaks))
    place = None if program.idle else (program.place.schedule, program.place.order, bool(program.place.recomputed))
    ran = None if trainer.idle else (trainer.schedule, trainer.order, trainer.recompute is not None)
    return out, place, ran


def _check_planned(results):
    ((losses, _, _, _), (graph_losses, graph_grads, graph_state, _)), _, _ = results[0]
    assert losses == graph_losses and all(r[0][0][0] == losses for r in results.values())
    for step in range(STEPS):
        grads = _assemble(r[0][0][1][step] for r in results.values())
        assert grads.keys() == graph_grads[step].keys()
        for k, v in grads.items():
            assert torch.equal(v, graph_grads[step][k]), k
    state = _assemble(r[0][0][2] for r in results.values())
    assert state.keys() == graph_state.keys()
    for k, v in state.items():
        assert torch.equal(v, graph_state[k]), k
    schedules = set()
    for (program, trainer), place, ran in results.values():
        assert place[:2] == ran[:2] and place[2] == ran[2]  # the program runs the Trainer's schedule and order
        assert program[3] == trainer[3]  # the same micro-batches in flight, the same activation bytes held
        schedules.add((place[0], place[2]))
    # every pipeline's own schedule and every stage's recompute flag were taken
    assert schedules == {("h1f1b:3,1", True), ("h1f1b:3,1", False), ("gpipe", False), ("gpipe", True)}


def test_a_planned_strategys_programs_run_what_the_trainer_runs_in_process():
    model, layout, symbols = _model(PLANNED)
    programs = compile_programs(model.graph, 0, parse_strategy(PLANNED), symbols=symbols)
    results = LocalWorld(range(5), 120).run(lambda b: planned_rank(b, None, programs))
    _check_planned(results)


@pytest.mark.multiprocess
def test_a_planned_strategys_programs_from_json_run_what_the_trainer_runs_on_gloo():
    model, layout, symbols = _model(PLANNED)
    with tempfile.TemporaryDirectory() as tmp:
        write_programs(compile_programs(model.graph, 0, parse_strategy(PLANNED), symbols=symbols), tmp)
        results = run_multiprocess(planned_rank, 5, tmp, timeout=180)
    _check_planned(dict(enumerate(results)))


# ---- in-process: programs round trip and run like the Trainer --------------------------------------

def test_a_program_prints_its_place_ops_plans_and_pieces():
    model, layout, symbols = _model(STRATEGIES["hetero"])
    programs = compile_programs(model.graph, 0, layout, "1f1b", symbols, world_size=5)
    text = str(programs[2])
    assert "program of device 2" in text and "stage 1 of 2 [[2], [3]], pipeline 1, 1f1b: F0 F1 B0" in text
    # stage [2] of a TP1 pipeline sends activations on and takes gradients back: no collective forward
    assert {o.role for o in programs[2].forward} & {"send", "collective"} == {"send"}
    assert "collective" in {o.role for o in programs[0].forward}  # TP2
    assert "SendRecv" in text and "parameter layers.0.wq" in text
    assert "causal_attention(t13, t18, t22)" in text and "init kind=normal" in text
    assert programs[4].idle and "idle" in str(programs[4])
    for p in programs.values():
        assert DeviceProgram.from_json(p.to_json()) == p


def test_streamed_programs_are_the_compiled_ones_one_at_a_time(tmp_path, monkeypatch):
    """iter_programs gives compile_programs' programs in rank order, its ranks' executable graphs
    made a batch at a time (here two ranks, against all at once); write_programs writes them as
    they come; a bad layout fails at the call, before any program."""
    model, layout, symbols = _model(STRATEGIES["hetero"])
    compiled = compile_programs(model.graph, 0, layout, "1f1b", symbols, world_size=5)
    monkeypatch.setattr(programs_module, "RANKS_AT_ONCE", 2)
    stream = iter_programs(model.graph, 0, layout, "1f1b", symbols, world_size=5)
    first_rank, first = next(stream)
    assert first_rank == 0 and first == compiled[0]
    paths = write_programs(stream, tmp_path)
    assert [p.name for p in paths] == [f"rank{r}.json" for r in range(1, 5)]
    assert all(read_program(tmp_path, r) == compiled[r] for r in range(1, 5))
    with pytest.raises(HSPMDError, match="the micro-batch layout has 1 pipeline"):
        iter_programs(model.graph, 0, MicroBatchLayout((2,), (2,)), "1f1b", symbols)


@pytest.mark.parametrize("name", ["hetero", "tp", "dp"])
def test_a_program_names_its_own_groups_and_the_ranks_together_name_every_plans_groups(name):
    """Each rank lists only collective groups it is in (what it passes to prepare_groups, which
    creates the union of every rank's); together they are every group the job's plans use."""
    model, layout, symbols = _model(STRATEGIES[name])
    programs = compile_programs(model.graph, 0, layout, "1f1b", symbols)
    spec = specialize_graph(model.graph, 0, programs[0].binding)
    used = {g for exe in spec.executables.values() for ins in exe.instructions() if ins.role == "collective"
            for g in exe.plan(ins.node, spec.binding).collective_groups() if len(g) > 1}
    assert used, "the strategy has collectives"
    named = set()
    for rank, program in programs.items():
        own = {tuple(g) for g in program.groups}
        assert all(rank in g for g in own - {tuple(program.devices)}), (rank, own)
        named |= own
    assert used <= named and named - used <= {tuple(programs[0].devices)}


def test_some_ranks_programs_are_those_of_the_whole_job():
    """A node compiling its own ranks (an idle one among them) gets the programs the whole job's
    compile gives those ranks; a rank outside the job is refused by name."""
    model, layout, symbols = _model(STRATEGIES["hetero"])
    whole = compile_programs(model.graph, 0, layout, "1f1b", symbols, world_size=5)
    some = compile_programs(model.graph, 0, layout, "1f1b", symbols, world_size=5, ranks=[4, 1, 3, 1])
    assert sorted(some) == [1, 3, 4] and all(some[r] == whole[r] for r in some)
    assert some[4].idle and not some[1].idle
    for bad in ([5], [-1], ["0"], [True]):
        with pytest.raises(HSPMDError, match=r"are not ranks of the job: it has ranks 0-4"):
            compile_programs(model.graph, 0, layout, "1f1b", symbols, world_size=5, ranks=bad)


def test_programs_run_in_process_like_the_trainer_and_idle_ranks_return_none():
    model, layout, symbols = _model(STRATEGIES["pp-1f1b"])
    programs = compile_programs(model.graph, 0, layout, "1f1b", symbols, world_size=3)
    world = LocalWorld(range(3))
    runners = world.run(lambda b: ProgramRunner(DeviceProgram.from_json(programs[b.rank].to_json()), b))
    trainers = world.run(lambda b: Trainer(model.graph, 0, b, layout, "1f1b", symbols))
    for batch in _batches(layout):
        got = world.run(lambda b: runners[b.rank].step(batch))
        want = world.run(lambda b: trainers[b.rank].step(batch))
        assert got == want and got[2] is None and got[0] is not None


def test_a_program_carries_its_buckets_and_the_runner_reads_gradients_from_them():
    """DP2 with small buckets: the programs carry the Trainer's bucket plan through JSON, the
    update reads the bucketed gradients from the bucket buffers, and the steps give the same
    bits as programs compiled without buckets."""
    model, layout, symbols = _model(STRATEGIES["dp"])
    bucketed = compile_programs(model.graph, 0, layout, "1f1b", symbols, bucket_cap_mb=0.001)
    plain = compile_programs(model.graph, 0, layout, "1f1b", symbols, bucket_cap_mb=None)
    assert all(p.buckets is None for p in plain.values())
    for program in bucketed.values():
        assert len(program.buckets.buckets) > 1 and not program.buckets.kept
        assert DeviceProgram.from_json(program.to_json()).buckets == program.buckets
    world = LocalWorld(range(len(bucketed)))
    runs = {}
    for name, programs in (("bucketed", bucketed), ("plain", plain)):
        runners = world.run(lambda b: ProgramRunner(DeviceProgram.from_json(programs[b.rank].to_json()), b))
        losses = [world.run(lambda b: runners[b.rank].step(batch)) for batch in _batches(layout)]
        runs[name] = (losses, world.run(lambda b: runners[b.rank].gradient_pieces()),
                      world.run(lambda b: runners[b.rank].pieces()))
        if name == "bucketed":
            buffers = {b.untyped_storage().data_ptr() for r in runners.values() for b in r.buckets.buffers}
            read = {g.untyped_storage().data_ptr() for r in runners.values() for g in r.gradients.values()}
            assert read <= buffers
    (losses, grads, pieces), (plain_losses, plain_grads, plain_pieces) = runs["bucketed"], runs["plain"]
    assert losses == plain_losses
    for rank in grads:
        for name, (box, value) in grads[rank].items():
            assert plain_grads[rank][name][0] == box and torch.equal(value, plain_grads[rank][name][1]), name
        for name, (_box, value) in pieces[rank].items():
            assert torch.equal(value, plain_pieces[rank][name][1]), name


def test_every_op_kind_of_llama_steps_is_in_the_registry():
    strategy = parse_strategy("layers=2 ; 1x2: R0,1 L0-1")
    graphs = [build_llama(LlamaConfig(layers=2, **CONFIG), [strategy], optimizer=AdamW(lr=LR)).graph,
              build_llama(LlamaConfig(layers=2, vocab=32, hidden=16, heads=2, ffn=32, kv_heads=1, tie_embeddings=True),
                          [strategy], optimizer=O.SGD(lr=LR, momentum=0.9), packed=True,
                          compute_dtype=torch.bfloat16).graph]
    kinds = {n.kind for g in graphs for n in g.nodes}
    assert kinds <= set(OPERATORS), kinds - set(OPERATORS)
    assert {"packed_attention_grad", "sgd_update", "cast", "repeat_interleave"} <= kinds


# ---- JSON round trip over random reshards ----------------------------------------------------------

def _whole_on(ann):
    return Annotation(tuple(Subgroup(s.dg, DistributedStates((Duplicate(len(s.dg)),))) for s in ann.subgroups))


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(x_ann=annotations(2, devices=(0, 1, 2, 3), max_hsize=2), y_ann=annotations(2, devices=(0, 1, 2, 3), max_hsize=2),
       factor=st.floats(-4, 4, allow_nan=False, width=32))
def test_load_of_dump_is_the_program(x_ann, y_ann, factor):
    g = Graph()
    x = placeholder(g, "x", (4, 6), annotation=x_ann)
    y = comm(placeholder(g, "y", (4, 6), annotation=y_ann), x_ann, name="y_like_x")
    w = comm(placeholder(g, "w", (6, 5), annotation=x_ann if x_ann.hsize == 1 else _whole_on(x_ann)), _whole_on(x_ann))
    out = O.scale(O.add(x, y), factor) @ w
    try:
        spec = specialize_graph(g, 0, Binding(), fetches=[out])
    except HSPMDError:
        return
    for _d, exe in spec.executables.items():
        p = device_program(exe, seed=1, place=None, feeds=(), global_batch=4, devices=spec.devices,
                           groups=(spec.devices,), loss=None, loss_summand=False)
        text = p.to_json()
        again = DeviceProgram.from_json(text)
        assert again == p
        assert again.to_json() == text
        assert len(again.plans) == len({o.plan for o in p.forward if o.plan is not None})


# ---- damaged files ---------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def tp_program() -> dict:
    model, layout, symbols = _model(STRATEGIES["tp"])
    return compile_programs(model.graph, 0, layout, "1f1b", symbols)[0].to_dict()


def _first_compute(data):
    return next(i for i, o in enumerate(data["forward"]) if o["inputs"])


def _first_comm(data):
    return next(i for i, o in enumerate(data["forward"]) if "plan" in o)


@pytest.mark.parametrize("damage, field", [
    (lambda d: d.pop("tensors"), "program field tensors: missing"),
    (lambda d: d.update(schema="hspmd.program/0"), "field schema"),
    (lambda d: d["forward"][3].update(kind="conv9d"), "field forward[3].kind"),
    (lambda d: d["forward"][_first_compute(d)]["inputs"].__setitem__(0, 10**6), "].inputs[0]: tensor 1000000 is not"),
    (lambda d: d["backward"][0].update(inputs="x"), "field backward[0].inputs: expected a list"),
    (lambda d: d["forward"][_first_comm(d)].update(plan=99), ".plan: expected a plan index below"),
    (lambda d: d["forward"][_first_comm(d)].pop("plan"), "needs its plan"),
    (lambda d: d["plans"][0]["steps"][0].pop("src"), "field plans[0]: not a plan"),
    (lambda d: d["plans"][0].update(device=d["device"] + 1), "field plans[0].device: expected this program's device"),
    (lambda d: d["plans"][0]["steps"][0]["collectives"][0]["devices"].remove(d["device"]), "without device"),
    (lambda d: d["tensors"][0].update(annotation=999), "field tensors[0].annotation: expected an index below"),
    (lambda d: d.pop("annotations"), "program field annotations: missing"),
    (lambda d: d["tensors"][0].update(box=[[3, 1]]), "field tensors[0].box[0]"),
    (lambda d: d["tensors"][0].update(shape=[-1]), "field tensors[0].shape[0]"),
    (lambda d: d["leaves"][0]["init"].update(kind="xavier"), "field leaves[0].init"),
    (lambda d: d["place"]["order"].__setitem__(0, "X0"), "field place.order[0]"),
    (lambda d: d["place"]["order"].__setitem__(0, "B0"), "field place.order"),
    (lambda d: d["place"].update(stage=7), "field place.stage"),
    (lambda d: d["feeds"].pop(), "field feeds"),
    (lambda d: d["forward"][0].update(role="teleport"), "field forward[0].role"),
    (lambda d: d.update(loss_summand="yes"), "field loss_summand"),
    (lambda d: d["binding"]["symbols"].update(S=True), "field binding.symbols.S"),
])
def test_a_damaged_program_is_refused_naming_the_field(tp_program, damage, field):
    data = json.loads(json.dumps(tp_program))
    damage(data)
    with pytest.raises(ProgramError, match="program field") as info:
        DeviceProgram.from_dict(data)
    assert field in str(info.value)


@pytest.mark.parametrize("damage, field", [
    (lambda b: b["buckets"][0]["slots"][0].update(tensor=10**6), "names tensor 1000000, which is not in the tensor"),
    (lambda b: b["buckets"][0].update(dtype="int4"), "field buckets: not a bucket plan (ValueError: bucket 0: dtype"),
    (lambda b: b["buckets"][0]["slots"][0].update(offset=3), "slots must follow one another"),
    (lambda b: b["buckets"][0].pop("group"), "field buckets: not a bucket plan (KeyError"),
])
def test_a_damaged_bucket_plan_is_refused_naming_the_field(damage, field):
    model, layout, symbols = _model(STRATEGIES["dp"])
    data = compile_programs(model.graph, 0, layout, "1f1b", symbols, bucket_cap_mb=0.001)[0].to_dict()
    damage(data["buckets"])
    with pytest.raises(ProgramError, match="program field buckets") as info:
        DeviceProgram.from_dict(data)
    assert field in str(info.value)


def test_unreadable_program_files_name_the_file(tmp_path):
    (tmp_path / "rank0.json").write_bytes(b'{"schema": "hspmd.program/1", "dev')
    with pytest.raises(ProgramError, match=r"rank0\.json: not JSON"):
        read_program(tmp_path, 0)
    with pytest.raises(ProgramError, match=r"rank1\.json: cannot read rank 1"):
        read_program(tmp_path, 1)
    (tmp_path / "rank0.json").write_bytes(b"\xff\xfe")
    with pytest.raises(ProgramError, match="not JSON"):
        read_program(tmp_path, 0)


def test_a_custom_initializer_cannot_become_a_program():
    g = Graph()
    x = placeholder(g, "x", (2, 4), annotation="D:2@[0,1]")
    w = parameter(g, "w", (4, 3), init=lambda shape, gen: torch.ones(shape), annotation="D:2@[0,1]")
    spec = specialize_graph(g, 0, Binding(), fetches=[x @ w])
    with pytest.raises(ProgramError, match="parameter w has a custom initializer"):
        device_program(spec.executables[0], seed=0, place=None, feeds=(), global_batch=2, devices=(0, 1),
                       groups=(), loss=None, loss_summand=False)


# ---- the command line ------------------------------------------------------------------------------

@pytest.mark.multiprocess
def test_hspmd_compile_then_run_programs_trains_like_the_in_process_job(tmp_path, capsys):
    text = STRATEGIES["pp-1f1b"]
    assert cli.main(["compile", text, "--out", str(tmp_path), "--print", "1"]) == 0
    out = capsys.readouterr().out
    assert "rank 1: stage 2/2 of pipeline 0" in out and "program of device 1" in out
    assert cli.main(["run-programs", str(tmp_path), "--steps", "2", "--seed", "3"]) == 0
    printed = [float(line.split()[-1]) for line in capsys.readouterr().out.splitlines() if line.startswith("step")]
    model, layout, symbols = _model(text)
    job = InProcessJob(model.graph, 0, layout, "1f1b", symbols)
    job_file = json.loads((tmp_path / "job.json").read_text())
    expected = [job.step(b) for b in synthetic_batches(job_file, 2, 3)]
    assert printed == pytest.approx(expected, rel=1e-6)


def test_hspmd_compile_ranks_writes_those_ranks_files_as_the_whole_compile_does(tmp_path, capsys):
    text = STRATEGIES["hetero"]
    assert cli.main(["compile", text, "--out", str(tmp_path / "all")]) == 0
    assert cli.main(["compile", text, "--out", str(tmp_path / "node"), "--ranks", "2-3,0"]) == 0
    assert sorted(os.listdir(tmp_path / "node")) == ["job.json", "rank0.json", "rank2.json", "rank3.json"]
    for name in os.listdir(tmp_path / "node"):
        assert (tmp_path / "node" / name).read_bytes() == (tmp_path / "all" / name).read_bytes(), name
    capsys.readouterr()
    assert cli.main(["compile", text, "--out", str(tmp_path / "bad"), "--ranks", "3-1"]) == 2
    assert "rank range '3-1' runs backwards; write 1-3" in capsys.readouterr().err
    assert cli.main(["compile", text, "--out", str(tmp_path / "bad"), "--ranks", "0", "--print", "2"]) == 2
    assert "--print 2: not a rank compiled here (the job has ranks 0-3)" in capsys.readouterr().err


def test_run_programs_refuses_a_missing_job_or_a_damaged_program_before_launching(tmp_path, capsys):
    assert cli.main(["run-programs", str(tmp_path)]) == 2
    assert "job.json: cannot read the job file" in capsys.readouterr().err
    assert cli.main(["compile", STRATEGIES["tp"], "--out", str(tmp_path)]) == 0
    data = json.loads((tmp_path / "rank1.json").read_text())
    data["update"][0]["outputs"] = [-1]
    (tmp_path / "rank1.json").write_text(json.dumps(data))
    assert cli.main(["run-programs", str(tmp_path)]) == 2
    assert "rank1.json: program field update[0].outputs[0]: expected an integer >= 0, got -1" in capsys.readouterr().err
