"""Property tests of the annotation algebra (hypothesis, >= 1,000 examples per property)."""

import re

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import hspmd
from hspmd.annotations import (
    Annotation,
    DeviceGroup,
    DistributedStates,
    Duplicate,
    Partial,
    Split,
    Subgroup,
    device_piece,
    device_pieces,
    expand_hsize,
    parse,
    shard,
    subgroup_pieces,
    subgroup_regions,
    unshard,
)
from hspmd.errors import AnnotationError, HSPMDError, ReplicaMismatch
from hspmd.testing import annotations, shapes

MANY = settings(max_examples=1000, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@st.composite
def annotated_tensors(draw, allow_partial=True):
    ndim = draw(st.integers(1, 3))
    ann = draw(annotations(ndim, allow_partial=allow_partial))
    shape = draw(shapes(ndim))
    seed = draw(st.integers(0, 2**16))
    x = torch.randn(shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    return ann, x, seed


@MANY
@given(annotated_tensors())
def test_shard_unshard_round_trip(case):
    ann, x, seed = case
    locals_ = shard(x, ann, seed=seed)
    assert set(locals_) == set(ann.devices)
    torch.testing.assert_close(unshard(locals_, ann), x, rtol=1e-9, atol=1e-9)
    torch.testing.assert_close(unshard(locals_, ann, shape=x.shape, ratios=ann.ratios), x, rtol=1e-9, atol=1e-9)


@MANY
@given(annotated_tensors())
def test_pieces_tile_each_region_exactly_once(case):
    ann, x, _ = case
    shape = tuple(x.shape)
    regions = subgroup_regions(ann, shape)
    whole = torch.zeros(shape, dtype=torch.int64)
    for sub, region in zip(ann.subgroups, regions):
        pieces = subgroup_pieces(sub, region)
        by_summand: dict[tuple, dict[tuple, int]] = {}
        for piece in pieces.values():
            holders = by_summand.setdefault(piece.summand, {})
            holders[piece.box] = holders.get(piece.box, 0) + 1
        assert len(by_summand) == sub.ds.partial_count
        for holders in by_summand.values():
            filled = [n for box, n in holders.items() if all(b > a for a, b in box)]
            assert set(filled) <= {sub.ds.duplicate_count}
            cover = torch.zeros(shape, dtype=torch.int64)
            for box in holders:
                cover[tuple(slice(a, b) for a, b in box)] += 1
            region_view = cover[tuple(slice(a, b) for a, b in region)]
            assert bool((region_view == 1).all())
            assert int(cover.sum()) == region_view.numel()
        whole[tuple(slice(a, b) for a, b in region)] += 1
    expected = 1 if isinstance(ann.hdim, int) else ann.hsize
    assert bool((whole == expected).all())


@MANY
@given(st.integers(1, 3).flatmap(lambda n: annotations(n, bound_ratios=False)))
def test_text_round_trip_and_hash(ann):
    text = str(ann)
    again = parse(text)
    assert again == ann and hash(again) == hash(ann) and str(again) == text
    spaced = parse(re.sub(r"([\[\]{}|,@:()-])", r" \1 ", text))
    assert spaced == ann and hash(spaced) == hash(ann)
    expanded = text.replace("-", "~")

    def spell(match):
        a, b = int(match.group(1)), int(match.group(2))
        return ",".join(map(str, range(a, b + 1)))

    assert parse(re.sub(r"(\d+)~(\d+)", spell, expanded)) == ann


@MANY
@given(st.integers(1, 2).flatmap(lambda n: st.tuples(annotations(n, max_devices=4), annotations(n, max_devices=4))))
def test_equality_and_hash_agree(pair):
    a, b = pair
    assert (a == b) == (str(a) == str(b))
    if a == b:
        assert hash(a) == hash(b)


@MANY
@given(annotated_tensors(allow_partial=False), st.data())
def test_a_corrupted_replica_is_caught(case, data):
    ann, x, seed = case
    pieces = device_pieces(ann, tuple(x.shape))
    holders: dict[tuple, list[int]] = {}
    for device, piece in pieces.items():
        holders.setdefault(piece.box, []).append(device)
    shared = [devs for box, devs in holders.items() if len(devs) > 1 and all(b > a for a, b in box)]
    if not shared:
        return
    devices = data.draw(st.sampled_from(shared))
    locals_ = shard(x, ann, seed=seed)
    locals_[devices[-1]] = locals_[devices[-1]] + 1.0
    try:
        unshard(locals_, ann)
    except ReplicaMismatch as exc:
        assert str(devices[-1]) in str(exc)
    else:
        raise AssertionError("a corrupted replica went unnoticed")


@MANY
@given(annotated_tensors())
def test_expand_hsize_keeps_the_layout(case):
    ann, x, seed = case
    if ann.hsize != 1 or not ann.subgroups[0].ds.axes:
        return
    outer = ann.subgroups[0].ds.axes[0]
    hsize = outer.n if isinstance(outer, Split) else [d for d in range(2, outer.n + 1) if outer.n % d == 0][0]
    wide = expand_hsize(ann, hsize)
    assert wide.hsize == hsize and set(wide.devices) == set(ann.devices)
    if not ann.has_partial:
        assert device_pieces(wide, tuple(x.shape)) == device_pieces(ann, tuple(x.shape))
    torch.testing.assert_close(unshard(shard(x, ann, seed=seed), wide), x, rtol=1e-9, atol=1e-9)


SYNTAX = "SDPH0123456789:,@[]{}|()-; x"


@MANY
@given(st.text(alphabet=SYNTAX, max_size=30))
def test_random_text_parses_or_raises_hspmd_error(text):
    try:
        ann = parse(text)
    except HSPMDError:
        return
    assert parse(str(ann)) == ann


junk = st.one_of(st.integers(-3, 5), st.booleans(), st.text(max_size=2), st.none(), st.floats(allow_nan=True))


def _is_count(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


@MANY
@given(st.data())
def test_random_constructor_arguments_raise_an_annotation_error_naming_the_bad_value(data):
    """Junk arguments raise AnnotationError (never a TypeError or a bare assertion), and the message
    names the type being built and the offending value (or the counts that disagree)."""
    kind = data.draw(st.sampled_from(["split", "duplicate", "partial", "devices", "subgroup", "union"]))
    if kind == "split":
        dim, n = data.draw(junk), data.draw(junk)
        dim_ok = isinstance(dim, int) and not isinstance(dim, bool) and dim >= 0
        build, words = (lambda: Split(dim, n)), ["Split", repr(dim) if not dim_ok else repr(n)]
        valid = dim_ok and _is_count(n)
    elif kind in ("duplicate", "partial"):
        n = data.draw(junk)
        cls = Duplicate if kind == "duplicate" else Partial
        build, words, valid = (lambda: cls(n)), [cls.__name__, repr(n)], _is_count(n)
    elif kind == "devices":
        devices = tuple(data.draw(st.lists(junk, max_size=4)))
        ok = all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in devices)
        valid = ok and bool(devices) and len(set(devices)) == len(devices)
        build, words = (lambda: DeviceGroup(devices)), ["device"]
    elif kind == "subgroup":
        n = data.draw(st.integers(1, 4))
        build, words, valid = (lambda: Subgroup(DeviceGroup((0, 1)), DistributedStates((Split(0, n),)))), [
            f"describe {n} device(s)", "[0,1] has 2"], n == 2
    else:
        other = data.draw(st.integers(0, 2))
        hdim = data.draw(st.one_of(junk, st.sampled_from(["D", "P"])))
        ratios = data.draw(st.one_of(st.none(), st.lists(junk, max_size=3).map(tuple)))
        def build():
            return Annotation((Subgroup(DeviceGroup((0,))), Subgroup(DeviceGroup((other,)))), hdim, ratios)
        words, valid = [], None
    try:
        build()
    except HSPMDError as error:
        assert isinstance(error, AnnotationError), f"{type(error).__name__}: {error}"
        message = str(error)
        assert valid is not True, f"valid arguments were refused: {message}"
        for word in words:
            assert word in message, f"{word!r} not in {message!r}"
        if kind == "union":
            assert any(w in message for w in ("subgroup", "HDim", "ratio", "device")), message
    else:
        assert valid is not False, f"{kind}: invalid arguments were accepted"


@settings(max_examples=300, deadline=None)
@given(annotated_tensors(), st.integers(0, 4))
def test_split_dims_outside_the_rank_are_rejected(case, extra):
    ann, x, seed = case
    split_dims = [d for s in ann.subgroups for d in s.ds.split_dims] + ([ann.hdim] if isinstance(ann.hdim, int) else [])
    if not split_dims:
        return
    low_rank = torch.zeros((2,) * (max(split_dims)))
    try:
        shard(low_rank, ann, seed=seed)
    except hspmd.HSPMDError as exc:
        assert "outside" in str(exc)
    else:
        raise AssertionError(f"{ann} accepted a rank-{low_rank.dim()} tensor")


@MANY
@given(st.integers(1, 3).flatmap(lambda n: st.tuples(annotations(n), annotations(n), shapes(n))), st.data())
def test_one_devices_piece_is_its_piece_of_the_union_and_of_unions_made_subgroup_by_subgroup(case, data):
    """device_piece reads one subgroup where device_pieces passes over the union; both agree, also
    for a union with one subgroup replaced (the planners' intermediate layouts, which keep the
    union's device index and regions) and for a device the union does not hold."""
    ann, other, shape = case
    k = data.draw(st.integers(0, ann.hsize - 1))
    sub = ann.subgroups[k]
    states = data.draw(st.sampled_from([s.ds for s in other.subgroups if s.ds.size == len(sub.dg)] or [sub.ds]))
    for layout in (ann, ann.with_subgroup(k, Subgroup(sub.dg, states))):
        pieces = device_pieces(layout, shape)
        for device in set(layout.devices) | {max(layout.devices) + 1}:
            assert device_piece(layout, shape, device) == pieces.get(device)
