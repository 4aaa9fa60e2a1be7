"""Counting the collectives of a compiled function: the one communication counter.

`count_collectives(fn, *args)` compiles `jax.jit(fn)` for `args`, reads the
optimized HLO module and walks its call graph from the entry computation,
recording every collective instruction with the `while` loops and the
conditional branches that enclose it, and how many arrays it moves.
"""

from __future__ import annotations

import dataclasses
import re
from collections import Counter
from collections.abc import Callable
from typing import Any

import jax

KINDS = ("all-reduce", "all-gather", "reduce-scatter", "collective-permute", "all-to-all",
         "collective-broadcast", "ragged-all-to-all")

_DTYPE_BYTES = {"pred": 1, "s8": 1, "u8": 1, "f8e4m3fn": 1, "f8e5m2": 1, "s16": 2, "u16": 2,
                "f16": 2, "bf16": 2, "s32": 4, "u32": 4, "f32": 4, "s64": 8, "u64": 8,
                "f64": 8, "c64": 8, "c128": 16}
_HEADER = re.compile(r"^(?:ENTRY\s+)?%?([\w.\-]+)\s*\(.*\)\s*->.*\{\s*$")
_INSTR = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*(.*?)\s([a-z][a-z0-9\-]*)\((.*)$")
_ARRAY = re.compile(r"\b(" + "|".join(_DTYPE_BYTES) + r")\[([\d,]*)\]")
_CALLED = re.compile(
    r"\b(?:condition|body|to_apply|calls|true_computation|false_computation)=%?([\w.\-]+)")
_CALLED_LIST = re.compile(r"\b(?:branch_computations|called_computations)=\{([^}]*)\}")
_TRIP = re.compile(r'"known_trip_count"\s*:\s*\{\s*"n"\s*:\s*"?(\d+)')


@dataclasses.dataclass(frozen=True)
class Collective:
    """One collective instruction of the module."""

    kind: str
    bytes: int
    loops: tuple[str, ...]  # enclosing while loops, outermost first
    weight: int  # executions per iteration of the outermost enclosing loop
    name: str
    # arrays it moves: XLA's all-reduce combiner merges independent all-reduces
    # into one variadic instruction, which XLA:CPU runs as one rendezvous per
    # array (measured: two scalars in one tuple all-reduce cost what two
    # all-reduces cost, a stacked 2-vector what one costs)
    operands: int = 1
    # enclosing conditional branches, outermost first: (conditional, branch index)
    branches: tuple[tuple[str, int], ...] = ()


@dataclasses.dataclass(frozen=True)
class Loop:
    """A `while` loop: its depth, trip count (None: unknown) and own collectives."""

    name: str
    depth: int
    trip_count: int | None
    collectives: int  # directly in its body or condition, not in nested loops


@dataclasses.dataclass(frozen=True)
class CollectiveReport:
    """What `count_collectives` found.

    Attributes:
        total: collective instructions in the module (async start/done pairs
            once) — a static count, the seed table's metric.
        setup: collectives outside every `while` loop.
        per_iteration: synchronization points per iteration of the most
            communicating outermost loop; a collective in a nested loop counts
            its trip count times (once if unknown, see `unknown_trip_counts`).
        by_kind: instruction count per kind.
        bytes_by_kind: bytes one execution of each kind's instructions moves
            (result size), summed over instructions.
        bytes_per_iteration: bytes the loop counted in `per_iteration` moves
            per iteration.
        loops: every `while` loop that encloses a collective, outermost first.
        unknown_trip_counts: a nested loop with collectives has no known trip count.
        collectives: every instruction found.
        step_loop: the innermost communicating loop (the deepest, and of those
            the one with most collectives): one CG or BiCGStab iteration, one
            Arnoldi or Lanczos step, one IDR(s) cycle, one s-step outer step;
            None without loops.
        per_step: per kind, the collectives one pass of `step_loop`
            *executes*: a variadic (tuple) instruction counts each array it
            moves (XLA:CPU synchronizes once per array), a conditional its
            busiest branch only (one branch runs). The synchronizations of
            a Krylov step are `per_step["all-reduce"]` (plus any all-gather);
            collective-permutes are neighbour (halo) exchanges.
        per_step_instructions: per kind, the collective *instructions* one
            pass of `step_loop` executes, a variadic one once: what a GPU or
            TPU synchronizes, where XLA's combiner merges a step's separate
            all-reduces into one tuple all-reduce and the backend runs it as
            one collective (`step_count(kind, backend="tpu")`).
    """

    total: int
    setup: int
    per_iteration: int
    by_kind: dict[str, int]
    bytes_by_kind: dict[str, int]
    bytes_per_iteration: int
    loops: tuple[Loop, ...]
    unknown_trip_counts: bool
    collectives: tuple[Collective, ...]
    step_loop: str | None = None
    per_step: dict[str, int] = dataclasses.field(default_factory=dict)
    per_step_instructions: dict[str, int] = dataclasses.field(default_factory=dict)

    def count(self, kind: str) -> int:
        """Instructions of one kind (`"all-reduce"`, `"all-gather"`, ...)."""
        return self.by_kind.get(kind, 0)

    def step_count(self, kind: str, backend: str = "cpu") -> int:
        """Synchronizations of one kind per pass of `step_loop` on `backend`:
        on XLA:CPU (`"cpu"`, what the tests pin) a variadic (tuple) instruction
        counts each array it moves (`per_step`); on `"gpu"` and `"tpu"` it is
        one collective (`per_step_instructions`)."""
        if backend not in ("cpu", "gpu", "tpu"):
            raise ValueError(f"`backend` must be 'cpu', 'gpu' or 'tpu'; got {backend!r}.")
        counts = self.per_step if backend == "cpu" else self.per_step_instructions
        return counts.get(kind, 0)

    def loop_count(self, loop: str, kind: str) -> int:
        """Collectives of one kind one pass of the loop named `loop` executes
        itself (not counting loops nested in it), counted as in `per_step`."""
        return _executed(_own(self.collectives, loop, kind))

    def __str__(self) -> str:
        rows = [("kind", "instructions", "bytes")]
        rows += [(k, str(self.by_kind[k]), str(self.bytes_by_kind[k]))
                 for k in sorted(self.by_kind)]
        width = [max(len(r[i]) for r in rows) for i in range(3)]
        lines = [f"collectives: total {self.total}, setup {self.setup}, "
                 f"per iteration {self.per_iteration} ({self.bytes_per_iteration} bytes)"]
        if self.step_loop is not None:
            executed = ", ".join(f"{k} {v}" for k, v in sorted(self.per_step.items()))
            lines.append(f"  executed per step ({self.step_loop}): {executed or 'none'}")
        if self.unknown_trip_counts:
            lines.append("  note: a nested loop with collectives has an unknown trip count "
                         "(counted once per outer iteration)")
        lines += ["  " + "  ".join(c.ljust(w) for c, w in zip(r, width)) for r in rows]
        for loop in self.loops:
            trip = "?" if loop.trip_count is None else loop.trip_count
            lines.append(f"  loop {loop.name} (depth {loop.depth}, trips {trip}): "
                         f"{loop.collectives} collectives per pass")
        return "\n".join(lines)


def _bytes(shape: str, kind: str, opcode: str) -> int:
    sizes = []
    for dtype, dims in _ARRAY.findall(shape):
        n = 1
        for d in filter(None, dims.split(",")):
            n *= int(d)
        sizes.append(n * _DTYPE_BYTES[dtype])
    if not sizes:
        return 0
    if kind == "all-reduce" or not opcode.endswith("-start"):
        return sum(sizes)
    return max(sizes)  # async forms carry (operand, result, ...): count the data once


def _operands(rest: str) -> int:
    """The arrays an instruction takes (its operand list ends at the first `)`)."""
    return max(1, len(re.findall(r"%[\w.\-]+", rest.split(")")[0])))


def _executed(collectives, depth: int = 0, arrays: bool = True) -> int:
    """How many synchronizations these collectives of one loop pass execute:
    each counts its arrays (`arrays`: XLA:CPU) or once; of a conditional's
    branches, only the busiest."""
    total = sum(c.operands if arrays else 1 for c in collectives if len(c.branches) == depth)
    by_conditional: dict = {}
    for c in collectives:
        if len(c.branches) > depth:
            cond, branch = c.branches[depth]
            by_conditional.setdefault(cond, {}).setdefault(branch, []).append(c)
    for branches in by_conditional.values():
        total += max(_executed(cs, depth + 1, arrays) for cs in branches.values())
    return total


def _parse(text: str):
    """`{computation: [(name, shape, opcode, rest)]}` and the entry's name."""
    comps, entry, current = {}, None, None
    for line in text.splitlines():
        header = _HEADER.match(line)
        if header:
            current = header.group(1)
            comps[current] = []
            if line.startswith("ENTRY"):
                entry = current
            continue
        if line.startswith("}"):
            current = None
            continue
        if current is not None:
            instr = _INSTR.match(line)
            if instr:
                comps[current].append(instr.groups())
    return comps, entry


def callees(rest: str) -> list[str]:
    """The computations an instruction calls (`rest`: its text after the
    opcode): bodies, conditions, branches, fused and applied computations."""
    called = _CALLED.findall(rest)
    for group in _CALLED_LIST.findall(rest):
        called += [c.strip().lstrip("%") for c in group.split(",") if c.strip()]
    return called


def _walk(comps: dict, entry: str | None):
    """Every collective reachable from the entry computation, every `while`
    loop met (by name) and each loop's own collectives (`Counter`)."""
    found: list[Collective] = []
    loops: dict[str, Loop] = {}
    own: Counter = Counter()

    def visit(comp: str, stack: tuple[str, ...], weight: int, seen: tuple[str, ...],
              branches: tuple = ()):
        if comp not in comps or comp in seen:
            return
        for name, shape, opcode, rest in comps[comp]:
            base = opcode[:-6] if opcode.endswith("-start") else opcode
            if base in KINDS and not opcode.endswith("-done"):
                operands = _operands(rest) if base == "all-reduce" else 1
                found.append(Collective(base, _bytes(shape, base, opcode), stack, weight, name,
                                        operands, branches))
                if stack:
                    own[stack[-1]] += 1
            if opcode == "while":
                trip = _TRIP.search(rest)
                trips = int(trip.group(1)) if trip else None
                loops[name] = Loop(name, len(stack), trips, 0)
                inner_weight = weight * (trips or 1) if stack else 1
                for called in _CALLED.findall(rest):
                    visit(called, stack + (name,), inner_weight, seen + (comp,), branches)
                continue
            for index, c in enumerate(callees(rest)):
                inside = branches + ((name, index),) if opcode == "conditional" else branches
                visit(c, stack, weight, seen + (comp,), inside)

    if entry is not None:
        visit(entry, (), 1, ())
    return found, loops, own


def analyze_hlo(text: str) -> CollectiveReport:
    """Build a `CollectiveReport` from optimized HLO text."""
    found, loops, own = _walk(*_parse(text))
    by_kind = Counter(c.kind for c in found)
    bytes_by_kind = Counter()
    for c in found:
        bytes_by_kind[c.kind] += c.bytes
    per_loop: Counter = Counter()
    bytes_loop: Counter = Counter()
    for c in found:
        if c.loops:
            per_loop[c.loops[0]] += c.weight
            bytes_loop[c.loops[0]] += c.weight * c.bytes
    busiest = max(per_loop, key=lambda k: (per_loop[k], bytes_loop[k]), default=None)
    with_collectives = {name for c in found for name in c.loops}
    loop_list = tuple(dataclasses.replace(loops[n], collectives=own[n])
                      for n in loops if n in with_collectives)
    unknown = any(loop.depth > 0 and loop.trip_count is None for loop in loop_list)
    step_loop = _step_loop(loop_list)
    kinds = sorted({c.kind for c in _own(found, step_loop)})
    per_step = {kind: _executed(_own(found, step_loop, kind)) for kind in kinds}
    instructions = {kind: _executed(_own(found, step_loop, kind), arrays=False) for kind in kinds}
    return CollectiveReport(
        total=len(found),
        setup=sum(1 for c in found if not c.loops),
        per_iteration=per_loop[busiest] if busiest else 0,
        by_kind=dict(by_kind),
        bytes_by_kind=dict(bytes_by_kind),
        bytes_per_iteration=bytes_loop[busiest] if busiest else 0,
        loops=loop_list,
        unknown_trip_counts=unknown,
        collectives=tuple(found),
        step_loop=step_loop,
        per_step=per_step,
        per_step_instructions=instructions,
    )


def _own(collectives, loop: str | None, kind: str | None = None) -> list:
    """The collectives directly in `loop`'s body (not in loops nested in it),
    of one kind or all."""
    return [c for c in collectives if c.loops and c.loops[-1] == loop
            and kind in (None, c.kind)]


def _step_loop(loops: tuple[Loop, ...]) -> str | None:
    """The innermost communicating loop: the deepest, the busiest of those."""
    if not loops:
        return None
    deepest = max(loop.depth for loop in loops)
    return max((lp for lp in loops if lp.depth == deepest), key=lambda lp: lp.collectives).name


def compiled_text(fn: Callable, *args: Any, **kwargs: Any) -> str:
    """The optimized HLO text of `jax.jit(fn)` compiled for these arguments."""
    return jax.jit(fn).lower(*args, **kwargs).compile().as_text()


def count_collectives(fn: Callable, *args: Any, **kwargs: Any) -> CollectiveReport:
    """Count the collective operations of `jax.jit(fn)(*args, **kwargs)`.

    The function is compiled for the given (possibly sharded) arguments and
    its optimized HLO is read: what is counted is what the compiler emitted,
    not what the algebra suggests. Pass sharded operands as arguments, not
    closure constants (constants may be replicated), and differentiate a
    nonlinear functional when measuring an adjoint (XLA folds a linear one).

    Args:
        fn: the function to compile (plain or already `jax.jit`-ed).
        *args, **kwargs: example arguments; arrays may carry any sharding.

    Returns:
        A `CollectiveReport`: `total`, `setup`, `per_iteration`, a breakdown
        by kind with bytes, and the loops; `str(report)` is a small table.

    Invalid arguments raise whatever `jax.jit(fn).lower(...)` raises.

    For example:

    ```python
    report = sx.count_collectives(lambda b: sx.pcg(matvec, b).x, b)
    assert report.per_iteration == 2 and report.count("all-gather") == 0
    ```
    """
    return analyze_hlo(compiled_text(fn, *args, **kwargs))
