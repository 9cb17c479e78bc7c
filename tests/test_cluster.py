"""ClusterSpec: presets from the papers, link lookup, buckets, YAML files whose errors name the key."""

import math

import pytest
from hypothesis import given, settings, strategies as st

from hspmd.cluster import ClusterSpec, LinkClass, Node, cluster_from_yaml, cluster_to_yaml, load_cluster, parse_cluster
from hspmd.cluster.presets import PRESETS, uniform
from hspmd.errors import ClusterError, ClusterTypeError, HSPMDError, LimitError


def test_hetu_preset_is_003_table3():
    c = parse_cluster("hetu-h800-h20")
    assert c.n_devices == 48 and c.node_sizes == (8,) * 6
    h800, h20 = c.device_type(0), c.device_type(47)
    assert (h800.name, h800.peak_flops("bfloat16"), h800.hbm_capacity) == ("H800", 990e12, 80e9)
    assert (h20.name, h20.peak_flops("bfloat16"), h20.hbm_capacity) == ("H20", 148e12, 96e9)
    assert c.devices_of_type("H800") == tuple(range(16))
    # NVLink 400 / 900 GB/s both directions = 200 / 450 per direction; nodes joined by IB
    assert c.link(0, 7).bandwidth == 200e9 and c.link(16, 23).bandwidth == 450e9
    assert c.link(7, 8).name == "ib" and c.link(8, 16).name == "ib"


def test_hapt_cross_cluster_link_is_the_slow_one():
    c = parse_cluster("hapt-a100-v100")
    assert c.device_type(0).peak_flops("float16") == 312e12 and c.device_type(63).peak_flops("float16") == 125e12
    assert c.link(0, 1).bandwidth == 300e9 and c.link(40, 41).bandwidth == 150e9
    assert c.link(0, 8).name == "rdma-200g" and c.link(40, 48).name == "rdma-200g"
    assert c.link(0, 40).name == "ethernet" and c.link(0, 40).bandwidth == 5e9 / 8


def test_heterosim_sites_have_their_own_fabric():
    c = parse_cluster("heterosim-a100-h100")
    assert c.link(0, 8).name == "roce-200g" and c.link(64, 72).name == "ib-400g" and c.link(0, 64).name == "roce-200g"


@pytest.mark.parametrize("text, intra, inter", [
    ("2x4", ["intra-node"], "inter-node"), ("1x3", ["intra-node"], "inter-node"),
    ("nvlink-ib:4x8", ["nvlink"], "infiniband"), ("h800-h20:2+4", ["nvlink-h800"] * 2 + ["nvlink-h20"] * 4, "roce"),
    ("h800-h20:1+2x4", ["nvlink-h800", "nvlink-h20", "nvlink-h20"], "roce"),
])
def test_generic_shapes_keep_the_resolvers_link_classes(text, intra, inter):
    """The shapes the resolver's --topology has always accepted: a node's own link inside it,
    one inter-node link between nodes (same names and figures as before the ClusterSpec)."""
    cluster = parse_cluster(text)
    figures = {"intra-node": (100e9, 5e-6), "inter-node": (12.5e9, 10e-6), "nvlink": (300e9, 3e-6),
               "infiniband": (50e9, 6e-6), "nvlink-h800": (200e9, 3e-6), "nvlink-h20": (450e9, 3e-6), "roce": (25e9, 8e-6)}
    intra = intra * len(cluster.nodes) if len(intra) == 1 else intra
    for a in range(cluster.n_devices):
        for b in range(cluster.n_devices):
            if a == b:
                continue
            na, nb = cluster.node_of(a), cluster.node_of(b)
            link = cluster.link(a, b)
            assert link.name == (intra[na] if na == nb else inter)
            assert (link.bandwidth, link.latency) == figures[link.name]


