"""The hardware as data: device types, nodes, link classes with alpha-beta costs, presets, YAML files."""

from hspmd.cluster.spec import LOCAL, Bucket, ClusterSpec, DeviceType, LinkClass, Node
from hspmd.cluster.files import cluster_from_dict, cluster_from_yaml, cluster_to_dict, cluster_to_yaml, load_cluster
from hspmd.cluster.presets import PRESETS, h800_h20, nvlink_ib, parse_cluster, single_node, uniform

__all__ = [
    "Bucket", "ClusterSpec", "DeviceType", "LOCAL", "LinkClass", "Node", "PRESETS", "cluster_from_dict",
    "cluster_from_yaml", "cluster_to_dict", "cluster_to_yaml", "h800_h20", "load_cluster", "nvlink_ib", "parse_cluster",
    "single_node", "uniform",
]
