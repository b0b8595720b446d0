"""Near misses of the strategy names: ``Trainer(strategy="roundpip")`` says ``did you mean 'roundpipe'?``.

Lightning checks a strategy name against the names in its registry and, for an unknown one, raises its own
generic error before anything of ours runs; it has no hook for unknown names. So the likely misspellings are
registered too, through the registry's public ``register``, each as a factory that raises an error naming the
closest real name: one letter left out or two neighbours swapped, ``round_pipe`` / ``round-pipe`` and the like
(Lightning lower-cases the name first, so ``RoundPipe`` is ``roundpipe``). A name further off still gets
Lightning's own error. The registry lists these entries (``StrategyRegistry.available_strategies()``), each
described as a misspelling.
"""

from __future__ import annotations

import difflib
from typing import Any, NoReturn

NAMES = ("roundpipe", "roundpipe_async")  #: the strategy names RoundPipe registers


def _spellings(name: str) -> set[str]:
    """``name`` with the separators people write between its words (Lightning lower-cases a name itself)."""
    separators = ("", "_", "-", " ")
    return {name.replace("roundpipe", f"round{first}pipe").replace("_async", f"{second}async")
            for first in separators for second in separators}


def _typos(name: str) -> set[str]:
    """One letter left out, or two neighbouring letters swapped."""
    left_out = {name[:i] + name[i + 1:] for i in range(len(name))}
    swapped = {name[:i] + name[i + 1] + name[i] + name[i + 2:] for i in range(len(name) - 1)}
    return left_out | swapped


def near_misses(names: tuple[str, ...] = NAMES) -> dict[str, str]:
    """Each likely misspelling of ``names`` -> the name it most likely meant (no real name among them)."""
    misses: dict[str, str] = {}
    for name in names:
        for miss in _spellings(name) | _typos(name) | {name + "s"}:
            misses.setdefault(miss, suggestion(miss, names))
    return {miss: meant for miss, meant in misses.items() if miss not in names}


def suggestion(given: str, names: tuple[str, ...] = NAMES) -> str:
    """The name in ``names`` closest to ``given`` (case and separators aside)."""
    def plain(text: str) -> str:
        return text.lower().replace("-", "_").replace(" ", "_")

    best = difflib.get_close_matches(plain(given), names, n=1, cutoff=0.0)
    return best[0] if best else names[0]


def refuse(given: str, meant: str) -> NoReturn:
    """The registry's factory for a near miss: what ``Trainer(strategy=given)`` raises."""
    raise ValueError(f"You selected an invalid strategy name: `strategy={given!r}`: did you mean {meant!r}? "
                     f"RoundPipe's strategies are {', '.join(map(repr, NAMES))}")


def register_near_misses(registry: Any) -> None:
    """Register every near miss not already a name in ``registry`` (Lightning's ``StrategyRegistry``)."""
    for miss, meant in near_misses().items():
        if miss not in registry:
            registry.register(miss, refuse, description=f"a misspelling of {meant!r} (raises an error saying so)",
                              given=miss, meant=meant)
