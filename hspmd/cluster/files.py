"""ClusterSpec as data: dicts and YAML files whose errors name the key that is wrong.

    name: my-cluster
    device_types:
      A100: {flops: {bfloat16: 312e12, float32: 19.5e12}, hbm_bandwidth: 2.0e12, hbm_capacity: 80e9}
    links:
      nvlink: {bandwidth: 300e9, latency: 3e-6}
      ib: {bandwidth: 50e9, latency: 6e-6, buckets: [{up_to: 65536, bandwidth: 10e9, latency: 8e-6}]}
      wan: {bandwidth: 1.25e9, latency: 1e-4, shared: true}   # one pipe between two sites
    nodes:
      - {type: A100, devices: 8, count: 2, site: east}    # count: that many identical nodes
    intra: {A100: nvlink}
    inter: ib                   # or {east: ib, west: roce}; "*" = every site
    cross: ib                   # link between sites (needed when there are several)
    pairs: [{devices: [0, 9], link: ib}]
    emulate: {reference: A100, memory_scale: 1.0e-6}   # optional: emulate it on this host
                                                       # (hspmd.cluster.emulation)
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping

import yaml

from hspmd.cluster.emulation import Emulation, as_number
from hspmd.cluster.spec import Bucket, ClusterSpec, DeviceType, LinkClass, Node
from hspmd.errors import ClusterError
from hspmd.limits import MAX_DEVICES, brief, check_limit

TOP_KEYS = ("name", "device_types", "links", "nodes", "intra", "inter", "cross", "pairs", "emulate")


def _mapping(value: object, key: str) -> Mapping:
    if not isinstance(value, Mapping):
        raise ClusterError(f"cluster file: {key} must be a mapping, got {type(value).__name__} {value!r}")
    return value


def _only(data: Mapping, allowed: tuple[str, ...], key: str) -> None:
    unknown = sorted(set(map(str, data)) - set(allowed))
    if unknown:
        raise ClusterError(f"cluster file: {key}: unknown key(s) {', '.join(unknown)}; allowed: {', '.join(allowed)}")


def _required(data: Mapping, name: str, key: str):
    if name not in data:
        raise ClusterError(f"cluster file: {key}.{name} is missing")
    return data[name]


def _number(value: Any, key: str) -> float:
    return as_number(value, f"cluster file: {key}")


def _wrap(key: str, make):
    """Run a constructor, prefixing its error with the file key it came from."""
    try:
        return make()
    except ClusterError as e:
        if str(e).startswith("cluster file:"):
            raise
        raise ClusterError(f"cluster file: {key}: {e}") from None


def _link(name: str, data: object) -> LinkClass:
    key = f"links.{name}"
    data = _mapping(data, key)
    _only(data, ("bandwidth", "latency", "buckets", "shared"), key)
    shared = data.get("shared", False)
    if not isinstance(shared, bool):
        raise ClusterError(f"cluster file: {key}.shared must be true or false, got {brief(shared)}")
    buckets = []
    raw = data.get("buckets", ()) or ()
    if not isinstance(raw, (list, tuple)):
        raise ClusterError(f"cluster file: {key}.buckets must be a list")
    for i, b in enumerate(raw):
        bk = f"{key}.buckets[{i}]"
        b = _mapping(b, bk)
        _only(b, ("up_to", "latency", "bandwidth"), bk)
        buckets.append(Bucket(_number(_required(b, "up_to", bk), f"{bk}.up_to"),
                              _number(_required(b, "latency", bk), f"{bk}.latency"),
                              _number(_required(b, "bandwidth", bk), f"{bk}.bandwidth")))
    return _wrap(key, lambda: LinkClass(str(name), _number(_required(data, "bandwidth", key), f"{key}.bandwidth"),
                                        _number(data.get("latency", 0.0), f"{key}.latency"), tuple(buckets), shared))


def _device_type(name: str, data: object) -> DeviceType:
    key = f"device_types.{name}"
    data = _mapping(data, key)
    _only(data, ("flops", "hbm_bandwidth", "hbm_capacity", "copy_engines"), key)
    flops = _mapping(_required(data, "flops", key), f"{key}.flops")
    flops = {str(k): _number(v, f"{key}.flops.{k}") for k, v in flops.items()}
    return _wrap(key, lambda: DeviceType(str(name), tuple(flops.items()),
                                         _number(_required(data, "hbm_bandwidth", key), f"{key}.hbm_bandwidth"),
                                         _number(_required(data, "hbm_capacity", key), f"{key}.hbm_capacity"),
                                         data.get("copy_engines", 2)))


def _nodes(raw: object) -> list[Node]:
    if not isinstance(raw, (list, tuple)) or not raw:
        raise ClusterError("cluster file: nodes must be a non-empty list of {type, devices[, count, site, intra]}")
    nodes: list[Node] = []
    for i, n in enumerate(raw):
        key = f"nodes[{i}]"
        n = _mapping(n, key)
        _only(n, ("type", "devices", "count", "site", "intra"), key)
        count = n.get("count", 1)
        if isinstance(count, bool) or not isinstance(count, int) or count < 1:
            raise ClusterError(f"cluster file: {key}.count must be a positive integer, got {brief(count)}")
        check_limit(len(nodes) + count, MAX_DEVICES, "the number of nodes of a cluster", key)
        node = _wrap(key, lambda: Node(str(_required(n, "type", key)), _required(n, "devices", key),
                                       str(n.get("site", "") or ""), n.get("intra")))
        nodes += [node] * count
    return nodes


def cluster_from_dict(data: object) -> ClusterSpec:
    """Build a ClusterSpec from the mapping described in the module docstring."""
    data = _mapping(data, "the top level")
    _only(data, TOP_KEYS, "the top level")
    types = [_device_type(k, v) for k, v in _mapping(_required(data, "device_types", "cluster"), "device_types").items()]
    links = [_link(k, v) for k, v in _mapping(_required(data, "links", "cluster"), "links").items()]
    intra = {str(k): str(v) for k, v in _mapping(data.get("intra", {}) or {}, "intra").items()}
    raw_inter = data.get("inter", {}) or {}
    inter = {"*": str(raw_inter)} if isinstance(raw_inter, str) else {str(k): str(v) for k, v in _mapping(raw_inter, "inter").items()}
    pairs = []
    raw_pairs = data.get("pairs", ()) or ()
    if not isinstance(raw_pairs, (list, tuple)):
        raise ClusterError(f"cluster file: pairs must be a list of {{devices: [a, b], link: name}}, got {raw_pairs!r}")
    for i, p in enumerate(raw_pairs):
        key = f"pairs[{i}]"
        p = _mapping(p, key)
        devices = _required(p, "devices", key)
        if (not isinstance(devices, (list, tuple)) or len(devices) != 2
                or any(isinstance(d, bool) or not isinstance(d, int) or d < 0 for d in devices)):
            raise ClusterError(f"cluster file: {key}.devices must be two device ids, got {devices!r}")
        pairs.append(((devices[0], devices[1]), str(_required(p, "link", key))))
    cross = data.get("cross")
    emulation = None if data.get("emulate") is None else _wrap("emulate", lambda: Emulation.from_dict(data["emulate"]))
    return _wrap("the top level", lambda: ClusterSpec(
        tuple(_nodes(_required(data, "nodes", "cluster"))), tuple(types), tuple(links), tuple(intra.items()),
        tuple(inter.items()), None if cross is None else str(cross), tuple(pairs), str(data.get("name", "") or ""),
        emulation))


def cluster_to_dict(cluster: ClusterSpec) -> dict:
    """The inverse of cluster_from_dict (consecutive identical nodes folded into one entry)."""
    nodes: list[dict] = []
    for n in cluster.nodes:
        entry = {"type": n.device_type, "devices": n.devices, "site": n.site}
        if n.intra is not None:
            entry["intra"] = n.intra
        if nodes and {k: v for k, v in nodes[-1].items() if k != "count"} == entry:
            nodes[-1]["count"] += 1
        else:
            nodes.append({**entry, "count": 1})
    out = {
        "name": cluster.name,
        "device_types": {t.name: t.to_dict() for t in cluster.device_types},
        "links": {l.name: l.to_dict() for l in cluster.links},
        "nodes": nodes,
        "intra": dict(cluster.intra),
        "inter": dict(cluster.inter),
    }
    if cluster.cross is not None:
        out["cross"] = cluster.cross
    if cluster.pairs:
        out["pairs"] = [{"devices": list(p), "link": l} for p, l in cluster.pairs]
    if cluster.emulation is not None:
        out["emulate"] = cluster.emulation.to_dict()
    return out


def load_cluster(path: str | Path) -> ClusterSpec:
    """Read a YAML cluster file; errors name the file and the key."""
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as e:
        raise ClusterError(f"cannot read cluster file {path}: {e.strerror}") from None
    return cluster_from_yaml(text, str(path))


def cluster_from_yaml(text: str, source: str = "<text>") -> ClusterSpec:
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as e:
        raise ClusterError(f"{source}: not valid YAML: {e}") from None
    try:
        return cluster_from_dict(data)
    except ClusterError as e:
        raise ClusterError(f"{source}: {e}") from None


def cluster_to_yaml(cluster: ClusterSpec) -> str:
    return yaml.safe_dump(cluster_to_dict(cluster), sort_keys=False)


__all__ = ["cluster_from_dict", "cluster_from_yaml", "cluster_to_dict", "cluster_to_yaml", "load_cluster"]
