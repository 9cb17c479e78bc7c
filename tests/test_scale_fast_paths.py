"""The shortcuts that keep a rank's specialization cheap at thousands of devices give exactly what the
general code gives: merging cells, pairing fine and coarse cells,
restating a union's states, sharing value pieces, pricing only where another route applies, box
arithmetic, pricing without byte tables, one-link clusters, comparing uniform unions, device orders,
pipeline discovery over repeated groups, disjointness of many boxes, keys numbered in C."""

from functools import partial
from itertools import product
from math import prod

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hspmd.annotations import Annotation, DeviceGroup, DistributedStates, Split, Subgroup, box_intersection, device_pieces, parse
from hspmd.annotations.geometry import split_index, subgroup_device_pieces
from hspmd.annotations.states import numbered, order_pattern
from hspmd.comm_resolve import relabel, resolve
from hspmd.comm_resolve.collectives import disjoint
from hspmd.comm_resolve.gathered import gathered_within, representatives, root
from hspmd.comm_resolve.resolver import VIAS
from hspmd.comm_resolve.slices import Grid, box_volume
from hspmd.comm_resolve.split_collectives import _aligned_step, _cell_step, split_step
from hspmd.comm_resolve.topology import cluster_for
from hspmd.cluster import parse_cluster, single_node
from hspmd.errors import AnnotationError, ClusterError, UnsupportedReshard
from hspmd.disjoint_sets import DisjointSets
from hspmd.specialize.pipelines import _stage_classes, discover_pipelines
from hspmd.testing import annotations, distributed_states, shapes

SETTINGS = settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@st.composite
def grids(draw):
    ndim = draw(st.integers(1, 3))
    return grid_of([sorted(draw(st.sets(st.integers(0, 12), min_size=2, max_size=6))) for _ in range(ndim)])


def grid_of(cuts: list[list[int]]) -> Grid:
    """The grid cut exactly at `cuts` (sorted, at least two per dim): boxes between neighbours."""
    spans = max(len(c) for c in cuts) - 1
    grid = Grid([tuple((c[min(k, len(c) - 2)], c[min(k, len(c) - 2) + 1]) for c in cuts) for k in range(spans)],
                len(cuts))
    assert grid.cuts == cuts
    return grid


@st.composite
def cell_sets(draw, grid: Grid):
    every = list(product(*(range(len(c) - 1) for c in grid.cuts)))
    if draw(st.booleans()):  # a full box of cells (the shortcut's case) ...
        lo = [draw(st.integers(0, len(c) - 2)) for c in grid.cuts]
        hi = [draw(st.integers(a + 1, len(c) - 1)) for a, c in zip(lo, grid.cuts)]
        return set(product(*(range(a, b) for a, b in zip(lo, hi))))
    return set(draw(st.lists(st.sampled_from(every), max_size=len(every))))  # ... or any set


@SETTINGS
@given(data=st.data())
def test_merge_equals_growing_boxes_cell_by_cell(data):
    grid = data.draw(grids())
    cells = data.draw(cell_sets(grid))
    assert grid.merge(cells) == grid.grown(set(cells))


@SETTINGS
@given(data=st.data())
def test_a_cells_box_and_volume_are_read_off_its_cuts(data):
    grid = data.draw(grids())
    for cell in product(*(range(len(c) - 1) for c in grid.cuts)):
        box = tuple((c[i], c[i + 1]) for c, i in zip(grid.cuts, cell))
        assert grid.cell_box(cell) == box and grid.cell_volume(cell) == box_volume(box)


@SETTINGS
@given(data=st.data())
def test_coarse_cells_are_the_coarse_cell_holding_each_fine_cell(data):
    fine = data.draw(grids())
    coarse = grid_of([sorted(data.draw(st.sets(st.sampled_from(c), min_size=2))) for c in fine.cuts])

    def containing(cell):
        out = []
        for f, c, i in zip(fine.cuts, coarse.cuts, cell):
            inside = [j for j in range(len(c) - 1) if c[j] <= f[i] and f[i + 1] <= c[j + 1]]
            out.append(inside[0] if inside else None)
        return None if None in out else tuple(out)

    expected = [(cell, containing(cell)) for cell in product(*(range(len(c) - 1) for c in fine.cuts))]
    assert list(fine.coarse_cells(coarse)) == expected


