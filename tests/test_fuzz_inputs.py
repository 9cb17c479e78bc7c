"""Fuzz tests of the user-facing parsers and value entry points.

Random mutations of valid inputs (unicode digits, huge numbers, broken brackets, repeated parts)
and random text or bytes: every call either gives a result equal to the reference or raises an
HSPMDError, within tests/fuzzing.DEADLINE. Counts per entry point: run with
--hypothesis-show-statistics.
"""

from __future__ import annotations

import contextlib
import io
import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from hspmd import parse, shard, unshard
from hspmd.annotations import device_pieces
from hspmd.backends.plan_executor import reshard_tensor, run_plan
from hspmd.cli import main as cli_main
from hspmd.comm_resolve import resolve
from hspmd.errors import HSPMDError
from hspmd.specialize.strategy_files import load_strategies, save_strategy
from hspmd.specialize.strategy_text import format_strategy, parse_strategy
from tests.fuzzing import fuzz_settings, fuzzed_text, mutated_bytes, outcome

ANNOTATIONS = [
    "S0:2@[0,1]", "@[0]", "D:2,S1:2@[0-3]", "P:2@[2,3]", "HP{S1:4@[0-3] | S1:2@[4,5]}",
    "H0(2:1){S1:2@[0,1] | @[2]}", "H1{S0:2@[0,1] | D:2@[2,3]}", "HD{P:2@[0,1] | S0:2@[2,3]}",
    "S0:2,S0:2@[3,2,1,0]",
]
TOPOLOGIES = ["2x4", "1x8", "nvlink-ib:2x4", "h800-h20:1+1", "h800-h20:1+1x4"]
STRATEGIES = [
    "33x1: R0-3 L0-14 | R4-7 L15-29 ; 31x1: R16-19 L0-15 | R28,29 L16-25 | R30 L26-29",
    "name=c1 ; 16x2: R0-3 L0-59 ; zero",
    "?x?: R0-15 L0-59 ; ?x3: R16-19 L0-59 ; 5x?: R20,22,21 L0-59",
    "1x1: R7 L0 ; layers=1",
    "2x4: R0,1 L0-3 tp2 ; 2x2: R2 L0-1 | R3 L2-3",
]


@fuzz_settings(600)
@given(fuzzed_text(ANNOTATIONS))
def test_parse_gives_a_round_tripping_annotation_or_an_hspmd_error(text):
    ok, ann = outcome("parse", lambda: parse(text))
    if ok:
        assert parse(str(ann)) == ann
        assert all(ch.isascii() for ch in str(ann))


def _small(ann) -> bool:
    return len(ann.devices) <= 16


def _run_time_ratios(ann, weight: int):
    """Equal ratios for a layout that leaves them to run time (resolve refuses contradicting ones)."""
    return None if ann.ratios is not None else (weight,) * ann.hsize


@fuzz_settings(250)
@given(st.sampled_from(ANNOTATIONS) | fuzzed_text(ANNOTATIONS), st.sampled_from(ANNOTATIONS),
       st.lists(st.integers(-2, 9), min_size=1, max_size=3),
       st.none() | fuzzed_text(TOPOLOGIES), st.booleans())
def test_resolve_gives_a_plan_that_reshards_correctly_or_an_hspmd_error(src, dst, shape, topology, swap):
    if swap:
        src, dst = dst, src

    def run():
        src_ann, dst_ann = parse(src), parse(dst)
        if not (_small(src_ann) and _small(dst_ann)):
            return None  # a valid but large layout: parsing it is the bounded part tested here
        return resolve(src_ann, dst_ann, tuple(shape), topology, src_ratios=_run_time_ratios(src_ann, 1),
                       dst_ratios=_run_time_ratios(dst_ann, 2))

    ok, plan = outcome("resolve", run)
    if ok and plan is not None:
        x = torch.randn(tuple(shape), generator=torch.Generator().manual_seed(0))
        assert torch.allclose(reshard_tensor(plan, x), x, atol=1e-5)


NUMBERS = st.one_of(st.integers(-3, 5), st.sampled_from([10**30, -(10**5000), True, 2.5, math.nan, "2", None]))


