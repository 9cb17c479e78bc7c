"""Strategy dicts and files: round trips through JSON and YAML, and errors naming the key path."""

import json

import pytest

from hspmd.errors import StrategyError
from hspmd.specialize.paper_strategies import PAPER_STRATEGIES
from hspmd.specialize.strategy import Strategy
from hspmd.specialize.strategy_fields import StrategyFieldError
from hspmd.specialize.strategy_files import load_strategies, load_strategy, save_strategy
from hspmd.specialize.strategy_text import parse_strategy

C2 = PAPER_STRATEGIES["table7_c2"].strategy
RUNTIME = PAPER_STRATEGIES["table11_s2"].strategy


def minimal():
    return {"pipelines": [{"micro_batches": 2, "micro_batch_size": 1, "stages": [{"ranks": "0-1", "layers": "0-3"}]}]}


@pytest.mark.parametrize("suffix", [".json", ".yaml", ".yml"])
@pytest.mark.parametrize("strategy", [C2, RUNTIME, PAPER_STRATEGIES["table5_32b_16h800_32h20"].strategy])
def test_file_round_trip(tmp_path, suffix, strategy):
    path = tmp_path / f"s{suffix}"
    save_strategy(strategy, path)
    assert load_strategy(path) == strategy
    assert load_strategies(path) == (strategy,)


@pytest.mark.parametrize("suffix", [".json", ".yaml"])
def test_multi_strategy_file(tmp_path, suffix):
    path = tmp_path / f"many{suffix}"
    save_strategy([C2, RUNTIME], path)
    assert load_strategies(path) == (C2, RUNTIME)
    with pytest.raises(StrategyError, match="load_strategies"):
        load_strategy(path)


def test_dict_accepts_every_spelling_of_ranks_and_layers():
    data = {
        "num_layers": 6,
        "zero": True,
        "name": "x",
        "pipelines": [
            {
                "micro_batches": None,
                "micro_batch_size": 2,
                "stages": [
                    {"ranks": [3, 1], "layers": [0, 1], "tp": 2},
                    {"ranks": 5, "layers": 2},
                    {"ranks": "6-8,10", "layers": "3-5"},
                ],
            }
        ],
    }
    s = Strategy.from_dict(data)
    assert s == parse_strategy("name=x ; ?x2: R3,1 L0-1 | R5 L2 | R6-8,10 L3-5 ; zero")
    assert Strategy.from_dict(json.loads(json.dumps(s.to_dict()))) == s
    assert Strategy.from_dict(minimal()).num_layers == 4 and Strategy.from_dict(minimal()).name == ""


def test_schedule_warmup_and_recompute_in_yaml(tmp_path):
    path = tmp_path / "planned.yaml"
    path.write_text(
        "num_layers: 4\npipelines:\n"
        "  - {micro_batches: 8, micro_batch_size: 1, schedule: h1f1b, warmup: [4, 1],\n"
        "     stages: [{ranks: 0-1, layers: 0-1, recompute: true}, {ranks: 2, layers: 2-3}]}\n"
        "  - {micro_batches: 8, micro_batch_size: 1, schedule: gpipe, stages: [{ranks: 3, layers: 0-3}]}\n"
        "  - {micro_batches: 8, micro_batch_size: 1, schedule: eager, warmup: '2', stages: [{ranks: 4, layers: 0-3}]}\n"
    )
    s = load_strategy(path)
    assert s == parse_strategy("8x1 h1f1b=4,1: R0,1 L0-1 recompute | R2 L2-3 ; 8x1 gpipe: R3 L0-3 ; 8x1 eager=2: R4 L0-3")
    assert [p.schedule_spec for p in s.pipelines] == ["h1f1b:4,1", "gpipe", "eager:2"]
    save_strategy(s, path)
    assert load_strategy(path) == s
    assert "recompute" not in Strategy.from_dict(minimal()).to_dict()["pipelines"][0]["stages"][0]


def test_hand_written_yaml(tmp_path):
    path = tmp_path / "c3.yaml"
    path.write_text(
        "name: table7_c3\nnum_layers: 60\nzero: false\npipelines:\n"
        "  - micro_batches: 32\n    micro_batch_size: 1\n    stages:\n"
        "      - {ranks: 0-3, layers: 0-19}\n      - {ranks: 4-7, layers: 20-39, tp: 4}\n"
        "      - {ranks: \"8,9,10,11\", layers: [40, 59]}\n"
        "  - micro_batches: 32\n    micro_batch_size: 1\n    stages:\n"
        "      - {ranks: 12-15, layers: 0-19}\n      - {ranks: 16-19, layers: 20-39}\n"
        "      - {ranks: 20-23, layers: 40-59}\n"
    )
    assert load_strategy(path) == PAPER_STRATEGIES["table7_c3"].strategy


def _with(change):
    data = minimal()
    change(data)
    return data


