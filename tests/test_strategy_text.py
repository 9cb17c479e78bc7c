"""The compact strategy syntax: parsing, canonical formatting, errors pointing at the bad part."""

import pytest

from hspmd.errors import StrategyError
from hspmd.specialize.strategy import Pipeline, Stage, Strategy
from hspmd.specialize.strategy_text import StrategySyntaxError, format_strategy, parse_strategy


def test_parse_builds_the_described_strategy():
    s = parse_strategy("name=demo run ; 16x2: R0-3 L0-14 tp4 | R4-7 L15-29 ; 8x1 : R8,9 L0-29 ; zero ; layers=30")
    expected = Strategy(
        (
            Pipeline((Stage((0, 1, 2, 3), (0, 14)), Stage((4, 5, 6, 7), (15, 29))), 16, 2),
            Pipeline((Stage((8, 9), (0, 29)),), 8, 1),
        ),
        30,
        zero=True,
        name="demo run",
    )
    assert s == expected


def test_rank_order_is_kept_and_runtime_batches_parse():
    s = parse_strategy("?x4: R3,1,4-5 L0 | R7 L1-1")
    first, second = s.pipelines[0].stages
    assert first.ranks == (3, 1, 4, 5) and first.tp == 4 and first.layers == range(0, 1)
    assert second.layers == range(1, 2) and s.num_layers == 2
    assert (s.pipelines[0].micro_batches, s.pipelines[0].micro_batch_size) == (None, 4)


@pytest.mark.parametrize(
    "text",
    [
        "33x1: R0-3 L0-14 | R4-7 L15-29 ; 31x1: R16-19 L0-15 | R28,29 L16-25 | R30 L26-29",
        "name=c1 ; 16x2: R0-3 L0-59 ; zero",
        "?x?: R0-15 L0-59 ; ?x3: R16-19 L0-59 ; 5x?: R20,22,21 L0-59",
        "1x1: R7 L0",
        "16x1 h1f1b=5,2,1: R0-3 L0-29 recompute | R4,5 L30-49 | R6 L50-59 recompute ; 4x2 gpipe: R7 L0-59",
        "3x1 1f1b: R0 L0 recompute ; 3x1 eager=1: R1 L0 ; 3x1 virtual=1: R2 L0",
    ],
)
def test_format_parse_round_trip(text):
    s = parse_strategy(text)
    assert parse_strategy(format_strategy(s)) == s
    assert format_strategy(parse_strategy(format_strategy(s))) == format_strategy(s)


@pytest.mark.parametrize(
    "text, words, at",
    [
        ("", "empty clause", 0),
        ("16x2: R0-3 L0-29 ;", "empty clause", 18),
        ("zero", "no pipeline", 0),
        ("p0: R0-3 L0-14 tp4", "unknown clause 'p0:'", 0),
        ("16x2: R0-3 L0-29 ; zer0", "did you mean 'zero'", 19),
        ("16x2: R0-3 L0-29 ; nmae=x", "did you mean 'name'", 19),
        ("R0-3 L0-29", "starts with its micro-batches", 0),
        ("16: R0-3 L0-29", "COUNTxSIZE", 0),
        ("16x2: R0-3 L0-29 | ", "empty stage", 18),
        ("16x2: R0-3", "no L<layers>", 6),
        ("16x2: L0-3", "no R<ranks>", 6),
        ("16x2: R0-3 L0-29 K3", "unexpected 'K3'", 17),
        ("16x2: R0-3, 5 L0-29", "unexpected '5'", 12),
        ("16x2: R0-3 R5 L0-29", "R given twice", 11),
        ("16x2: R3-0 L0-29", "runs backwards; write 0-3", 7),
        ("16x2: Rx L0-29", "not a rank", 7),
        ("16x2: R0-3 L9-2", "runs backwards", 12),
        ("16x2: R0-3 L0-29 tpx", "tp needs a positive integer", 19),
        ("16x2: R0-3 L0-29 tp2", "pipelines[0].stages[0].tp", 19),
        ("16x2: R0-3 L0-9 | R4 L11-29", "must start at 10", 22),
        ("16x2: R0-3 L0-9 | R3 L10-29", "rank 3 is already in stage 0", 19),
        ("16x2: R0-3 L0-29 ; 1x1: R5,3 L0-29", "pipelines[1].stages[0].ranks", 25),
        ("16x2: R0-3 L0-29 ; 1x1: R5 L0-28", "must cover layers 0-29", 28),
        ("layers=20 ; 16x2: R0-3 L0-29", "has 20 layers", 24),
        ("layers=x ; 16x2: R0-3 L0-29", "layers= needs a positive integer", 7),
        ("name= ; 16x2: R0-3 L0-29", "needs a value", 5),
        ("zero=1 ; 16x2: R0-3 L0-29", "takes no value", 0),
        ("zero ; zero ; 16x2: R0-3 L0-29", "given twice", 7),
        ("0x2: R0-3 L0-29", "micro_batches: must be positive", 0),
        ("3x0: R0-3 L0-29", "micro_batch_size: must be positive", 2),
        ("3x1 1fb1: R0-3 L0-29", "pipelines[0].schedule: unknown schedule '1fb1'; did you mean '1f1b'", 4),
        ("3x1 h1f1b: R0-3 L0-29", "pipelines[0].warmup: schedule h1f1b depends on stage and link times", 10),
        ("3x1 h1f1b=: R0-3 L0-29", "needs its warm-up vector", 10),
        ("3x1 1f1b=1,2: R0 L0 | R1 L1-29", "increases after stage 0", 9),
        ("3x1 1f1b=2,x: R0 L0 | R1 L1-29", "'x' in '2,x' is not a count", 9),
        ("3x1 1f1b=2: R0 L0 | R1 L1-29", "1 count(s) for 2 stage(s)", 9),
        ("3x1 gpipe=2: R0-3 L0-29", "needs a 1F1B-type schedule", 10),
        ("3x1 1f1b =2: R0-3 L0-29", "schedule is one word", 9),
        ("3x1: R0-3 L0-29 recompute recompute", "recompute given twice", 26),
        ("3x1: R0-3 L0-29 rc", "unexpected 'rc'", 16),
    ],
)
def test_errors_point_at_the_offending_part(text, words, at):
    with pytest.raises(StrategySyntaxError) as info:
        parse_strategy(text)
    assert words in str(info.value)
    assert info.value.position == at
    assert isinstance(info.value, StrategyError)


def test_non_string_is_rejected():
    with pytest.raises(StrategyError, match="must be a string"):
        parse_strategy(None)