@fuzz_settings(300)
@given(st.sampled_from(ANNOTATIONS), st.lists(st.integers(0, 7), min_size=1, max_size=3),
       st.none() | st.lists(NUMBERS, max_size=3), st.sampled_from([torch.float32, torch.float64, torch.int64]))
def test_shard_and_device_pieces_with_fuzzed_ratios(text, shape, ratios, dtype):
    ann = parse(text)
    x = (torch.arange(math.prod(shape)) % 7).reshape(shape).to(dtype)
    ok, locals_ = outcome("shard", lambda: shard(x, ann, ratios=ratios))
    if ok:
        assert torch.equal(unshard(locals_, ann, shape=tuple(shape), ratios=ratios), x) or x.is_floating_point()
        assert torch.allclose(unshard(locals_, ann, shape=tuple(shape), ratios=ratios).double(), x.double(), atol=1e-5)
    ok, pieces = outcome("device_pieces", lambda: device_pieces(ann, shape, ratios))
    if ok:
        assert set(pieces) == set(ann.devices)
        assert all(start <= stop for p in pieces.values() for start, stop in p.box)


@st.composite
def broken_locals(draw):
    """Valid locals of an annotation with one device's tensor changed (dtype, rank, shape, type)."""
    text = draw(st.sampled_from(ANNOTATIONS))
    ann = parse(text)
    shape = tuple(draw(st.lists(st.integers(1, 6), min_size=2, max_size=2)))
    x = torch.randn(shape, generator=torch.Generator().manual_seed(1))
    locals_ = shard(x, ann, ratios=(1,) * ann.hsize)
    device = draw(st.sampled_from(sorted(locals_)))
    kind = draw(st.sampled_from(("dtype", "rank", "shape", "type", "missing", "value", "none")))
    t = locals_[device]
    if kind == "dtype":
        locals_[device] = t.to(draw(st.sampled_from([torch.float16, torch.float64, torch.int32])))
    elif kind == "rank":
        locals_[device] = t.reshape(-1) if t.dim() > 1 else t.reshape(1, -1)
    elif kind == "shape":
        locals_[device] = torch.zeros([s + 1 for s in t.shape])
    elif kind == "type":
        locals_[device] = t.tolist()
    elif kind == "missing":
        del locals_[device]
    elif kind == "value" and t.numel():
        locals_[device] = t + 1
    return ann, x, locals_, kind


@fuzz_settings(300)
@given(broken_locals())
def test_unshard_of_broken_locals_is_correct_or_an_hspmd_error(case):
    ann, x, locals_, kind = case
    ok, y = outcome("unshard", lambda: unshard(locals_, ann, ratios=(1,) * ann.hsize))
    if ok:
        # accepted (e.g. a changed value or rank on a device without a replica): y must be the
        # tensor those locals describe, so sharding it again gives the same local shapes and dtype
        # and, without Partial summands, the same values
        again = shard(y, ann, ratios=(1,) * ann.hsize)
        for device, local in locals_.items():
            assert again[device].dtype == local.dtype and again[device].shape == local.shape
            if not ann.has_partial:
                assert torch.allclose(again[device], local, atol=1e-5)
        if kind == "none":
            assert torch.allclose(y, x, atol=1e-5)


@fuzz_settings(150)
@given(st.sampled_from(ANNOTATIONS), st.sampled_from(ANNOTATIONS), broken_locals())
def test_run_plan_with_wrong_locals_is_correct_or_an_hspmd_error(src, dst, case):
    ann, x, locals_, kind = case
    plan = resolve(ann, dst, tuple(x.shape), src_ratios=_run_time_ratios(ann, 1),
                   dst_ratios=_run_time_ratios(parse(dst), 1))
    ok, out = outcome("run_plan", lambda: run_plan(plan, locals_, timeout=30))
    if ok and kind == "none":
        assert torch.allclose(unshard(out, plan.dst, shape=plan.shape), x, atol=1e-5)


@fuzz_settings(500)
@given(fuzzed_text(STRATEGIES))
def test_strategy_text_round_trips_or_raises_an_hspmd_error(text):
    ok, strategy = outcome("strategy text", lambda: parse_strategy(text))
    if ok:
        assert parse_strategy(format_strategy(strategy)) == strategy