boxes = st.integers(0, 3).flatmap(
    lambda n: st.tuples(*[st.tuples(st.integers(-3, 8), st.integers(-3, 8)) for _ in range(n)]))


@SETTINGS
@given(a=boxes, b=boxes)
def test_box_volume_and_intersection_by_formula(a, b):
    assert box_volume(a) == prod(max(0, stop - start) for start, stop in a)
    if len(a) == len(b):
        out = tuple((max(a0, b0), min(a1, b1)) for (a0, a1), (b0, b1) in zip(a, b))
        assert box_intersection(a, b) == (None if any(stop <= start for start, stop in out) else out)


@SETTINGS
@given(data=st.data())
def test_restated_equals_the_union_built_from_scratch(data):
    ndim = data.draw(st.integers(1, 2))
    ann = data.draw(annotations(ndim))
    new_states = {}

    def states(ds):
        if ds not in new_states:
            new_states[ds] = ds if data.draw(st.booleans()) else data.draw(distributed_states(ds.size, ndim))
        return new_states[ds]

    hdim = data.draw(st.sampled_from(["D", "P", *range(ndim)]))
    ratios = None
    if isinstance(hdim, int):
        ratios = tuple(data.draw(st.lists(st.integers(1, 3), min_size=ann.hsize, max_size=ann.hsize)))
    restated = ann.restated(states, hdim, ratios)
    built = Annotation(tuple(Subgroup(s.dg, states(s.ds)) for s in ann.subgroups), hdim, ratios)
    assert restated == built and hash(restated) == hash(built) and str(restated) == str(built)
    assert (restated.hdim, restated.ratios, restated.devices) == (built.hdim, built.ratios, built.devices)


def test_restated_checks_its_new_top_tier():
    ann = parse("HD{S0:2@[0,1] | S0:2@[2,3]}")
    with pytest.raises(AnnotationError, match="HSize"):
        ann.restated(lambda ds: ds, 0, (1, 2, 3))
    with pytest.raises(AnnotationError, match="need a tensor-dim HDim"):
        ann.restated(lambda ds: ds, "D", (1, 1))


@SETTINGS
@given(data=st.data())
def test_device_pieces_equal_each_subgroups_own(data):
    ndim = data.draw(st.integers(1, 2))
    ann = data.draw(annotations(ndim))
    shape = data.draw(shapes(ndim))
    expected = {}
    for k in range(ann.hsize):
        expected.update(subgroup_device_pieces(ann, k, shape))
    assert device_pieces(ann, shape) == expected


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_no_other_route_applies_to_a_source_holding_partial_sums(data):
    """Why resolve returns the hierarchical plan unpriced when the source holds partial sums."""
    ndim = data.draw(st.integers(1, 2))
    src = data.draw(annotations(ndim, max_devices=8))
    dst = data.draw(annotations(ndim, max_devices=8))
    shape = data.draw(shapes(ndim))
    if not src.has_partial:
        return
    try:
        plan = resolve(src, dst, shape)
    except UnsupportedReshard:
        return
    assert plan == resolve(src, dst, shape, via="hierarchical")
    for via in VIAS[1:]:
        with pytest.raises(UnsupportedReshard):
            resolve(src, dst, shape, via=via)


def test_the_one_node_cluster_is_made_once_per_size():
    first = cluster_for(None, {0, 5}, "")
    assert first == single_node(6) and cluster_for(None, [5, 1], "") is first


@SETTINGS
@given(data=st.data())
def test_representatives_and_roots_equal_subgroups_made_from_scratch(data):
    """HetAuto's gathered layouts pick devices by positions worked out once per states object."""
    ndim = data.draw(st.integers(1, 2))
    _assert_gathered_from_scratch(data.draw(annotations(ndim)), data.draw(st.integers(0, ndim - 1)))


