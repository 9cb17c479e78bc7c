"""The compact one-line strategy syntax, mirroring the paper's appendix tables.

    33x1: R0-3 L0-14 | R4-7 L15-29 | R8-11 L30-44 | R12-15 L45-59 ; 31x1: R16-19 L0-15 | R30 L16-59 ; zero
    16x1 h1f1b=5,2,1: R0-3 L0-29 recompute | R4,5 L30-49 | R6 L50-59

Grammar (whitespace is free between words, none inside a word):

    strategy := clause (';' clause)*
    clause   := pipeline | 'zero' | 'name=' TEXT | 'layers=' INT | 'recompute=' choice | 'cp_attention=' MODE
    pipeline := batches [schedule] ':' stage ('|' stage)*
    batches  := COUNT 'x' SIZE          micro-batch count x micro-batch size; '?' = bound at run time
    schedule := POLICY ['=' INT (',' INT)*]   gpipe, 1f1b, eager, h1f1b, virtual; '=' its warm-up vector
    stage    := 'R' ranks 'L' layers ['tp' INT] ['cp' INT ['=' INT (',' INT)*]] ['recompute' ['=' choice]]
    choice   := GRANULARITY | 'L' items | GRANULARITY ':L' items      GRANULARITY: full, selective
    ranks    := item (',' item)*        item := INT | INT '-' INT     (0-3,8 = 0,1,2,3,8; TP order)
    layers   := INT | INT '-' INT       inclusive, as in the paper (L0-14 = layers 0..14)

A stage is `cp` tensor-parallel groups (context parallelism, CP-major ranks), so `tp` may be left
out (it must equal the rank count / cp); `cp2=3,1` gives the CP positions uneven sequence shares;
`cp_attention=ring|all_gather|all_to_all` picks how attention crosses the CP groups (default ring);
`recompute` re-runs the stage's forward in its backward (Stage.recompute), `recompute=L2-5` some of
its layers only, `recompute=selective` only the cheap ops (Stage.recompute_granularity). The
clause `recompute=selective:L2-9` chooses layers of the whole model (with_recompute): each stage
recomputes those it holds, so a range may straddle stages. A pipeline without a schedule runs the
trainer's.
`layers=` is an optional check of the model depth (inferred from the pipelines otherwise); TEXT of
`name=` runs to the next ';'. Errors are StrategySyntaxError with the offending part marked.
"""

from __future__ import annotations

import re

from hspmd.errors import StrategyError, StrategyTypeError, closest_hint
from hspmd.limits import MAX_DIGITS, brief, is_ascii_number
from hspmd.specialize.strategy import GRANULARITIES, Pipeline, Stage, Strategy, with_recompute
from hspmd.specialize.strategy_fields import (
    Path, StrategyFieldError, field_context, parse_count_list, parse_index_list, parse_layer_list, parse_layer_range,
)

OPTIONS = ("zero", "name", "layers", "cp_attention", "recompute")
_BATCHES = re.compile(r"\s*([0-9]+|\?)\s*x\s*([0-9]+|\?)([^:|]*):")
_WORD = re.compile(r"\S+")
_STAGE_FIELDS = {"R": "ranks", "L": "layers", "tp": "tp", "cp": "cp"}
RECOMPUTE = "recompute"


class StrategySyntaxError(StrategyError):
    """The compact strategy text is invalid; `position` points at the offending part."""

    def __init__(self, message: str, text: str, position: int):
        self.text, self.position = text, position
        super().__init__(f"{message}\n  {text}\n  {' ' * position}^ (at character {position})")