def _file_bytes(tmp_dir, suffix: str) -> bytes:
    path = tmp_dir / f"valid{suffix}"
    save_strategy([parse_strategy(t) for t in STRATEGIES[:2]], path)
    return path.read_bytes()


@fuzz_settings(250)
@given(st.sampled_from([".json", ".yaml"]), st.data())
def test_strategy_files_load_equal_or_raise_an_hspmd_error(tmp_path_factory, suffix, data):
    tmp_dir = tmp_path_factory.mktemp("strategy", numbered=True)
    raw = data.draw(mutated_bytes(_file_bytes(tmp_dir, suffix)))
    path = tmp_dir / f"fuzzed{suffix}"
    path.write_bytes(raw)
    ok, strategies = outcome("strategy files", lambda: load_strategies(path))
    if ok:
        again = tmp_dir / f"again{suffix}"
        save_strategy(list(strategies), again)
        assert load_strategies(again) == strategies


EXPLAIN = [["S0:2@[0,1]", "@[0]", "--shape", "4,6"], ["HP{S1:2@[0,1] | @[2]}", "S0:3@[0-2]", "--shape", "6,4", "--json"],
           ["P:2@[0,1]", "S1:2@[2,3]", "--shape", "4,4", "--topology", "2x2", "--dtype", "float16"]]


@st.composite
def explain_argv(draw) -> list[str]:
    argv = list(draw(st.sampled_from(EXPLAIN)))
    at = draw(st.integers(0, len(argv) - 1))
    argv[at] = draw(fuzzed_text([argv[at]]))
    if draw(st.booleans()):
        argv.insert(draw(st.integers(0, len(argv))), draw(st.sampled_from(["--topology", "100000x100000", "--src-ratios",
                                                                         "0,0", "--shape", "٢", "--bogus", "-h2"])))
    return argv


@fuzz_settings(120)
@given(explain_argv())
def test_cli_explain_prints_a_plan_or_one_error_line(argv):
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = cli_main(["explain", *argv])
        except SystemExit as exc:  # --help
            code = exc.code
    assert "Traceback" not in err.getvalue()
    if code == 2:
        assert err.getvalue().startswith("hspmd: error: ") and err.getvalue().count("\n") == 1
    else:
        assert code == 0, err.getvalue()
    outcome("CLI explain", lambda: (_ for _ in ()).throw(HSPMDError("exit 2")) if code == 2 else code)


RUN = [["-n", "2", "--grace", "1", "--heartbeat", "30", "--port", "29500", "missing_script.py"],
       ["-n", "4", "--backend", "gloo", "missing_script.py", "--steps", "3"]]


@st.composite
def run_argv(draw) -> list[str]:
    argv = list(draw(st.sampled_from(RUN)))
    at = draw(st.integers(0, len(argv) - 2))  # the script stays missing: nothing is launched
    argv[at] = draw(fuzzed_text([argv[at]]))
    return argv


@pytest.mark.parametrize("argv", [
    ["run", "-n--", "2", "missing_script.py"],                 # argparse set -n to [] (found by the fuzzer)
    ["run", "-n", "2", "--port=--", "missing_script.py"],
    ["run-programs", "missing_dir", "--steps=--"],
])
def test_an_option_given_only_dashes_is_one_error_line(argv):
    err = io.StringIO()
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(err):
        code = cli_main(argv)
    assert code == 2 and err.getvalue().count("\n") == 1 and "expected one value, got '--'" in err.getvalue()


@fuzz_settings(100)
@given(run_argv())
def test_cli_run_arguments_give_one_error_line(argv):
    """Launcher arguments (-n, --grace, --heartbeat, --port, --backend) fuzzed; the script never
    exists, so every accepted argument list still ends in the one-line 'does not exist' error."""
    err = io.StringIO()
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(err):
        try:
            code = cli_main(["run", *argv])
        except SystemExit as exc:  # --help
            code = exc.code
    assert "Traceback" not in err.getvalue()
    if code != 0:
        assert code == 2 and err.getvalue().startswith("hspmd: error: ") and err.getvalue().count("\n") == 1
    outcome("CLI run arguments", lambda: (_ for _ in ()).throw(HSPMDError("exit 2")) if code == 2 else code)
