"""The annotation text syntax (docs/design.md, Concepts): a small recursive-descent parser.

    annotation := union | subgroup              hierarchy := annotation (';' annotation)*
    union      := 'H' hdim ratios? '{' subgroup ('|' subgroup)* '}'
    hdim       := 'D' | 'P' | INT                ratios := '(' INT (':' INT)* ')'
    subgroup   := (axis (',' axis)*)? '@' '[' devices ']'
    axis       := 'S' INT ':' INT | 'D' ':' INT | 'P' reduce? ':' INT
    reduce     := '(' ('sum' | 'max' | 'min' | 'avg' | 'prod') ')'      (P:4 is P(sum):4)
    devices    := item (',' item)*               item := INT | INT '-' INT

Whitespace is free. Errors are ParseError with the offending character marked.
"""

from __future__ import annotations

from hspmd.annotations.states import (
    REDUCTIONS, Axis, DeviceGroup, DistributedStates, Duplicate, HDim, Partial, Split, Subgroup,
)
from hspmd.annotations.union import Annotation, Hierarchy
from hspmd.errors import AnnotationError, AnnotationTypeError, LimitError, ParseError
from hspmd.limits import MAX_DEVICES, MAX_DIGITS


class _Parser:
    def __init__(self, text: str):
        if not isinstance(text, str):
            raise AnnotationTypeError(f"annotation text must be a string, got {type(text).__name__}")
        self.text, self.pos = text, 0

    def fail(self, message: str, position: int | None = None) -> ParseError:
        return ParseError(message, self.text, self.pos if position is None else position)

    def skip(self) -> None:
        while self.pos < len(self.text) and self.text[self.pos].isspace():
            self.pos += 1

    def peek(self) -> str:
        self.skip()
        return self.text[self.pos] if self.pos < len(self.text) else ""

    def expect(self, char: str, context: str) -> None:
        if self.peek() != char:
            found = repr(self.peek()) if self.peek() else "end of text"
            raise self.fail(f"expected {char!r} {context}, found {found}")
        self.pos += 1

    def integer(self, what: str) -> int:
        self.skip()
        start = self.pos
        while self.pos < len(self.text) and "0" <= self.text[self.pos] <= "9":
            self.pos += 1
        if start == self.pos:
            found = repr(self.text[self.pos]) if self.pos < len(self.text) else "end of text"
            raise self.fail(f"expected {what} (a non-negative integer in ASCII digits), found {found}")
        if self.pos - start > MAX_DIGITS:
            raise self.fail(f"{what} has {self.pos - start} digits, over the limit of {MAX_DIGITS}", start)
        return int(self.text[start : self.pos])

    def annotated(self, build, start: int):
        """Run a value constructor; its AnnotationError points at the construct that failed."""
        try:
            return build()
        except ParseError:
            raise
        except (AnnotationError, LimitError) as exc:
            raise self.fail(str(exc), start) from None

    def axis(self) -> Axis:
        start, kind = self.pos, self.peek()
        self.pos += 1
        if kind == "S":
            dim = self.integer("a split dim after 'S'")
            self.expect(":", "between the split dim and the count (e.g. S0:2)")
            n = self.integer("a split count")
            return self.annotated(lambda: Split(dim, n), start)
        reduce = self.reduction() if kind == "P" and self.peek() == "(" else "sum"
        self.expect(":", f"after {kind!r} (e.g. {kind}:2)")
        n = self.integer(f"a {'duplicate' if kind == 'D' else 'partial'} count")
        return self.annotated(lambda: Duplicate(n) if kind == "D" else Partial(n, reduce), start)

    def reduction(self) -> str:
        """A Partial axis's reduction in parentheses, e.g. (max)."""
        self.expect("(", "to open the reduction")
        self.skip()
        start = self.pos
        while self.pos < len(self.text) and self.text[self.pos].isalpha():
            self.pos += 1
        name = self.text[start : self.pos]
        if name not in REDUCTIONS:
            raise self.fail(f"expected a reduction ({', '.join(REDUCTIONS)}) after 'P(', found {name or self.peek()!r}", start)
        self.expect(")", "to close the reduction (e.g. P(max):2)")
        return name

    def devices(self) -> DeviceGroup:
        start = self.pos
        self.expect("[", "to open the device list (e.g. @[0,1])")
        devices: list[int] = []
        while True:
            item_start = self.pos
            first = self.integer("a device id")
            if self.peek() == "-":
                self.pos += 1
                last = self.integer("the last device id of a range")
                if last < first:
                    raise self.fail(f"device range {first}-{last} runs backwards; write {last}-{first}", item_start)
                if len(devices) + last - first + 1 > MAX_DEVICES:
                    raise self.fail(f"the device list grows past {MAX_DEVICES} devices, the limit of a group", item_start)
                devices.extend(range(first, last + 1))
            else:
                devices.append(first)
            if self.peek() == ",":
                self.pos += 1
                continue
            self.expect("]", "to close the device list")
            return self.annotated(lambda: DeviceGroup(tuple(devices)), start)

    def subgroup(self) -> Subgroup:
        start = self.pos
        axes: list[Axis] = []
        if self.peek() != "@":
            while True:
                if self.peek() not in ("S", "D", "P"):
                    found = repr(self.peek()) if self.peek() else "end of text"
                    raise self.fail(f"expected an axis (S<dim>:<n>, D:<n>, P:<n>) or '@', found {found}")
                axes.append(self.axis())
                if self.peek() != ",":
                    break
                self.pos += 1
        self.expect("@", "before the device group (e.g. S0:2@[0,1])")
        dg = self.devices()
        return self.annotated(lambda: Subgroup(dg, DistributedStates(tuple(axes))), start)

    def annotation(self) -> Annotation:
        start = self.pos
        if self.peek() != "H":
            sub = self.subgroup()
            return Annotation((sub,))
        self.pos += 1
        if self.peek() in ("D", "P"):
            hdim: HDim = "D" if self.peek() == "D" else "P"
            self.pos += 1
        else:
            hdim = self.integer("HDim after 'H' (a tensor dim, D or P)")
        ratios = None
        if self.peek() == "(":
            self.pos += 1
            ratios = [self.integer("a split ratio")]
            while self.peek() == ":":
                self.pos += 1
                ratios.append(self.integer("a split ratio"))
            self.expect(")", "to close the ratios (e.g. H0(2:1){...})")
        self.expect("{", "to open the union's subgroups")
        subs = [self.subgroup()]
        while self.peek() == "|":
            self.pos += 1
            subs.append(self.subgroup())
        self.expect("}", "to close the union (subgroups are separated by '|')")
        return self.annotated(lambda: Annotation(tuple(subs), hdim, None if ratios is None else tuple(ratios)), start)

    def end(self) -> None:
        if self.peek():
            raise self.fail(f"unexpected {self.peek()!r} after a complete annotation")


def parse(text: str | Annotation) -> Annotation:
    """Parse one annotation; an Annotation passes through unchanged."""
    if isinstance(text, Annotation):
        return text
    p = _Parser(text)
    if not p.peek():
        raise p.fail("empty annotation; write e.g. S0:2@[0,1] or @[0]")
    ann = p.annotation()
    p.end()
    return ann


def parse_hierarchy(text: str | Hierarchy) -> Hierarchy:
    """Parse strategies separated by ';' (one annotation per strategy)."""
    if isinstance(text, Hierarchy):
        return text
    p = _Parser(text)
    strategies = [p.annotation()]
    while p.peek() == ";":
        p.pos += 1
        strategies.append(p.annotation())
    p.end()
    return Hierarchy(tuple(strategies))
