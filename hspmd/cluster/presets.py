"""Named clusters from the seed papers, and the generic shapes the resolver has always accepted.

    hetu-h800-h20         Hetu v2 Table 3: 2 nodes x 8 H800 (990 TFLOP/s bf16, 80 GB, NVLink 400 GB/s)
                          + 4 nodes x 8 H20 (148 TFLOP/s, 96 GB, NVLink 900 GB/s); IB between nodes
    hapt-a100-v100        HAPT Table 2: 4 x 8 A100 (312 TFLOP/s fp16, 40 GB, 300 GB/s intra-host)
                          + 4 x 8 V100 (125, 32 GB, 150 GB/s); 200 Gb/s inside a sub-cluster,
                          5 Gb/s Ethernet across (the paper's default of its 1-10 Gb/s range)
    heterosim-a100-h100   HeteroSim Table 2 level H3 at 128 GPUs: 8 A100 nodes (NVLink 3, RoCE 200 Gb/s)
                          + 8 H100 nodes (NVLink 4, IB 400 Gb/s); RoCE between the two
    hetauto-a100-2x16     HetAuto App. E: 2 clusters x 2 nodes x 8 A100-80GB (NVLink 600 GB/s, IB
                          100 Gb/s), one shared ~10 Gb/s link between the clusters
    NxM / nvlink-ib:NxM / h800-h20:A+B[xM]
                          the shapes the resolver has always accepted, with the same link classes
                          (names, bandwidths, latencies), so plans and costs do not change.

Paper figures: NVLink rates in Hetu v2 Table 3 are both directions together (400 GB/s = 200 GB/s per
direction, as the resolver has always used them); HAPT's intra-host numbers are per direction.
Not in the papers, and taken from vendor data sheets (nominal, rounded): HBM bandwidths, fp32
peaks, H20/H800 IB rate (200 Gb/s per GPU), every latency.
"""

from __future__ import annotations

import re
from pathlib import Path

from hspmd.cluster.files import load_cluster
from hspmd.cluster.spec import ClusterSpec, DeviceType, LinkClass, Node
from hspmd.errors import ClusterError, ClusterTypeError
from hspmd.limits import MAX_DEVICES, ascii_int, brief, check_limit

TB, GB = 1e12, 1e9

H800 = DeviceType("H800", (("bfloat16", 990e12), ("tfloat32", 495e12), ("float32", 67e12)), 3.35 * TB, 80 * GB)
H20 = DeviceType("H20", (("bfloat16", 148e12), ("tfloat32", 74e12), ("float32", 44e12)), 4.0 * TB, 96 * GB)
A100_40 = DeviceType("A100", (("float16", 312e12), ("tfloat32", 156e12), ("float32", 19.5e12)), 1.555 * TB, 40 * GB)
V100 = DeviceType("V100", (("float16", 125e12), ("float32", 15.7e12)), 0.9 * TB, 32 * GB)
A100_80 = DeviceType("A100", (("bfloat16", 312e12), ("tfloat32", 156e12), ("float32", 19.5e12)), 2.039 * TB, 80 * GB)
H100 = DeviceType("H100", (("bfloat16", 989e12), ("tfloat32", 495e12), ("float32", 67e12)), 3.35 * TB, 80 * GB)
GENERIC = DeviceType("gpu", (("bfloat16", 100e12), ("float32", 20e12)), 2.0 * TB, 80 * GB)

# The link classes comm_resolve.topology has always used (same names and figures).
GENERIC_INTRA = LinkClass("intra-node", 100e9, 5e-6)
GENERIC_INTER = LinkClass("inter-node", 12.5e9, 10e-6)
NVLINK = LinkClass("nvlink", 300e9, 3e-6)
INFINIBAND = LinkClass("infiniband", 50e9, 6e-6)
NVLINK_H800 = LinkClass("nvlink-h800", 200e9, 3e-6)
NVLINK_H20 = LinkClass("nvlink-h20", 450e9, 3e-6)
ROCE = LinkClass("roce", 25e9, 8e-6)


def uniform(n_nodes: int, per_node: int, device: DeviceType = GENERIC, intra: LinkClass = GENERIC_INTRA,
            inter: LinkClass = GENERIC_INTER, name: str = "") -> ClusterSpec:
    """`n_nodes` identical nodes of `per_node` devices."""
    links = (intra,) if intra.name == inter.name else (intra, inter)
    return ClusterSpec(tuple(Node(device.name, per_node) for _ in range(n_nodes)), (device,), links,
                       ((device.name, intra.name),), (("*", inter.name),), None, (), name or f"{n_nodes}x{per_node}")


def single_node(n_devices: int) -> ClusterSpec:
    """One node of `n_devices` generic devices (all links equal)."""
    return uniform(1, max(1, n_devices))


def nvlink_ib(n_nodes: int, per_node: int = 8) -> ClusterSpec:
    return uniform(n_nodes, per_node, GENERIC, NVLINK, INFINIBAND, f"nvlink-ib:{n_nodes}x{per_node}")


def h800_h20(n_h800_nodes: int, n_h20_nodes: int, per_node: int = 8, inter: LinkClass = ROCE, name: str = "") -> ClusterSpec:
    """H800 nodes first (devices 0..), then H20 nodes; every node pair joined by `inter`."""
    nodes = (Node("H800", per_node),) * n_h800_nodes + (Node("H20", per_node),) * n_h20_nodes
    return ClusterSpec(nodes, (H800, H20), (NVLINK_H800, NVLINK_H20, inter),
                       (("H800", NVLINK_H800.name), ("H20", NVLINK_H20.name)), (("*", inter.name),), None, (),
                       name or f"h800-h20:{n_h800_nodes}+{n_h20_nodes}" + (f"x{per_node}" if per_node != 8 else ""))


