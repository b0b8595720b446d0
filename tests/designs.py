"""Covering designs: a few parametrized cases instead of a full product, with every pair of levels in them.

A full product of factors (model x devices x microbatches x ...) grows multiplicatively while most defects
show up in one factor or in the interplay of two. A pairwise design holds every pair of levels of any two
factors in at least one case, in about (largest level count) x (second largest) cases. The designs are
written out in the test modules as explicit ``pytest.param`` lists, so they stay readable;
:func:`missing_pairs` is what a test runs on them, so that an edit cannot silently lose a pair.
"""

from __future__ import annotations

import itertools
from collections.abc import Hashable, Mapping, Sequence
from typing import Any


def missing_pairs(cases: Sequence[Any], factors: Mapping[str, Sequence[Hashable]]) -> list[str]:
    """The pairs of levels no case holds, as ``"factor=level, factor=level"``; empty for a pairwise design.

    ``cases``: ``pytest.param`` objects (or plain tuples) whose values are the factors' levels in the order of
    ``factors`` (factor name -> its levels). A value that is not one of its factor's levels is reported too."""
    names = list(factors)
    rows = [tuple(getattr(case, "values", case)) for case in cases]
    problems = [f"case {row}: {len(row)} values for {len(names)} factors" for row in rows if len(row) != len(names)]
    problems += [f"case {row}: {name}={value!r} is not one of {list(factors[name])}"
                 for row in rows if len(row) == len(names)
                 for name, value in zip(names, row, strict=True) if value not in factors[name]]
    for (i, first), (j, second) in itertools.combinations(enumerate(names), 2):
        held = {(row[i], row[j]) for row in rows if len(row) == len(names)}
        problems += [f"{first}={a!r}, {second}={b!r}"
                     for a, b in itertools.product(factors[first], factors[second]) if (a, b) not in held]
    return problems
