"""The loaders: an epoch's order is a permutation of the documents, its samples tile the stream
once, a step's global batch is a slice of the order, and each rank reads its pipeline's rows only;
training on the ranks' shares equals training on the global batch and a single-device torch run."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from hspmd.ir import initial_value
from hspmd.models.llama import LlamaConfig, build_llama
from hspmd.models.llama_reference import reference_training
from hspmd.ops import AdamW
from hspmd.runtime.data.loader import DocumentLoader, SequenceLoader
from hspmd.runtime.data.order import DataState, permuted
from hspmd.runtime.data.tokens import DataError, TokenFiles, TokenWriter
from hspmd.runtime.execution.batches import MicroBatchLayout, PipelineBatch
from hspmd.runtime.policies.mixed import MixedLengthTrainer
from hspmd.runtime.training.inprocess import InProcessJob
from hspmd.specialize.strategy_text import parse_strategy

HETERO = "layers=2 ; 2x2: R0,1 L0-1 ; 2x1: R2 L0 | R3 L1"


def make_dataset(directory, lengths, vocab=64, seed=0) -> TokenFiles:
    """Documents of the given lengths; token t of document d is (d * 7 + t) % vocab."""
    writer = TokenWriter(str(directory / "d"), vocab)
    for d, n in enumerate(lengths):
        writer.add((np.arange(n) + d * 7) % vocab, f"document {d}")
    writer.close()
    return TokenFiles(directory / "d")


def stream(files: TokenFiles, seed: int, epoch: int) -> np.ndarray:
    """Epoch `epoch`'s documents in their order, back to back (the definition the loader must meet)."""
    order = [permuted(i, files.documents, seed, epoch) for i in range(files.documents)]
    assert sorted(order) == list(range(files.documents))
    return np.concatenate([np.asarray(files.document(d), dtype=np.int64) for d in order])


def test_permutation_is_a_bijection_that_changes_with_epoch_and_seed():
    cases = 0
    for count in (1, 2, 3, 5, 17, 64, 100, 1000):
        for seed in (0, 9):
            for epoch in (0, 1):
                order = [permuted(i, count, seed, epoch) for i in range(count)]
                assert sorted(order) == list(range(count))
                cases += 1
    assert [permuted(i, 1000, 0, 0) for i in range(20)] != [permuted(i, 1000, 0, 1) for i in range(20)]
    assert [permuted(i, 1000, 0, 0) for i in range(20)] != [permuted(i, 1000, 1, 0) for i in range(20)]
    assert cases == 32
    with pytest.raises(DataError):
        permuted(5, 5, 0, 0)


def test_epochs_tile_the_shuffled_stream(tmp_path_factory):
    """Sample j of epoch e is stream(e)[j*seq : j*seq + seq + 1]; skipping composes; every id of
    an epoch comes once, in order, before the next epoch's."""
    checked = {"cases": 0}

    @settings(max_examples=40, deadline=None)
    @given(st.lists(st.integers(1, 30), min_size=1, max_size=12), st.integers(1, 9), st.integers(0, 3),
           st.integers(0, 40), st.integers(1, 25))
    def check(lengths, seq, seed, start, count):
        if sum(lengths) < seq + 1:
            return
        files = make_dataset(tmp_path_factory.mktemp("s"), lengths)
        loader = SequenceLoader(files, seq, seed)
        per = loader.samples_per_epoch
        assert per == (sum(lengths) - 1) // seq
        origin = loader.skip(DataState(), start)
        windows, ids = loader.windows(origin, count)
        assert ids == tuple(range(start, start + count)) == loader.ids(origin, count)
        for row, sample in zip(windows, ids):
            epoch, j = divmod(sample, per)
            assert row.tolist() == stream(files, seed, epoch)[j * seq: j * seq + seq + 1].tolist()
        split = count // 2
        assert loader.skip(loader.skip(origin, split), count - split) == loader.skip(origin, count)
        assert loader.windows(loader.skip(origin, split), count - split)[0].tolist() == windows[split:].tolist()
        state = DataState.from_json(origin.to_json(), "test")
        assert state == origin
        checked["cases"] += 1

    check()
    assert checked["cases"] >= 25, checked


def test_documents_give_every_label_once_per_epoch(tmp_path):
    lengths = [1, 5, 40, 3, 2, 17, 90]
    files = make_dataset(tmp_path, lengths)
    loader = DocumentLoader(files, longest=16, seed=3)
    state, seen = DataState(), {}
    while state.epoch == 0:
        step, state = loader.step(state, 20)
        assert step.counted >= 20 or state.epoch > 0
        for i, (epoch, document, offset) in enumerate(step.ids):
            tokens, labels = step[i]
            assert len(tokens) == step.lengths[i] <= 16
            expected = np.asarray(files.document(document), dtype=np.int64)
            assert tokens.tolist() == expected[offset: offset + len(tokens)].tolist()
            assert labels.tolist() == expected[offset + 1: offset + 1 + len(tokens)].tolist()
            if epoch == 0:
                seen.setdefault(document, []).extend(range(offset + 1, offset + 1 + len(tokens)))
    assert {d: sorted(v) for d, v in seen.items()} == {d: list(range(1, n)) for d, n in enumerate(lengths) if n >= 2}
    assert all(len(v) == len(set(v)) for v in seen.values())
    again, _ = loader.step(DataState(), 20)
    assert again.ids == loader.step(DataState(), 20)[0].ids and again.reads == 0