def test_pair_override_and_self_link():
    c = uniform(2, 2).with_pairs({(3, 0): LinkClass("slow", 1e9, 1e-3)})
    assert c.link(0, 3).name == "slow" and c.link(3, 0).name == "slow" and c.link(1, 3).name == "inter-node"
    assert c.link(2, 2).bandwidth == math.inf and c.seconds(2, 2, 1e9) == 0.0


def test_buckets_pick_the_smallest_that_holds_the_message():
    link = LinkClass("x", 10e9, 1e-5, ((1024.0, 2e-6, 1e9), (1e6, 5e-6, 5e9)))
    assert link.alpha_beta(100) == (2e-6, 1e9)
    assert link.alpha_beta(1024) == (2e-6, 1e9)
    assert link.alpha_beta(2048) == (5e-6, 5e9)
    assert link.alpha_beta(1e9) == (1e-5, 10e9)
    assert link.seconds(2048) == pytest.approx(5e-6 + 2048 / 5e9)
    assert link.seconds(0) == 0.0


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_presets_round_trip_through_yaml(name, tmp_path):
    c = parse_cluster(name)
    assert cluster_from_yaml(cluster_to_yaml(c)) == c
    path = tmp_path / "c.yaml"
    path.write_text(cluster_to_yaml(c))
    assert parse_cluster(str(path)) == c


GOOD = """
name: two
device_types:
  A: {flops: {bfloat16: 1e14}, hbm_bandwidth: 1e12, hbm_capacity: 1e10}
links:
  fast: {bandwidth: 1e11, latency: 1e-6}
  slow: {bandwidth: 1e9}
nodes:
  - {type: A, devices: 2, count: 2}
intra: {A: fast}
inter: slow
"""


def test_yaml_file_loads():
    c = cluster_from_yaml(GOOD)
    assert c.n_devices == 4 and c.link(0, 1).name == "fast" and c.link(1, 2).name == "slow"
    assert c.link(1, 2).latency == 0.0
    assert c.pipe(1, 2) is None and not c.link(1, 2).shared


def test_a_shared_link_is_one_pipe_per_direction_between_places():
    c = cluster_from_yaml(GOOD.replace("slow: {bandwidth: 1e9}", "slow: {bandwidth: 1e9, shared: true}"))
    assert c.link(1, 2).shared and cluster_from_yaml(cluster_to_yaml(c)) == c
    assert c.pipe(0, 2) == c.pipe(1, 3) == ("slow", "node", 0, 1) != c.pipe(2, 0)
    assert c.pipe(0, 1) is None  # the fast link inside a node is a port per device
    app_e = parse_cluster("hetauto-a100-2x16")
    assert app_e.pipe(0, 31) == app_e.pipe(15, 16) == ("wan-10g", "site", "cluster1", "cluster2")
    assert app_e.pipe(0, 8) is None  # InfiniBand inside a cluster: a NIC per GPU


@pytest.mark.parametrize("edit, key", [
    (("bandwidth: 1e11", "bandwidth: fast"), "links.fast.bandwidth"),
    (("bandwidth: 1e11", "bandwidth: -1"), "links.fast"),
    (("hbm_capacity: 1e10", "hbm_capacity: 0"), "device_types.A"),
    (("{bfloat16: 1e14}", "{bf17: 1e14}"), "device_types.A"),
    (("type: A,", "type: B,"), "nodes[0].type"),
    (("intra: {A: fast}", "intra: {A: nvlink}"), "intra.A"),
    (("inter: slow", "inter: nope"), "inter.*"),
    (("count: 2", "count: 0"), "nodes[0].count"),
    (("devices: 2,", "devices: two,"), "nodes[0]"),
    (("name: two", "name: two\ncolor: red"), "color"),
    (("  slow: {bandwidth: 1e9}", "  slow: {bandwidth: 1e9, latncy: 1}"), "latncy"),
    (("  slow: {bandwidth: 1e9}", "  slow: {bandwidth: 1e9, shared: yes please}"), "links.slow.shared"),
    (("name: two", "name: two\npairs: 5"), "pairs must be a list"),
    (("name: two", "name: two\npairs: [{devices: [0, x], link: fast}]"), "pairs[0].devices"),
    (("name: two", "name: two\npairs: [{devices: [0, -1], link: fast}]"), "pairs[0].devices"),
])
def test_yaml_errors_name_the_key(edit, key):
    text = GOOD.replace(*edit)
    assert text != GOOD
    with pytest.raises(ClusterError) as e:
        cluster_from_yaml(text, "c.yaml")
    assert key in str(e.value) and "c.yaml" in str(e.value)