@pytest.mark.parametrize(
    "data, path, words",
    [
        (_with(lambda d: d.update(pipeline=[])), ("pipeline",), "did you mean 'pipelines'"),
        (_with(lambda d: d.pop("pipelines")), ("pipelines",), "missing required key"),
        (_with(lambda d: d.update(num_layer=4)), ("num_layer",), "did you mean 'num_layers'"),
        (_with(lambda d: d["pipelines"][0].update(micro_batch=3)), ("pipelines", 0, "micro_batch"), "'micro_batches'"),
        (_with(lambda d: d["pipelines"][0].pop("micro_batch_size")), ("pipelines", 0, "micro_batch_size"), "missing"),
        (_with(lambda d: d["pipelines"][0]["stages"][0].update(rank="0")), ("pipelines", 0, "stages", 0, "rank"), "'ranks'"),
        (_with(lambda d: d["pipelines"][0]["stages"][0].update(tpp=2)), ("pipelines", 0, "stages", 0, "tpp"), "'tp'"),
        (_with(lambda d: d["pipelines"][0]["stages"][0].update(foo=2)), ("pipelines", 0, "stages", 0, "foo"), "valid:"),
        (_with(lambda d: d["pipelines"][0]["stages"][0].update(tp=4)), ("pipelines", 0, "stages", 0, "tp"), "tp 4"),
        (_with(lambda d: d["pipelines"][0]["stages"][0].update(ranks="0-x")), ("pipelines", 0, "stages", 0, "ranks"), "not a rank"),
        (_with(lambda d: d["pipelines"][0]["stages"][0].update(layers="a")), ("pipelines", 0, "stages", 0, "layers"), "not a layer range"),
        (_with(lambda d: d["pipelines"][0]["stages"][0].update(layers=[0, 1, 2])), ("pipelines", 0, "stages", 0, "layers"), "pair"),
        (_with(lambda d: d["pipelines"][0].update(micro_batches="16")), ("pipelines", 0, "micro_batches"), "integer"),
        (_with(lambda d: d["pipelines"][0].update(stages={})), ("pipelines", 0, "stages"), "non-empty list"),
        (_with(lambda d: d["pipelines"].append(7)), ("pipelines", 1), "must be a mapping"),
        (_with(lambda d: d.update(pipelines=[])), ("pipelines",), "non-empty list"),
        (_with(lambda d: d.update(num_layers="4")), ("num_layers",), "integer"),
        (_with(lambda d: d.update(zero="no")), ("zero",), "true or false"),
        ([1, 2], (), "must be a mapping"),
        (_with(lambda d: d["pipelines"][0]["stages"][0].update(recompute="yes")), ("pipelines", 0, "stages", 0, "recompute"),
            "true or false"),
        (_with(lambda d: d["pipelines"][0]["stages"][0].update(recomute=True)), ("pipelines", 0, "stages", 0, "recomute"), "'recompute'"),
        (_with(lambda d: d["pipelines"][0].update(schedule="1fb1")), ("pipelines", 0, "schedule"), "did you mean '1f1b'"),
        (_with(lambda d: d["pipelines"][0].update(schedule=3)), ("pipelines", 0, "schedule"), "one of gpipe"),
        (_with(lambda d: d["pipelines"][0].update(schedule="h1f1b")), ("pipelines", 0, "warmup"), "give its warm-up vector"),
        (_with(lambda d: d["pipelines"][0].update(schedule="gpipe", warmup=[1])), ("pipelines", 0, "warmup"), "1F1B-type"),
        (_with(lambda d: d["pipelines"][0].update(warmup=[1])), ("pipelines", 0, "warmup"), "got schedule null"),
        (_with(lambda d: d["pipelines"][0].update(schedule="1f1b", warmup=[2, 1])), ("pipelines", 0, "warmup"), "one per stage"),
        (_with(lambda d: d["pipelines"][0].update(schedule="1f1b", warmup=[0])), ("pipelines", 0, "warmup"), "1-1000000"),
        (_with(lambda d: d["pipelines"][0].update(schedule="1f1b", warmup=[True])), ("pipelines", 0, "warmup"), "positive integers"),
        (_with(lambda d: d["pipelines"][0].update(schedule="1f1b", warmup="2;1")), ("pipelines", 0, "warmup"), "not a count"),
        (_with(lambda d: d["pipelines"][0].update(schedule="1f1b", warmup=5)), ("pipelines", 0, "warmup"), "a list"),
    ],
)
def test_dict_errors_name_the_key(data, path, words):
    with pytest.raises(StrategyFieldError) as info:
        Strategy.from_dict(data)
    assert info.value.path == path
    assert words in str(info.value)


def test_file_errors(tmp_path):
    bad_key = tmp_path / "typo.yaml"
    bad_key.write_text("pipelines:\n  - micro_batches: 1\n    micro_batch_size: 1\n    stage: []\n")
    with pytest.raises(StrategyError, match=r"typo.yaml: pipelines\[0\].stage: unknown key 'stage'; did you mean 'stages'"):
        load_strategy(bad_key)
    in_list = tmp_path / "list.json"
    in_list.write_text(json.dumps([minimal(), {"pipelines": [], "x": 1}]))
    with pytest.raises(StrategyError, match=r"\[1\]\.x: unknown key"):
        load_strategies(in_list)
    broken = tmp_path / "broken.json"
    broken.write_text("{\"pipelines\": [")
    with pytest.raises(StrategyError, match="not valid JSON.*line 1"):
        load_strategy(broken)
    broken_yaml = tmp_path / "broken.yaml"
    broken_yaml.write_text("pipelines: [\n")
    with pytest.raises(StrategyError, match="not valid YAML"):
        load_strategy(broken_yaml)
    with pytest.raises(StrategyError, match="suffix '.txt'"):
        load_strategy(tmp_path / "s.txt")
    with pytest.raises(StrategyError, match="cannot read"):
        load_strategy(tmp_path / "missing.yaml")
    empty = tmp_path / "empty.json"
    empty.write_text("[]")
    with pytest.raises(StrategyError, match="empty list"):
        load_strategies(empty)