def test_bad_loader_input(tmp_path):
    (tmp_path / "ones").mkdir()
    files = make_dataset(tmp_path, [3, 2])
    with pytest.raises(DataError, match="make no sequence of 8"):
        SequenceLoader(files, 8)
    with pytest.raises(DataError, match="every document has fewer than 2 tokens"):
        DocumentLoader(make_dataset(tmp_path / "ones", [1, 1, 1]), longest=4).step(DataState(), 5)
    with pytest.raises(DataError, match="data state is damaged"):
        DataState.from_json('{"epoch": -1, "sample": 0, "document": 0, "offset": 0}', "ckpt")
    with pytest.raises(DataError, match="ckpt: the data state is damaged"):
        DataState.from_json("{", "ckpt")


def shares(job: InProcessJob, loader: SequenceLoader, state: DataState):
    """Every rank's share of the step at `state`, and the state after it (the same on every rank)."""
    out = {rank: loader.share(trainer, state) for rank, trainer in job.trainers.items()}
    assert len({after for _, after in out.values()}) == 1
    return {rank: share for rank, (share, _) in out.items()}, next(iter(out.values()))[1]


def test_ranks_read_their_pipeline_rows_only_and_train_as_one_device(tmp_path):
    """Heterogeneous DP (a TP2 pipeline, a 2-stage pipeline): each rank reads its pipeline's rows of
    the placeholders its program takes; the losses equal the global batch's and a torch run's."""
    files = make_dataset(tmp_path, [23, 5, 61, 14, 9, 30, 44, 8], vocab=64)
    seq, steps = 8, 3
    loader = SequenceLoader(files, seq, seed=1)
    strategy = parse_strategy(HETERO)
    config = LlamaConfig(vocab=64, hidden=16, layers=2, heads=2, ffn=32)
    model = build_llama(config, [strategy], optimizer=AdamW(lr=1e-3))
    layout = MicroBatchLayout.of(strategy)
    assert layout == MicroBatchLayout((2, 2), (2, 1))
    rows = layout.global_batch_size
    job = InProcessJob(model.graph, 0, layout, symbols={"S": seq, "T": rows * seq})
    state, batches = DataState(), []
    initial = {n.name: initial_value(n) for n in model.graph.parameters}
    losses = []
    for _ in range(steps):
        batch, ids = loader.batch(state, rows)
        per_rank, after = shares(job, loader, state)
        assert after == loader.skip(state, rows)
        assert set(per_rank[0].rows) == {"tokens", "labels"} == set(per_rank[1].rows)
        assert set(per_rank[2].rows) == {"tokens"} and set(per_rank[3].rows) == {"labels"}  # first / last stage
        for share in per_rank.values():
            first, stop = layout.pipeline_rows(share.pipeline)
            assert share.ids == ids[first:stop]
            for name, value in share.rows.items():
                assert torch.equal(value, batch[name][first:stop])
        losses.append(job.world.run(lambda b: job.trainers[b.rank].step(per_rank[b.rank]))[0])
        batches.append((batch["tokens"], batch["labels"]))
        state = after
    assert state.sample == steps * rows
    history, _ = reference_training(initial, lambda k: batches[k], config.layers, config.heads, steps, lr=1e-3)
    for loss, (ref, _) in zip(losses, history):
        assert loss == pytest.approx(ref, rel=1e-5, abs=1e-6)
    wrong = PipelineBatch(1, per_rank[0].rows)
    with pytest.raises(Exception, match="trains pipeline 0, the batch given holds the rows of pipeline 1"):
        job.trainers[0].step(wrong)


def test_vocabulary_larger_than_the_model_is_refused(tmp_path):
    files = make_dataset(tmp_path, [40, 40], vocab=300)
    strategy = parse_strategy("layers=1 ; 1x1: R0 L0")
    model = build_llama(LlamaConfig(vocab=64, hidden=8, layers=1, heads=2, ffn=16), [strategy], optimizer=AdamW(lr=1e-3))
    job = InProcessJob(model.graph, 0, strategy, symbols={"S": 4, "T": 4 * strategy.pipelines[0].micro_batch_size
                                                          * strategy.pipelines[0].micro_batches})
    with pytest.raises(DataError, match="vocabulary of 300 ids is larger than the model's 64"):
        SequenceLoader(files, 4).share(job.trainers[0], DataState())


