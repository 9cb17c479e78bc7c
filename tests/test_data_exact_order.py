"""Exact data order across everything that changes a job's ranks: each rank of the Llama example
(real processes, gloo) records the sample ids it trains in every step; across (a) a planned switch,
(b) a rank SIGKILLed under --elastic, (c) a save and a resume under another strategy and world
size, and (d) mixed-length steps whose strategy changes, every sample of the epoch is trained
exactly once, in the order of an uninterrupted run, and the losses equal that run's (1e-5)."""

from __future__ import annotations

import io
import json
import sys
from pathlib import Path

import pytest

from hspmd.cli import main as cli
from hspmd.runtime.data.loader import DocumentLoader, SequenceLoader
from hspmd.runtime.data.order import DataState
from hspmd.runtime.data.tokens import TokenFiles
from hspmd.runtime.processes.launcher import launch
from tests.example_modules import example_module

pytestmark = [pytest.mark.multiprocess, pytest.mark.xdist_group("data_exact_order")]  # one worker: one reference run

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = str(ROOT / "examples" / "llama" / "train.py")
SMALL = ["--hidden", "16", "--heads", "2", "--ffn", "32", "--seq", "8"]
ROWS, STEPS = 12, 8  # the default strategy's global batch; the epoch ends inside step 7
PP4 = "layers=4 ; 12x1: R0 L0 | R1 L1 | R2 L2 | R3 L3"
PP2 = "layers=4 ; 6x2: R0 L0-1 | R1 L2-3"  # two ranks, the same 12 rows per step


@pytest.fixture(scope="module")
def dataset(tmp_path_factory) -> str:
    """The first shipped documents, about 6 steps' worth, prepared with `hspmd data prepare`."""
    directory = tmp_path_factory.mktemp("data")
    lines, size = [], 0
    for line in (ROOT / "examples" / "mixed_length" / "documents.txt").read_text(encoding="utf-8").splitlines():
        lines.append(line)
        size += len(line.encode())
        if size >= 6 * ROWS * 8:
            break
    (directory / "docs.txt").write_text("\n".join(lines) + "\n", encoding="utf-8")
    assert cli(["data", "prepare", str(directory / "docs.txt"), "--out", str(directory / "docs"), "--split", "lines"]) == 0
    return str(directory / "docs")


def run(tmp: Path, name: str, dataset: str, nprocs: int, *args: str, elastic: bool = False) -> tuple[dict, dict, str]:
    """Launch the example; (summary, {step: {rank: record}} keeping each rank's last record of a step, log)."""
    records, summary = tmp / name, tmp / f"{name}.json"
    out, err = io.StringIO(), io.StringIO()
    checkpoint = [] if "--checkpoint" in args else ["--checkpoint", str(tmp / f"{name}.safetensors")]
    code = launch([sys.executable, SCRIPT, *SMALL, "--data", dataset, "--record-samples", str(records), "--summary",
                   str(summary), *checkpoint, *args], nprocs, stdout=out, stderr=err, elastic=elastic)
    log = out.getvalue() + err.getvalue()
    assert code == 0, log
    steps: dict[int, dict[int, dict]] = {}
    for file in sorted(records.glob("rank*.jsonl")):
        rank = int(file.stem[4:])
        for line in file.read_text().splitlines():
            record = json.loads(line)
            steps.setdefault(record["step"], {})[rank] = record
    return json.loads(summary.read_text()), steps, log


def global_order(steps: dict[int, dict[int, dict]]) -> list[list[int]]:
    """Per step, the sample ids of the global batch in row order, from what the ranks trained: the
    ranks of one pipeline agree, and the pipelines' rows tile the batch once."""
    order = []
    for step in sorted(steps):
        batch: list[int | None] = [None] * ROWS
        for rank, record in steps[step].items():
            if record["pipeline"] is None:
                continue
            first, stop = record["rows"]
            assert len(record["ids"]) == stop - first, (step, rank, record)
            assert batch[first:stop] in ([None] * (stop - first), record["ids"]), (step, rank, record)
            batch[first:stop] = record["ids"]
        assert None not in batch, (step, batch)
        order.append(batch)
    return order


@pytest.fixture(scope="module")
def reference(tmp_path_factory, dataset):
    """The uninterrupted run: 4 ranks, the default heterogeneous strategy, no switch; it saves a
    sharded checkpoint every 3 steps (the resume below starts from its step 3)."""
    tmp = tmp_path_factory.mktemp("ref")
    summary, steps, _ = run(tmp, "ref", dataset, 4, "--steps", str(STEPS), "--sharded", "--save-every", "3",
                            "--checkpoint", str(tmp / "checkpoint"))
    order = global_order(steps)
    per_epoch = SequenceLoader(TokenFiles(dataset), 8).samples_per_epoch
    assert ROWS * (STEPS - 2) < per_epoch < ROWS * (STEPS - 1)
    flat = [i for batch in order for i in batch]
    assert flat == list(range(STEPS * ROWS))  # sample ids: epoch * per_epoch + index in the epoch
    assert [i for i in flat if i < per_epoch] == list(range(per_epoch))  # the epoch once, in order
    return summary["losses"], order, steps, tmp / "checkpoint" / "step-00000003"


def check_same(summary: dict, steps: dict, reference) -> None:
    losses, order = reference[:2]
    assert sorted(steps) == list(range(1, STEPS + 1))
    assert global_order(steps) == order
    assert summary["losses"] == pytest.approx(losses, rel=1e-5, abs=1e-5)