def test_missing_file_and_unknown_name_are_clear():
    with pytest.raises(ClusterError, match="cannot read cluster file"):
        load_cluster("/nonexistent/c.yaml")
    with pytest.raises(ClusterError, match="hetu-h800-h20"):
        parse_cluster("h900")
    with pytest.raises(HSPMDError, match="device 9 is not in cluster"):
        uniform(2, 2).link(0, 9)


def test_several_sites_need_a_cross_link():
    from hspmd.cluster.presets import GENERIC, GENERIC_INTRA, GENERIC_INTER
    with pytest.raises(ClusterError, match="cross"):
        ClusterSpec((Node("gpu", 2, "a"), Node("gpu", 2, "b")), (GENERIC,), (GENERIC_INTRA, GENERIC_INTER),
                    (("gpu", "intra-node"),), (("a", "inter-node"), ("b", "inter-node")))


@settings(max_examples=60)
@given(st.lists(st.tuples(st.sampled_from(["H800", "H20"]), st.integers(1, 4), st.sampled_from(["", "x", "y"])),
                min_size=1, max_size=5))
def test_links_are_symmetric_and_follow_the_node_layout(nodes):
    from hspmd.cluster.presets import H20, H800, NVLINK_H20, NVLINK_H800, ROCE
    cross = LinkClass("wan", 1e9, 1e-4)
    c = ClusterSpec(tuple(Node(t, n, s) for t, n, s in nodes), (H800, H20), (NVLINK_H800, NVLINK_H20, ROCE, cross),
                    (("H800", "nvlink-h800"), ("H20", "nvlink-h20")), (("*", "roce"),), "wan")
    assert cluster_from_yaml(cluster_to_yaml(c)) == c
    for a in range(c.n_devices):
        for b in range(c.n_devices):
            assert c.link(a, b) == c.link(b, a)
            na, nb = c.node_of(a), c.node_of(b)
            if a == b:
                continue
            expected = (f"nvlink-{c.nodes[na].device_type.lower()}" if na == nb
                        else "roce" if c.nodes[na].site == c.nodes[nb].site else "wan")
            assert c.link(a, b).name == expected


@pytest.mark.parametrize("text", ["100000x1", "1x100000", "300x300", "nvlink-ib:9000x8", "h800-h20:5000+5000",
                                  "2x" + "9" * 40])
def test_cluster_sizes_over_the_limit_fail_before_expansion(text):
    with pytest.raises(LimitError, match="over the limit"):
        parse_cluster(text)


@pytest.mark.parametrize("text", ["2x\u0664", "\u00b2x4", "nvlink-ib:2x\uff14"])
def test_cluster_sizes_are_ascii_digits_only(text):
    with pytest.raises(ClusterError, match="unknown cluster"):
        parse_cluster(text)


@pytest.mark.parametrize("value", [None, 24, 2.5, ["2x4"]])
def test_a_cluster_of_the_wrong_type_is_a_type_error(value):
    with pytest.raises(ClusterTypeError):
        parse_cluster(value)


def test_node_counts_in_files_are_limited():
    with pytest.raises(LimitError, match="nodes\\[0\\]"):
        cluster_from_yaml(GOOD.replace("count: 2", "count: 100000"), "c.yaml")
    good = cluster_from_yaml(GOOD)
    with pytest.raises(LimitError, match="devices of a cluster"):
        ClusterSpec((Node("A", 40000),) * 2, good.device_types, good.links, good.intra, good.inter)