def hetu_h800_h20() -> ClusterSpec:
    return h800_h20(2, 4, 8, LinkClass("ib", 25e9, 6e-6), "hetu-h800-h20")


def hapt_a100_v100(cross_gbps: float = 5.0) -> ClusterSpec:
    nvl_a, nvl_v = LinkClass("nvlink-a100", 300e9, 3e-6), LinkClass("nvlink-v100", 150e9, 4e-6)
    rdma, ethernet = LinkClass("rdma-200g", 25e9, 5e-6), LinkClass("ethernet", cross_gbps * 1e9 / 8, 50e-6)
    nodes = (Node("A100", 8, "a100"),) * 4 + (Node("V100", 8, "v100"),) * 4
    return ClusterSpec(nodes, (A100_40, V100), (nvl_a, nvl_v, rdma, ethernet),
                       (("A100", nvl_a.name), ("V100", nvl_v.name)), (("*", rdma.name),), ethernet.name, (),
                       "hapt-a100-v100")


def heterosim_a100_h100() -> ClusterSpec:
    n3p4, n4p5 = LinkClass("nvlink3", 300e9, 3e-6), LinkClass("nvlink4", 450e9, 2.5e-6)
    roce, ib = LinkClass("roce-200g", 25e9, 8e-6), LinkClass("ib-400g", 50e9, 5e-6)
    nodes = (Node("A100", 8, "a100"),) * 8 + (Node("H100", 8, "h100"),) * 8
    return ClusterSpec(nodes, (A100_80, H100), (n3p4, n4p5, roce, ib),
                       (("A100", n3p4.name), ("H100", n4p5.name)), (("a100", roce.name), ("h100", ib.name)),
                       roce.name, (), "heterosim-a100-h100")


def hetauto_a100_2x16(cross_latency: float = 100e-6) -> ClusterSpec:
    """HetAuto App. E: two clusters of 2 nodes x 8 A100-80GB, NVLink inside a node (600 GB/s both
    directions), 100 Gb/s InfiniBand between the nodes of a cluster, about 10 Gb/s between the
    clusters (iperf3): one shared pipe, since the paper measured the clusters' link, not a NIC.
    The latencies are not in the paper (nominal; the cross link's includes HetAuto's D2H/H2D)."""
    nvlink, ib = LinkClass("nvlink-a100", 300e9, 3e-6), LinkClass("ib-100g", 12.5e9, 6e-6)
    wan = LinkClass("wan-10g", 1.25e9, cross_latency, shared=True)
    nodes = (Node("A100", 8, "cluster1"),) * 2 + (Node("A100", 8, "cluster2"),) * 2
    return ClusterSpec(nodes, (A100_80,), (nvlink, ib, wan), (("A100", nvlink.name),), (("*", ib.name),),
                       wan.name, (), "hetauto-a100-2x16")


PRESETS = {"hetu-h800-h20": hetu_h800_h20, "hapt-a100-v100": hapt_a100_v100, "heterosim-a100-h100": heterosim_a100_h100,
           "hetauto-a100-2x16": hetauto_a100_2x16}


def parse_cluster(text: "str | Path | ClusterSpec") -> ClusterSpec:
    """A preset name, `NxM`, `nvlink-ib:NxM`, `h800-h20:A+B[xM]`, or a .yaml/.yml file."""
    if isinstance(text, ClusterSpec):
        return text
    if not isinstance(text, (str, Path)):
        raise ClusterTypeError(f"a cluster is a ClusterSpec, a preset name, text such as '2x4' or a .yaml file, "
                               f"got {brief(text)}")
    spec = str(text).strip()
    key = spec.lower()
    if key in PRESETS:
        return PRESETS[key]()
    number = lambda digits: check_limit(ascii_int(digits, "a cluster size"), MAX_DEVICES, "a cluster size")  # noqa: E731
    if m := re.fullmatch(r"([0-9]+)x([0-9]+)", key):
        return uniform(number(m[1]), number(m[2]))
    if m := re.fullmatch(r"nvlink-ib:([0-9]+)x([0-9]+)", key):
        return nvlink_ib(number(m[1]), number(m[2]))
    if m := re.fullmatch(r"h800-h20:([0-9]+)\+([0-9]+)(?:x([0-9]+))?", key):
        return h800_h20(number(m[1]), number(m[2]), number(m[3] or "8"))
    if key.endswith((".yaml", ".yml")) or Path(spec).is_file():
        return load_cluster(spec)
    raise ClusterError(f"unknown cluster {brief(text)}: name a preset ({', '.join(PRESETS)}), write NODESxPER_NODE "
                       f"(e.g. 2x4), nvlink-ib:NODESxPER_NODE, h800-h20:H800_NODES+H20_NODES[xPER_NODE], or a .yaml file")


__all__ = [
    "A100_40", "A100_80", "GENERIC", "GENERIC_INTER", "GENERIC_INTRA", "H100", "H20", "H800", "INFINIBAND", "NVLINK",
    "NVLINK_H20", "NVLINK_H800", "PRESETS", "ROCE", "V100", "h800_h20", "hapt_a100_v100", "hetauto_a100_2x16",
    "hetu_h800_h20", "heterosim_a100_h100", "nvlink_ib", "parse_cluster", "single_node", "uniform",
]