@SETTINGS
@given(data=st.data())
def test_gathered_layouts_of_one_layout_are_shared_by_unions_on_the_same_groups(data):
    """A union whose subgroups share one layout takes its gathered subgroups from a table kept per
    groups and states: unions differing in HDim only share them, and they equal subgroups made
    from scratch."""
    ndim, size, hsize = data.draw(st.integers(1, 2)), data.draw(st.sampled_from([1, 2, 4])), data.draw(st.integers(1, 5))
    states = data.draw(distributed_states(size, ndim))
    pool = data.draw(st.permutations(range(size * hsize)))
    subs = tuple(Subgroup(tuple(pool[k * size:(k + 1) * size]), states) for k in range(hsize))
    dim = data.draw(st.integers(0, ndim - 1))
    ann, other = Annotation(subs, dim, (1,) * hsize), Annotation(subs, "D")
    _assert_gathered_from_scratch(ann, dim)
    for pick in (root, partial(representatives, dim=dim)):
        assert gathered_within(ann, pick).subgroups is gathered_within(other, pick).subgroups


def _assert_gathered_from_scratch(ann: Annotation, dim: int) -> None:
    on_representatives = gathered_within(ann, partial(representatives, dim=dim))
    on_roots = gathered_within(ann, root)
    for gathered in (on_representatives, on_roots):
        assert (gathered.hdim, gathered.ratios, gathered.hsize) == (ann.hdim, ann.ratios, ann.hsize)
    for sub, rep, first in zip(ann.subgroups, on_representatives.subgroups, on_roots.subgroups):
        reps = tuple(d for i, d in enumerate(sub.dg) if split_index(sub, i, dim)[0] == 0)
        rest = tuple(a for a in sub.ds.axes if not (isinstance(a, Split) and a.dim == dim))
        assert rep == Subgroup(reps, rest)
        assert first == Subgroup((sub.dg.devices[0],))


@SETTINGS
@given(keys=st.lists(st.sampled_from([(), (0,), (1,), (0, 1), None]), max_size=12))
def test_numbered_keys_are_equal_exactly_where_the_keys_are(keys):
    codes = numbered(keys)
    assert len(codes) == len(keys)
    assert all((codes[i] == codes[j]) == (keys[i] == keys[j]) for i in range(len(keys)) for j in range(len(keys)))
    assert all(c <= max(codes[:i], default=-1) + 1 for i, c in enumerate(codes))  # first appearance order


@SETTINGS
@given(data=st.data())
def test_a_unions_codes_are_equal_exactly_where_its_states_and_device_orders_are(data):
    ann = data.draw(annotations(data.draw(st.integers(1, 2))))
    subs = ann.subgroups
    for codes, of in ((ann.states_codes, lambda s: s.ds), (ann.order_codes, lambda s: s.dg.order)):
        assert all((codes[i] == codes[j]) == (of(subs[i]) == of(subs[j]))
                   for i in range(len(subs)) for j in range(len(subs)))


@st.composite
def aligned_reshards(draw):
    """(primitive, src, dst, shape): unions of 2-5 subgroups sharing one layout of one axis (any
    device order), HDim a dim or D / P, shapes small enough to leave pieces empty (the aligned
    path must then step aside)."""
    ndim = draw(st.sampled_from([1, 2, 2, 3]))
    hsize, size = draw(st.integers(2, 5)), draw(st.sampled_from([1, 2, 3, 4, 4]))
    pool = draw(st.permutations(range(hsize * size)))
    dim = draw(st.integers(0, ndim - 1))
    if size > 1 and ndim > 1 and draw(st.integers(0, 3)):  # one Split axis (TP) of another dim: the aligned case
        states = DistributedStates((Split(draw(st.sampled_from([d for d in range(ndim) if d != dim])), size),))
    else:
        states = draw(distributed_states(size, ndim, allow_partial=False))
    subs = tuple(Subgroup(tuple(pool[k * size:(k + 1) * size]), states) for k in range(hsize))
    ratios = tuple(draw(st.lists(st.integers(1, 3), min_size=hsize, max_size=hsize)))
    primitive = draw(st.sampled_from(["SplitAllGather", "SplitReduceScatter", "SplitAllReduce"]))
    top = {"SplitAllGather": ((dim, ratios), ("D", None)), "SplitReduceScatter": (("P", None), (dim, ratios)),
           "SplitAllReduce": (("P", None), ("D", None))}[primitive]
    src, dst = (Annotation(subs, hdim, r) for hdim, r in top)
    return primitive, src, dst, tuple(draw(st.integers(0, 24)) for _ in range(ndim))


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=aligned_reshards())
def test_aligned_split_collectives_equal_the_cell_walk(case):
    primitive, src, dst, shape = case
    assert split_step(primitive, src, dst, shape) == _cell_step(primitive, src, dst, shape)


