"""Deterministic samples of the combinatorial test matrices, and the switch
that runs every combination.

A generic test crosses factors (solver x dtype x layout x nesting ...). Their
full product grows with every new solver; the default run takes a covering
sample instead: every pair of levels of any two factors appears in at least
one case (pairwise covering; `strength=1`: every level of every factor at
least once), chosen greedily with a seed derived from the test's name, so the
same commit runs the same cases every time.

    SOLVAX_TEST_MATRIX=full python -m pytest -n auto tests    # the whole product

A case keeps its test id in both modes (ids name the levels, never their
position in the sample), so a failure prints one command that reruns exactly
it (`conftest.py` adds it to the report).
"""

from __future__ import annotations

import hashlib
import itertools
import os
import random

import pytest

MODE = os.environ.get("SOLVAX_TEST_MATRIX", "sampled").strip().lower() or "sampled"
if MODE not in ("sampled", "full"):
    raise ValueError(f"SOLVAX_TEST_MATRIX={MODE!r}: use 'sampled' (the default) or 'full'")
FULL = MODE == "full"


def level_id(name: str, index: int, value) -> str:
    """A stable id for one level: its own text for strings, numbers, booleans
    and named objects, otherwise the factor's name and the level's index."""
    if value is None or isinstance(value, (str, int, float, bool)):
        return str(value)
    named = getattr(value, "__name__", None)
    if isinstance(named, str) and named != "<lambda>":
        return named
    return f"{name}{index}"


def covering(sizes: list[int], strength: int, seed: str) -> list[tuple[int, ...]]:
    """Index tuples that cover every `strength`-combination of levels (greedy:
    each pick covers the most uncovered combinations; ties broken by a
    generator seeded with `seed`), in the product's order."""
    product = list(itertools.product(*(range(n) for n in sizes)))
    strength = min(strength, len(sizes))
    if strength == len(sizes):
        return product
    groups = list(itertools.combinations(range(len(sizes)), strength))

    def keys(case):
        return {(g, tuple(case[f] for f in g)) for g in groups}

    uncovered = set().union(*(keys(case) for case in product))
    rng = random.Random(int.from_bytes(hashlib.sha256(seed.encode()).digest()[:8], "big"))
    order = product[:]
    rng.shuffle(order)
    chosen = []
    while uncovered:
        best = max(order, key=lambda case: len(keys(case) & uncovered))
        chosen.append(best)
        uncovered -= keys(best)
        order.remove(best)
    return sorted(chosen)


def sample(key: str, *, strength: int = 2, always=(), **factors) -> list:
    """`pytest.param` cases of the factors' product: all of them with
    `SOLVAX_TEST_MATRIX=full`, else a covering sample of the given strength
    (plus the combinations in `always`, given as tuples of values).

    Use as `@pytest.mark.parametrize("name, dtype", sample("test_x", name=[...],
    dtype=[...]))`; the factors' order is the parameters' order.
    """
    names = list(factors)
    levels = [list(factors[n]) for n in names]
    if FULL:
        picked = list(itertools.product(*(range(len(lv)) for lv in levels)))
    else:
        picked = covering([len(lv) for lv in levels], strength, key)
        for values in always:
            case = tuple(_index(lv, v) for lv, v in zip(levels, values))
            if case not in picked:
                picked.append(case)
        picked.sort()
    return [pytest.param(*(lv[i] for lv, i in zip(levels, case)),
                         id="-".join(level_id(n, i, lv[i]) for n, lv, i in
                                     zip(names, levels, case)))
            for case in picked]


def _index(levels: list, value) -> int:
    for i, level in enumerate(levels):
        if level is value or (type(level) is type(value) and level == value):
            return i
    raise ValueError(f"{value!r} is not a level of this factor")


def examples(n: int) -> int:
    """Hypothesis examples for a property: `n` by default, 4n for the full run."""
    return 4 * n if FULL else n


def levels(every: list, default: list) -> list:
    """A factor's levels: `default` (a subset that keeps each code path, e.g.
    one solver variant per method module) unless the full matrix is asked for."""
    return list(every) if FULL else [level for level in every if level in default]