def test_a_planned_switch_keeps_the_order(tmp_path, dataset, reference):
    summary, steps, _ = run(tmp_path, "switch", dataset, 4, "--steps", str(STEPS), "--switch", f"3={PP4}")
    check_same(summary, steps, reference)
    assert {len(steps[5])} == {4} and all(r["rows"][1] - r["rows"][0] == 12 for r in steps[5].values())  # one pipeline
    assert sorted(steps[5][1]["fields"]) == [] and steps[5][0]["fields"] == ["tokens"]  # a middle stage reads nothing


def test_a_killed_rank_redoes_its_step_with_the_same_samples(tmp_path, dataset, reference):
    summary, steps, log = run(tmp_path, "elastic", dataset, 4, "--steps", str(STEPS), "--kill", "4=1:3", elastic=True)
    assert "rank 1 killed itself at step 4" in log, log
    assert [f["ranks"] for f in summary["failures"]] == [[1]]
    assert 1 not in steps[STEPS]  # the survivors trained the last steps
    check_same(summary, steps, reference)


def test_a_resume_under_another_strategy_and_world_size(tmp_path, dataset, reference):
    """The reference's sharded checkpoint of step 3 (4 ranks, heterogeneous DP), resumed on 2 ranks
    under a 2-stage pipeline."""
    losses, _, steps, saved = reference
    resumed, after, log = run(tmp_path, "after", dataset, 2, "--steps", str(STEPS), "--checkpoint", str(saved),
                              "--resume", "--strategy", PP2, "--sharded")
    assert f"resumed from {saved} at step 3; data at epoch 0, sample {3 * ROWS}" in log
    assert set(after) == set(range(4, STEPS + 1)) and all(set(r) == {0, 1} for r in after.values())
    before = {k: v for k, v in steps.items() if k <= 3}
    check_same({"losses": losses[:3] + resumed["losses"]}, {**before, **after}, reference)


def mixed_rank(backend, dataset: str, steps: int):
    """One rank of the mixed-length example's pool on DocumentLoader steps: per step the ids of
    the step, the sequences this rank read (indices), its pipeline, the strategy, the loss."""
    example = example_module("mixed_length")
    POOL, build = example.POOL, example.build

    import torch

    from hspmd.runtime.policies.mixed import MixedLengthTrainer

    torch.set_num_threads(1)
    trainer = MixedLengthTrainer(build(TokenFiles(dataset).vocab).graph, POOL, backend, symbols={"S": 16, "T": 16},
                                 passes=10)
    loader, state, out = DocumentLoader(dataset, longest=4 * 48), DataState(), []
    for _ in range(steps):
        step, state = loader.step(state, 48)
        loss = trainer.step(step)
        out.append((step.ids, sorted(step.read), trainer.trainer.pipeline, POOL[trainer.current].name, loss))
    return out


def test_mixed_length_steps_with_strategy_changes(tmp_path, dataset):
    """4 gloo ranks, the mixed-length example's pool (TP4, DP2TP2, DP4, TP2+2TP1) chosen per step:
    the pipelines of a step read disjoint sequences that together are the step's, each step the
    loader's next, every label of the epoch once; losses equal a single-device torch run."""
    from hspmd.ir import initial_value
    from hspmd.models.llama_reference import reference_training
    from hspmd.runtime.processes.multiprocess import run_multiprocess

    example = example_module("mixed_length")
    CONFIG, build = example.CONFIG, example.build

    files = TokenFiles(dataset)
    steps = 6
    results = run_multiprocess(mixed_rank, 4, dataset, steps, timeout=300)
    loader, state, expected = DocumentLoader(dataset, longest=4 * 48), DataState(), []
    for _ in range(steps):
        step, state = loader.step(state, 48)
        expected.append(step)
    strategies = {rank[k][3] for rank in results for k in range(steps)}
    assert len(strategies) >= 2, strategies
    labels: dict[int, list[int]] = {}
    for k, step in enumerate(expected):
        assert all(rank[k][0] == step.ids for rank in results)
        by_pipeline = {}
        for rank in results:
            if rank[k][2] is not None:
                assert by_pipeline.setdefault(rank[k][2], rank[k][1]) == rank[k][1]  # a pipeline's ranks agree
        read = sorted(i for indices in by_pipeline.values() for i in indices)
        assert read == list(range(len(step))), (k, by_pipeline)  # disjoint, and together the whole step
        for (epoch, document, offset), n in zip(step.ids, step.lengths):
            if epoch == 0:
                labels.setdefault(document, []).extend(range(offset + 1, offset + 1 + n))
    if expected[-1].ids[-1][0] > 0:  # the epoch ended: every label of it once
        assert {d: sorted(v) for d, v in labels.items()} == {
            d: list(range(1, files.length(d))) for d in range(files.documents) if files.length(d) >= 2}
    model = build(files.vocab)
    initial = {n.name: initial_value(n) for n in model.graph.parameters}
    data = [[step[i] for i in range(len(step))] for step in expected]
    history, _ = reference_training(initial, lambda s: list(data[s]), CONFIG["layers"], CONFIG["heads"], steps, lr=3e-3)
    for k, (ref, _) in enumerate(history):
        assert results[0][k][4] == pytest.approx(ref, rel=1e-5, abs=1e-5), k