def test_the_aligned_split_collectives_serve_a_tp_stage_of_many_pipelines():
    src = parse("H1(1:1:1){S0:2@[0,1] | S0:2@[2,3] | S0:2@[4,5]}")
    dst = parse("HD{S0:2@[0,1] | S0:2@[2,3] | S0:2@[4,5]}")
    assert _aligned_step("SplitAllGather", src, dst, (4, 6)) is not None


@SETTINGS
@given(data=st.data())
def test_plans_priced_without_byte_tables_take_the_same_time(data):
    """A plan prices its steps' times alone (Traffic(tables=False)); the byte tables give the same times."""
    ndim = data.draw(st.integers(1, 2))
    src, dst = data.draw(annotations(ndim, max_devices=8)), data.draw(annotations(ndim, max_devices=8))
    shape = data.draw(shapes(ndim))
    topology = data.draw(st.sampled_from([None, "2x4", "nvlink-ib:2x4"]))
    try:
        plan = resolve(src, dst, shape, topology)
    except (UnsupportedReshard, ClusterError):
        return
    times = plan.step_seconds()
    assert times == [s.traffic(plan.topology, plan.itemsize).seconds for s in plan.steps]
    assert plan.bytes_sent == resolve(src, dst, shape, topology).bytes_sent  # the tables still come on demand


def test_a_one_node_cluster_answers_links_without_looking_them_up():
    """One node without pair overrides has one link between any two devices (link() answers it at
    once); clusters of several nodes still tell the node's link from the one between nodes."""
    one, two = single_node(8), parse_cluster("2x4")
    assert {one.link(a, b).name for a in range(8) for b in range(8) if a != b} == {one.node_link(0).name}
    assert one.link(3, 3).name == "local" and two.link(5, 5).name == "local"
    assert two.link(0, 3) == two.node_link(0) and two.link(4, 7) == two.node_link(1)
    assert two.link(0, 4) != two.node_link(0)


def test_a_plan_over_devices_outside_the_cluster_names_them():
    with pytest.raises(ClusterError, match=r"device 9 .*reshard"):
        resolve("S0:2@[0,9]", "D:2@[0,9]", (4,), "2x4")


@SETTINGS
@given(data=st.data())
def test_unions_compare_equal_exactly_when_their_subgroups_do(data):
    """Annotation equality (and same_ds_union) compares a uniform union's one layout and its groups
    as int tuples."""
    ndim = data.draw(st.integers(1, 2))
    a = data.draw(annotations(ndim, max_devices=8))
    b = data.draw(st.one_of(st.just(a), annotations(ndim, max_devices=8)))
    copy = Annotation(tuple(Subgroup(s.dg.devices, s.ds) for s in b.subgroups), b.hdim, b.ratios)
    same = (a.hdim, a.ratios, a.subgroups) == (copy.hdim, copy.ratios, copy.subgroups)
    assert (a == copy) is same and (copy == a) is same
    if same:
        assert hash(a) == hash(copy)
    same_states = tuple(s.ds for s in a.subgroups) == tuple(s.ds for s in copy.subgroups)
    assert a.same_ds_union(copy) is same_states and copy.same_ds_union(a) is same_states
    assert a.same_dg_union(copy) is (a.dg_union == copy.dg_union)


def test_a_union_differing_in_one_subgroups_states_is_not_equal():
    uniform = parse("H0{S0:2@[0,1] | S0:2@[2,3] | S0:2@[4,5]}")
    mixed = parse("H0{S0:2@[0,1] | D:2@[2,3] | S0:2@[4,5]}")
    assert uniform != mixed and mixed != uniform and uniform == parse(str(uniform))


@SETTINGS
@given(devices=st.lists(st.integers(0, 50), min_size=1, max_size=8, unique=True))
def test_a_device_groups_order_is_its_order_pattern(devices):
    group = DeviceGroup(tuple(devices))
    assert group.order == order_pattern(devices) and group.order is group.order


@SETTINGS
@given(data=st.data())
def test_pipelines_are_the_same_when_groups_and_edges_repeat(data):
    stages = data.draw(st.integers(1, 4))
    width = data.draw(st.integers(1, 3))
    groups = [tuple(range(s * width, (s + 1) * width)) for s in range(stages)]
    edges = [(s * width + i, (s + 1) * width + i) for s in range(stages - 1) for i in range(width)]
    repeat = data.draw(st.integers(1, 3))
    assert discover_pipelines(groups * repeat, edges * repeat) == discover_pipelines(groups, edges)


