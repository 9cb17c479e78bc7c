"""The Hetu v2 paper's appendix strategies (Tables 5, 7, 8, 11, 12) as Strategy values.

Each is transcribed cell by cell into the compact syntax of strategy_text (one pipeline per table
row, `R` = rank IDs, `L` = layer IDs, `NxB` = N micro-batches of size bs B). The 32B model has 60
layers, the 70B model 80; the global batch is 64 everywhere sizes are given.

Transcription notes (what the tables do not state literally):
- GPU kinds: the tables mark H800 cells yellow; the text copy loses colours. Ranks 0-15 are the
  H800 slots of the heterogeneous clusters (they hold the long layer ranges, and the counts match
  every cluster: C6 uses R0-14 = 15 H800, C7 R0-7 = 8 H800); C1-C3 and Tables 11/12 are H20-only.
- Table 5 uses ZeRO-1 (`zero`); Tables 7 and 8 disable it; Tables 11/12 do not say (off here).
- Tables 11/12 dispatch sequences to pipelines with a cost model at run time, so their micro-batch
  counts and sizes are run-time (`?x?`); the first pipeline is the long-sequence one. Rows elided
  with '…' are filled in by the evident stride (Table 11 S1: R20-23, R24-27; S2: R16-19 | R20-23).
  `bind_micro_batches` gives one step's counts and sizes (what dispatch chose) to such a strategy.
- Table 12 Strategy 1 repeats Table 11 Strategy 2 for a different length band; Table 12 Strategy 2
  is only named in the text ("MaxSeqLen (0K, 4K] | DP4TP4PP2"): four TP4xPP2 pipelines, ranks laid
  out pipeline-major (R0-3 | R4-7, R8-11 | R12-15, ...), an assumption the table does not state.
- Table 10 (HotSPa / Hetu-A) names homogeneous strategies per length interval, "DPxTPyPPz, bs1":
  transcribed pipeline-major with micro-batch size 1 and run-time counts (`?x1`); the 16K-context
  rows repeat the 32K context's 4K-16K and 0-4K strategies.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace
from types import MappingProxyType

from hspmd.errors import StrategyError, closest_hint
from hspmd.specialize.strategy import Strategy
from hspmd.specialize.strategy_text import parse_strategy

H800_SLOTS = range(0, 16)


@dataclass(frozen=True)
class PaperStrategy:
    """A strategy with where it comes from and the cluster it was run on."""

    key: str
    table: int
    model: str
    cluster: str
    strategy: Strategy
    h800_slots: range = range(0)

    def gpu_kind(self, rank: int) -> str:
        return "H800" if rank in self.h800_slots else "H20"

    def gpu_counts(self) -> dict[str, int]:
        """GPUs of each kind the strategy uses, e.g. {'H800': 16, 'H20': 32}."""
        counts: dict[str, int] = {}
        for r in self.strategy.all_ranks:
            counts[self.gpu_kind(r)] = counts.get(self.gpu_kind(r), 0) + 1
        return counts

    def cluster_counts(self) -> dict[str, int]:
        """The GPU counts the table heading states ('16 H800, 24 H20' -> {'H800': 16, 'H20': 24})."""
        return {kind: int(n) for n, kind in re.findall(r"(\d+)\s+(H800|H20)", self.cluster)}


_LAYERS = {"32B": 60, "70B": 80}

_DP2TP8PP2 = "?x1: R0-7 L0-29 | R8-15 L30-59 ; ?x1: R16-23 L0-29 | R24-31 L30-59"
_DP4TP4PP2 = ("?x1: R0-3 L0-29 | R4-7 L30-59 ; ?x1: R8-11 L0-29 | R12-15 L30-59 ; "
              "?x1: R16-19 L0-29 | R20-23 L30-59 ; ?x1: R24-27 L0-29 | R28-31 L30-59")

# (key, table, model, cluster, compact text)
_TABLE = (
    ("table5_32b_16h800_16h20", 5, "32B", "16 H800, 16 H20",
     "32x1: R16-19 L0-6 | R20-23 L7-13 | R0-3 L14-36 | R4-7 L37-59 ; "
     "32x1: R24-27 L0-6 | R28-31 L7-13 | R8-11 L14-36 | R12-15 L37-59 ; zero"),
    ("table5_32b_16h800_24h20", 5, "32B", "16 H800, 24 H20",
     "32x1: R16-19 L0-5 | R20-23 L6-11 | R24-27 L12-17 | R0-3 L18-38 | R4-7 L39-59 ; "
     "32x1: R28-31 L0-5 | R32-35 L6-11 | R36-39 L12-17 | R8-11 L18-38 | R12-15 L39-59 ; zero"),
    ("table5_32b_16h800_32h20", 5, "32B", "16 H800, 32 H20",
     "16x1: R16-19 L0-10 | R20-23 L11-21 | R0-3 L22-59 ; "
     "16x1: R24-27 L0-10 | R28-31 L11-21 | R4-7 L22-59 ; "
     "16x1: R32-35 L0-10 | R36-39 L11-21 | R8-11 L22-59 ; "
     "16x1: R40-43 L0-10 | R44-47 L11-21 | R12-15 L22-59 ; zero"),
    ("table5_70b_16h800_16h20", 5, "70B", "16 H800, 16 H20",
     "64x1: R16-23 L0-10 | R24-31 L11-21 | R0-7 L22-50 | R8-15 L51-79 ; zero"),
    ("table5_70b_16h800_24h20", 5, "70B", "16 H800, 24 H20",
     "64x1: R16-23 L0-9 | R24-31 L10-19 | R32-39 L20-29 | R0-7 L30-54 | R8-15 L55-79 ; zero"),
    ("table5_70b_16h800_32h20", 5, "70B", "16 H800, 32 H20",
     "32x1: R16-23 L0-16 | R24-31 L17-33 | R0-7 L34-79 ; "
     "32x1: R32-39 L0-16 | R40-47 L17-33 | R8-15 L34-79 ; zero"),
    ("table7_c1", 7, "32B", "32 H20",
     "16x2: R0-3 L0-14 | R4-7 L15-29 | R8-11 L30-44 | R12-15 L45-59 ; "
     "16x2: R16-19 L0-14 | R20-23 L15-29 | R24-27 L30-44 | R28-31 L45-59"),
    ("table7_c2", 7, "32B", "31 H20",
     "33x1: R0-3 L0-14 | R4-7 L15-29 | R8-11 L30-44 | R12-15 L45-59 ; "
     "31x1: R16-19 L0-15 | R20-23 L16-31 | R24-27 L32-47 | R28-29 L48-55 | R30 L56-59"),
    ("table7_c3", 7, "32B", "24 H20",
     "32x1: R0-3 L0-19 | R4-7 L20-39 | R8-11 L40-59 ; "
     "32x1: R12-15 L0-19 | R16-19 L20-39 | R20-23 L40-59"),
    ("table8_c4", 8, "32B", "16 H800, 32 H20",
     "32x1: R16-19 L0-4 | R20-23 L5-10 | R24-27 L11-16 | R28-31 L17-22 | R0-3 L23-40 | R4-7 L41-59 ; "
     "32x1: R32-35 L0-4 | R36-39 L5-10 | R40-43 L11-16 | R44-47 L17-22 | R8-11 L23-40 | R12-15 L41-59"),
    ("table8_c5", 8, "32B", "16 H800, 24 H20",
     "32x1: R16-19 L0-5 | R20-23 L6-11 | R24-27 L12-17 | R0-3 L18-38 | R4-7 L39-59 ; "
     "32x1: R28-31 L0-5 | R32-35 L6-11 | R36-39 L12-17 | R8-11 L18-38 | R12-15 L39-59"),
    ("table8_c6", 8, "32B", "15 H800, 24 H20",
     "33x1: R16-19 L0-5 | R20-23 L6-11 | R24-27 L12-17 | R0-3 L18-38 | R4-7 L39-59 ; "
     "31x1: R28-31 L0-5 | R32-35 L6-11 | R36-39 L12-17 | R8-11 L18-39 | R12-13 L40-52 | R14 L53-59"),
    ("table8_c7", 8, "32B", "8 H800, 24 H20",
     "32x1: R16-19 L0-8 | R20-23 L9-18 | R24-27 L19-28 | R0-3 L29-59 ; "
     "32x1: R28-31 L0-8 | R32-35 L9-18 | R36-39 L19-28 | R4-7 L29-59"),
    ("table11_s1", 11, "32B", "32 H20",
     "?x?: R0-15 L0-59 ; ?x?: R16-19 L0-59 ; ?x?: R20-23 L0-59 ; ?x?: R24-27 L0-59 ; ?x?: R28-31 L0-59"),
    ("table11_s2", 11, "32B", "32 H20",
     "?x?: R0-7 L0-59 ; ?x?: R8-11 L0-29 | R12-15 L30-59 ; "
     "?x?: R16-19 L0-29 | R20-23 L30-59 ; ?x?: R24-27 L0-29 | R28-31 L30-59"),
    ("table12_s1", 12, "32B", "32 H20",
     "?x?: R0-7 L0-59 ; ?x?: R8-11 L0-29 | R12-15 L30-59 ; "
     "?x?: R16-19 L0-29 | R20-23 L30-59 ; ?x?: R24-27 L0-29 | R28-31 L30-59"),
    ("table12_s2", 12, "32B", "32 H20", _DP4TP4PP2.replace("?x1", "?x?")),
    ("table10_32k_long", 10, "32B", "32 H20", "?x1: R0-15 L0-59 ; ?x1: R16-31 L0-59"),
    ("table10_32k_mid", 10, "32B", "32 H20", _DP2TP8PP2),
    ("table10_32k_short", 10, "32B", "32 H20", _DP4TP4PP2),
    ("table10_16k_mid", 10, "32B", "32 H20", _DP2TP8PP2),
    ("table10_16k_short", 10, "32B", "32 H20", _DP4TP4PP2),
)

K = 1024
# Length intervals (upper bound of the longest sequence in a step, tokens) of each paper pool, in
# the tables' order: Table 11 (32K context, Hetu-B), Table 12 (16K), Table 10 (HotSPa / Hetu-A).
PAPER_POOLS: MappingProxyType[str, tuple[tuple[str, int], ...]] = MappingProxyType({
    "table11": (("table11_s1", 32 * K), ("table11_s2", 16 * K)),
    "table12": (("table12_s1", 16 * K), ("table12_s2", 4 * K)),
    "table10_32k": (("table10_32k_long", 32 * K), ("table10_32k_mid", 16 * K), ("table10_32k_short", 4 * K)),
    "table10_16k": (("table10_16k_mid", 16 * K), ("table10_16k_short", 4 * K)),
})


def _build(key: str, table: int, model: str, cluster: str, text: str) -> PaperStrategy:
    strategy = parse_strategy(f"name={key} ; layers={_LAYERS[model]} ; {text}")
    slots = H800_SLOTS if "H800" in cluster else range(0)
    return PaperStrategy(key, table, model, cluster, strategy, slots)


PAPER_STRATEGIES: MappingProxyType[str, PaperStrategy] = MappingProxyType(
    {row[0]: _build(*row) for row in _TABLE}
)


def bind_micro_batches(strategy: Strategy, counts, sizes=None) -> Strategy:
    """`strategy` with each pipeline's micro-batch count (and size, default: the strategy's own,
    else 1) bound, e.g. to what one step's dispatch chose."""
    counts = tuple(counts)
    sizes = tuple(p.micro_batch_size or 1 for p in strategy.pipelines) if sizes is None else tuple(sizes)
    if len(counts) != strategy.num_pipelines or len(sizes) != strategy.num_pipelines:
        raise StrategyError(f"strategy {strategy.name or '(unnamed)'} has {strategy.num_pipelines} pipelines: give one "
                            f"micro-batch count and size each, got counts {counts}, sizes {sizes}")
    pipelines = tuple(replace(p, micro_batches=c, micro_batch_size=b)
                      for p, c, b in zip(strategy.pipelines, counts, sizes))
    return replace(strategy, pipelines=pipelines)


def paper_strategy(key: str) -> Strategy:
    """The Strategy of one appendix entry, e.g. paper_strategy('table7_c2')."""
    if key not in PAPER_STRATEGIES:
        raise StrategyError(f"no paper strategy {key!r}; {closest_hint(key, list(PAPER_STRATEGIES))}")
    return PAPER_STRATEGIES[key].strategy