class _Parser:
    def __init__(self, text: str):
        self.text = text
        self.positions: dict[Path, int] = {}

    def fail(self, message: str, position: int) -> StrategySyntaxError:
        return StrategySyntaxError(message, self.text, position)

    def clauses(self):
        start = 0
        for part in self.text.split(";"):
            yield start, part
            start += len(part) + 1

    def parse(self) -> Strategy:
        pipelines: list[Pipeline] = []
        options: dict[str, tuple[int, object]] = {}
        for start, clause in self.clauses():
            stripped = clause.lstrip()
            at = start + len(clause) - len(stripped)
            if not stripped.strip():
                raise self.fail("empty clause: expected a pipeline ('16x2: R0-3 L0-29 | ...') or an option", at)
            if "0" <= stripped[0] <= "9" or stripped[0] == "?":
                pipelines.append(self.pipeline(clause, start, len(pipelines)))
            else:
                key, value = self.option(stripped, at)
                if key in options:
                    raise self.fail(f"option {key!r} is given twice", at)
                options[key] = (at, value)
        if not pipelines:
            raise self.fail("no pipeline: write at least one, e.g. '16x1: R0-3 L0-59'", 0)
        num_layers = options["layers"][1] if "layers" in options else pipelines[0].num_layers
        for key in options:
            self.positions[("num_layers" if key == "layers" else key,)] = options[key][0]
        name = options["name"][1] if "name" in options else ""
        attention = options["cp_attention"][1] if "cp_attention" in options else "ring"
        strategy = self.build(lambda: Strategy(tuple(pipelines), num_layers, "zero" in options, name, attention))
        if "recompute" not in options:
            return strategy
        at, value = options["recompute"]
        granularity, layers = self.recompute_choice(value, at + len("recompute="))
        return self.build(lambda: with_recompute(strategy, layers, granularity))

    def recompute_choice(self, text: str, at: int) -> tuple[str, tuple[int, ...] | None]:
        """(granularity, layers or None) of 'selective', 'L2-5', 'selective:L2-5' (the choice grammar)."""
        granularity, _, layers = text.rpartition(":") if ":" in text else (
            ("", "", text) if text.startswith("L") else (text, "", ""))
        granularity = granularity or "full"
        if granularity not in GRANULARITIES:
            raise self.fail(f"recompute={text}: the granularity is one of {', '.join(GRANULARITIES)}, e.g. "
                            f"recompute=selective:L2-5", at)
        if not layers:
            return granularity, None
        if not layers.startswith("L"):
            raise self.fail(f"recompute={text}: layers are written L<layers>, e.g. recompute=L2-5,7", at)
        return granularity, self.build(lambda: parse_layer_list(layers[1:]))

    def build(self, make, prefix: Path = ()):
        """Run a constructor; a field error (its path under `prefix`) is reported at the text of the
        field it names."""
        try:
            with field_context(*prefix):
                return make()
        except StrategyFieldError as exc:
            path = exc.path
            while path and path not in self.positions:
                path = path[:-1]
            raise self.fail(str(exc), self.positions.get(path, 0)) from None

    def option(self, clause: str, at: int) -> tuple[str, object]:
        key, eq, value = clause.partition("=")
        key = key.strip()
        if key not in OPTIONS:
            word = key.split()[0] if key.split() else key
            if word.startswith("R") or word.startswith("L"):
                raise self.fail("a pipeline starts with its micro-batches, e.g. '16x2: R0-3 L0-29'", at)
            raise self.fail(
                f"unknown clause {word!r}: write a pipeline ('16x2: R0-3 L0-29 | ...') or an option "
                f"(zero, name=..., layers=...); {closest_hint(word, OPTIONS)}",
                at,
            )
        if key == "zero":
            if eq or value.strip():
                raise self.fail("'zero' takes no value", at)
            return key, True
        value_at = at + len(clause.partition("=")[0]) + 1
        if not eq or not value.strip():
            raise self.fail(f"option {key!r} needs a value, e.g. {key}={'60' if key == 'layers' else 'c2'}", value_at)
        value = value.strip()
        if key == "layers":
            return key, self.number(value, "layers=", value_at)
        return key, value

    def number(self, text: str, what: str, at: int) -> int:
        """A positive integer in ASCII digits (at most MAX_DIGITS of them)."""
        if not is_ascii_number(text):
            raise self.fail(f"{what} needs a positive integer in ASCII digits, got {brief(text)}", at)
        if len(text) > MAX_DIGITS:
            raise self.fail(f"{what} has {len(text)} digits, over the limit of {MAX_DIGITS}", at)
        return int(text)

    def pipeline(self, clause: str, start: int, index: int) -> Pipeline:
        match = _BATCHES.match(clause)
        if not match:
            raise self.fail("a pipeline starts with COUNTxSIZE: (micro-batches x micro-batch size, '?' = run time), e.g. '16x2:'", start)
        path: Path = ("pipelines", index)
        self.positions[path] = start
        self.positions[path + ("micro_batches",)] = start + match.start(1)
        self.positions[path + ("micro_batch_size",)] = start + match.start(2)
        counts = [None if g == "?" else self.number(g, "a micro-batch value", start + match.start(k + 1))
                  for k, g in enumerate(match.groups()[:2])]
        schedule, warmup = self.schedule(match.group(3), start + match.start(3), path)
        stages = []
        offset = match.end()
        for j, part in enumerate(clause[offset:].split("|")):
            stages.append(self.stage(part, start + offset, path + ("stages", j)))
            offset += len(part) + 1
        return self.build(lambda: Pipeline(tuple(stages), *counts, schedule, warmup), path)

    def schedule(self, text: str, at: int, path: Path) -> tuple[str | None, tuple[int, ...] | None]:
        """The optional 'POLICY[=N1,N2,...]' between a pipeline's batches and its ':'."""
        words = list(_WORD.finditer(text))
        if not words:
            return None, None
        if len(words) > 1:
            raise self.fail("a pipeline's schedule is one word, POLICY or POLICY=N1,N2,... (no spaces), "
                            "e.g. '16x1 h1f1b=3,2,1:'", at + words[1].start())
        word = words[0]
        policy, eq, vector = word.group().partition("=")
        self.positions[path + ("schedule",)] = at + word.start()
        self.positions[path + ("warmup",)] = at + word.start() + len(policy) + 1
        if not eq:
            return policy, None
        if not vector:
            raise self.fail(f"schedule {policy}= needs its warm-up vector, e.g. {policy}=3,2,1", at + word.end())
        with_vector = self.build(lambda: parse_count_list(vector), path + ("warmup",))
        return policy, with_vector

    def stage(self, part: str, start: int, path: Path) -> Stage:
        fields: dict[str, str] = {}
        words = list(_WORD.finditer(part))
        self.positions[path] = start + (words[0].start() if words else 0)
        if not words:
            raise self.fail("empty stage: write R<ranks> L<layers>, e.g. R0-3 L0-14", start)
        recompute, chosen, granularity = False, None, "full"
        for word in words:
            text, at = word.group(), start + word.start()
            if text == RECOMPUTE or text.startswith(RECOMPUTE + "="):
                if recompute:
                    raise self.fail("recompute given twice in one stage", at)
                recompute = True
                for key in ("recompute", "recompute_layers", "recompute_granularity"):
                    self.positions[path + (key,)] = at
                if text != RECOMPUTE:
                    granularity, chosen = self.recompute_choice(text[len(RECOMPUTE) + 1:], at + len(RECOMPUTE) + 1)
                continue
            prefix = text[:2] if text[:2] in ("tp", "cp") else text[0]
            if prefix not in _STAGE_FIELDS:
                raise self.fail(f"unexpected {text!r}: a stage is R<ranks> L<layers> [tp<n>] [cp<n>[=shares]] "
                                f"[recompute[=...]], e.g. R0-3 L0-14", at)
            field = _STAGE_FIELDS[prefix]
            if field in fields:
                raise self.fail(f"{prefix} given twice in one stage (ranks are written without spaces: R0-3,8)", at)
            fields[field] = text[len(prefix):]
            self.positions[path + (field,)] = at + len(prefix)
        for field, prefix in (("ranks", "R"), ("layers", "L")):
            if field not in fields:
                raise self.fail(f"stage has no {prefix}<{field}>, e.g. R0-3 L0-14", self.positions[path])
        tp = fields.get("tp")
        if tp is not None:
            tp = self.number(tp, "tp", self.positions[path + ("tp",)])
        cp, shares = 1, None
        if "cp" in fields:
            degree, eq, listed = fields["cp"].partition("=")
            cp = self.number(degree, "cp", self.positions[path + ("cp",)])
            if eq:
                self.positions[path + ("cp_shares",)] = self.positions[path + ("cp",)] + len(degree) + 1
                shares = self.build(lambda: parse_count_list(listed), path + ("cp_shares",))

        def make() -> Stage:
            with field_context(*path, "ranks"):
                ranks = parse_index_list(fields["ranks"])
            with field_context(*path, "layers"):
                layers = parse_layer_range(fields["layers"])
            with field_context(*path):
                return Stage(ranks, layers, tp, recompute, cp, shares, chosen, granularity)

        return self.build(make)


def parse_strategy(text: str) -> Strategy:
    """Parse the compact syntax (module docstring) into a validated Strategy."""
    if not isinstance(text, str):
        raise StrategyTypeError(f"strategy text must be a string, got {type(text).__name__}")
    return _Parser(text).parse()


def format_strategy(strategy: Strategy) -> str:
    """The compact text of `strategy`; parse_strategy(format_strategy(s)) == s."""
    clauses = [f"name={strategy.name}"] if strategy.name else []
    for p in strategy.pipelines:
        count = "?" if p.micro_batches is None else p.micro_batches
        size = "?" if p.micro_batch_size is None else p.micro_batch_size
        stages = " | ".join(map(str, p.stages))
        schedule = "" if p.schedule is None else f" {p.schedule}" + ("" if p.warmup is None else "=" + ",".join(map(str, p.warmup)))
        clauses.append(f"{count}x{size}{schedule}: {stages}")
    if strategy.zero:
        clauses.append("zero")
    if strategy.cp_attention != "ring":
        clauses.append(f"cp_attention={strategy.cp_attention}")
    return " ; ".join(clauses)