def mixed_rank(backend, files: TokenFiles, steps: int, buckets: bool):
    """One rank of mixed-length training on the loader's document steps: the ids of every step,
    the sequences this rank read, the losses and what dispatch gave this rank's pipeline."""
    from tests.test_mixed_length import POOL, _graph

    torch.set_num_threads(1)
    trainer = MixedLengthTrainer(_graph().graph, POOL, backend, symbols={"S": 8, "T": 8}, passes=10)
    loader, state = DocumentLoader(files, longest=30, seed=5), DataState()
    out = []
    for _ in range(steps):
        step, state = loader.step(state, 24)
        loss = (trainer.step_buckets if buckets else trainer.step)(step)
        report = trainer.history[-1]
        mine = 0
        if not buckets and trainer.trainer.pipeline is not None:
            mine = sum(1 for p in report.dispatches[0].assignment if p == trainer.trainer.pipeline)
        out.append((step.ids, step.reads, mine, loss, [POOL[k].name for k in report.entries]))
    return out, trainer.parameters()


@pytest.mark.parametrize("buckets", [False, True], ids=["per-step strategy", "length buckets"])
def test_mixed_length_ranks_read_only_their_dispatched_sequences(tmp_path, buckets):
    """Mixed-length steps from a DocumentLoader under changing strategies: each rank reads only the
    sequences dispatched to its pipeline; losses and weights equal a single-device run of the
    same sequences."""
    from hspmd.backends.local import LocalWorld
    from hspmd.testing import assert_weights_close
    from tests.test_mixed_length import CONFIG, LR, _graph

    files = make_dataset(tmp_path, [3, 25, 7, 40, 12, 5, 31, 9, 18, 2, 14, 60, 6, 8, 10, 4, 11, 6, 9, 7],
                         vocab=CONFIG["vocab"])
    steps = 7  # the longest sequences of the steps: 17 30 24 30 29 30 9 (S2 takes the last)
    results = LocalWorld(range(4), 120).run(lambda b: mixed_rank(b, files, steps, buckets))
    records = {rank: r[0] for rank, r in results.items()}
    ids = [rec[0] for rec in records[0]]
    assert all([rec[0] for rec in r] == ids for r in records.values())
    names = {name for rec in records[0] for name in rec[4]}
    assert names == {"S1", "S2"}, names  # the strategy changes across (or inside) steps
    total = [len(i) for i in ids]
    reads = [sum(rec[1] for rec in r) for r in records.values()]
    assert max(reads) < sum(total) * 4, "every rank read every sequence"
    if not buckets:
        for r in records.values():
            assert [rec[1] for rec in r] == [rec[2] for rec in r]  # exactly its pipeline's sequences
    loader, state, data = DocumentLoader(files, longest=30, seed=5), DataState(), []
    for _ in range(steps):
        step, state = loader.step(state, 24)
        data.append([step[i] for i in range(len(step))])
    model = _graph()
    initial = {n.name: initial_value(n) for n in model.graph.parameters}
    history, final = reference_training(initial, lambda s: list(data[s]), CONFIG["layers"], CONFIG["heads"], steps, lr=LR)
    for rec, (ref, _) in zip(records[0], history):
        assert rec[3] == pytest.approx(ref, abs=1e-5, rel=1e-5)
    for name, value in final.items():
        assert_weights_close(results[0][1][name], value, LR, name)


def test_the_data_state_rides_in_both_checkpoint_formats(tmp_path):
    """save_checkpoint / save_sharded keep the loader's state; saved_state reads it back (None
    without one); a damaged one is named by its file."""
    from hspmd.errors import CheckpointError
    from hspmd.runtime.data.loader import saved_state
    from hspmd.runtime.persistence.checkpoint import DATA_KEY

    strategy = parse_strategy(HETERO)
    model = build_llama(LlamaConfig(vocab=64, hidden=16, layers=2, heads=2, ffn=32), [strategy], optimizer=AdamW(lr=1e-3))
    job = InProcessJob(model.graph, 0, strategy, symbols={"S": 8, "T": 96})
    state = DataState(epoch=2, sample=37, document=5, offset=11)
    single, sharded, bare = tmp_path / "c.safetensors", tmp_path / "sharded", tmp_path / "bare.safetensors"
    job.world.run(lambda b: job.trainers[b.rank].save_checkpoint(single, data=state.to_json()))
    job.world.run(lambda b: job.trainers[b.rank].save_sharded(sharded, background=False, data=state.to_json()))
    job.world.run(lambda b: job.trainers[b.rank].save_checkpoint(bare))
    assert saved_state(str(single)) == state == saved_state(str(sharded))
    assert saved_state(str(bare)) is None
    index = sharded / "step-00000000" / "index.json"
    text = json.loads(index.read_text())
    text["data"] = 7
    index.write_text(json.dumps(text))
    with pytest.raises(CheckpointError, match="index field data: "):
        saved_state(str(sharded))
    text["data"] = '{"epoch": 1}'
    index.write_text(json.dumps(text))
    with pytest.raises(DataError, match=f"{index.parent}: the data state is damaged"):
        saved_state(str(sharded))
    assert DATA_KEY == "hspmd.data"