@st.composite
def box_lists(draw):
    """Boxes in 0-3 dims, often touching or repeating (the cases a sweep could get wrong)."""
    ndim = draw(st.integers(0, 3))
    coordinate = st.integers(0, 6)
    boxes = []
    for _ in range(draw(st.integers(0, 8))):
        box = []
        for _ in range(ndim):
            a, b = sorted(draw(st.tuples(coordinate, coordinate)))
            box.append((a, b + 1))
        boxes.append(tuple(box))
    if boxes and draw(st.booleans()):
        boxes.append(draw(st.sampled_from(boxes)))
    return boxes


@SETTINGS
@given(box_lists())
def test_the_sweep_finds_an_overlap_exactly_when_some_pair_overlaps(boxes):
    pairwise = all(box_intersection(p, q) is None for i, p in enumerate(boxes) for q in boxes[i + 1:])
    assert disjoint(boxes) == pairwise


def test_a_gather_over_thousands_of_slices_checks_in_one_sweep():
    slices = [((4 * i, 4 * i + 4), (0, 8)) for i in range(4096)]
    assert disjoint(slices[::-1])
    assert not disjoint(slices + [((6, 9), (7, 8))])


@SETTINGS
@given(data=st.data())
def test_stages_of_disjoint_groups_are_the_union_find_classes(data):
    """Disjoint collective groups are taken as the stages at once; union-find gives the same."""
    devices = data.draw(st.permutations(range(12)))
    cuts = sorted(data.draw(st.sets(st.integers(1, 11), max_size=6)))
    groups = [tuple(devices[a:b]) for a, b in zip([0] + cuts, cuts + [12])][:data.draw(st.integers(0, 7))]
    edges = data.draw(st.lists(st.tuples(st.integers(0, 14), st.integers(0, 14)), max_size=8))
    extra = tuple(data.draw(st.lists(st.integers(0, 16), max_size=4)))
    classes, root_of = _stage_classes(groups, edges, extra)
    stages = DisjointSets()
    for members in groups:
        stages.join(members)
    for d in [d for e in edges for d in e] + list(extra):
        stages.add(d)
    expected, expected_root = stages.classes()
    assert sorted(classes.values()) == sorted(expected.values())
    assert set(root_of) == set(expected_root)
    assert all(d in classes[root_of[d]] for d in root_of)


@SETTINGS
@given(devices=st.lists(st.integers(0, 9), max_size=8))
def test_order_patterns_are_ranks_among_the_distinct_devices(devices):
    """Ascending lists take a cached range; any list (repeats too) gets each entry's rank."""
    distinct = sorted(set(devices))
    assert order_pattern(devices) == tuple(distinct.index(d) for d in devices)


@SETTINGS
@given(devices=st.lists(st.integers(0, 30), min_size=2, max_size=12, unique=True), cut=st.integers(1, 11),
       ascending=st.booleans())
def test_a_moving_groups_order_is_the_order_pattern_of_both_groups(devices, cut, ascending):
    """A group moving to lower devices is read off the reversed list; any pair is order_pattern's."""
    cut = min(cut, len(devices) - 1)
    group, then = devices[:cut], devices[cut:]
    if ascending:
        group, then = sorted(group), sorted(then)
    assert relabel._joined_order(tuple(group), tuple(then)) == order_pattern(group + then)


@SETTINGS
@given(joins=st.lists(st.lists(st.integers(0, 20), min_size=1, max_size=4), max_size=10))
def test_disjoint_sets_are_the_connected_components_of_the_joins(joins):
    import networkx as nx
    sets, graph = DisjointSets(), nx.Graph()
    for members in joins:
        sets.join(members)
        graph.add_nodes_from(members)
        graph.add_edges_from(zip(members, members[1:]))
    classes, root_of = sets.classes()
    assert sorted(classes.values()) == sorted(tuple(sorted(c)) for c in nx.connected_components(graph))
    assert all(root in members for root, members in classes.items())
    assert all(d in classes[root_of[d]] for d in graph) and set(root_of) == set(graph)
