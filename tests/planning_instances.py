"""Small planning problems with profile tables, shared by the search and replan tests."""

import random

from hspmd.planning.ranks import DevicePool
from hspmd.planning.search import Problem, TableEvaluator

GB = 2**30


def random_problem(seed, types=(("A", 4, 4), ("B", 2, 2)), layers=8, batch=16, recompute=True):
    """Device types (name, devices, per node) with random per-(type, TP) layer times, memory
    capacities, link and sync costs: instances where memory, links and TP efficiency all matter."""
    rng = random.Random(seed)
    table, caps, pools, first = {}, {}, [], 0
    for name, n, node in types:
        base = rng.uniform(0.5, 3.0)
        for tp in (1, 2, 4, 8):
            if tp <= min(n, node):
                table[(name, tp)] = base / tp * (1 + rng.uniform(0, 0.3) * (tp.bit_length() - 1))
        caps[name] = rng.uniform(6, 30) * GB
        pools.append(DevicePool.contiguous(name, first, n, node))
        first += n
    names = [t[0] for t in types]
    evaluator = TableEvaluator(
        table, caps, layer_state_bytes=rng.uniform(1, 4) * GB, layer_activation_bytes=rng.uniform(0.2, 1.5) * GB,
        first_extra=(rng.uniform(0, 1), rng.uniform(0, 4) * GB), last_extra=(rng.uniform(0, 2), rng.uniform(0, 4) * GB),
        links={(a, b): rng.uniform(0, 1.0) for a in names for b in names}, default_link=0.1,
        sync_bytes=layers * 2 * GB, sync_bandwidth=rng.uniform(1, 20) * GB,
    )
    return Problem(tuple(pools), layers, batch, evaluator, recompute=recompute)


def hapt_problem():
    """HAPT §5.2: L = 10, A = 1x4, B = 1x2, per-layer time proportional to 1/peak (312 vs 125
    TFLOPS), cross-mesh transfer 0.6 of the largest stage time of a balanced split, B = 16."""
    table = {}
    for name, peak, n in (("A", 312.0, 4), ("B", 125.0, 2)):
        for tp in (1, 2, 4):
            if tp <= n:
                table[(name, tp)] = 100.0 / peak / tp * (1 + 0.1 * (tp.bit_length() - 1))
    balanced = 10 * 100.0 / (312 * 4 + 125 * 2)
    evaluator = TableEvaluator(
        table, {"A": 40 * GB, "B": 32 * GB}, layer_state_bytes=12 * GB, layer_activation_bytes=2 * GB,
        links={("A", "B"): 0.6 * balanced, ("B", "A"): 0.6 * balanced}, default_link=0.01,
    )
    pools = (DevicePool.contiguous("A", 0, 4, 4), DevicePool.contiguous("B", 4, 2, 2))
    return Problem(pools, 10, 16, evaluator, recompute=False)


def capacity_of(problem, rank):
    for pool in problem.pools:
        if rank in pool.ranks:
            return problem.evaluator.capacity(pool.device_type)
    raise KeyError(rank)


def tight_memory_problem(recompute=True):
    """Two types of 2 devices, 8 layers, 8 micro-batches, 6 GB per device: the fast type's stage
    only fits when it recomputes its activations (1 GB of states and 2 GB of activations per
    layer and micro-batch; recomputation keeps an eighth of them)."""
    evaluator = TableEvaluator({("A", 1): 1.0, ("A", 2): 0.55, ("B", 1): 2.0, ("B", 2): 1.1}, {"A": 6 * GB, "B": 6 * GB},
                               layer_state_bytes=GB, layer_activation_bytes=2 * GB, default_link=0.05)
    pools = (DevicePool.contiguous("A", 0, 2, 2), DevicePool.contiguous("B", 2, 2, 2))
    return Problem(pools, 8, 8, evaluator, recompute=recompute)
