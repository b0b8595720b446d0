"""Where a traced forward uses each module and tensor outside its blocks, read from its source.

The layers of a traced trunk must know their parameters when the strategy is set up, before any input is
seen, so the graph cannot tell which layer uses a module outside the blocks. The forward's source can:
``self.lm_head(x)`` written after the loop over the blocks belongs to the epilogue even when ``lm_head`` is
registered first (litgpt's ``GPT``), and a rotary table registered last but sliced before the loop belongs
to the prologue. This module reads the root's ``forward`` with :mod:`ast` and says, for each attribute
path, in which *segment* it is first used: 0 before the first block list runs, ``i`` after the ``i``-th.

It is a reading of the source, not of what runs: a use hidden in a helper method or a container's
forward is not seen (the caller then falls back to the order of registration), and the recorded graph is
checked against the result, with an error naming the module when they disagree.
"""

from __future__ import annotations

import ast
import functools
import inspect
import textwrap
from collections.abc import Callable

from torch import nn

Position = tuple[int, int]


def _source_tree(module: nn.Module) -> tuple[ast.FunctionDef, str] | None:
    """The ``forward`` definition of ``module``'s class and the name of its first argument, or ``None``
    where there is no source to read (a built-in, a REPL)."""
    return _parse(type(module).forward)


@functools.lru_cache(maxsize=256)
def _parse(forward: Callable[..., object]) -> tuple[ast.FunctionDef, str] | None:
    try:
        source = textwrap.dedent(inspect.getsource(forward))
    except (OSError, TypeError):
        return None
    try:
        tree = ast.parse(source)
    except SyntaxError:
        return None
    function = tree.body[0] if tree.body else None
    if not isinstance(function, (ast.FunctionDef, ast.AsyncFunctionDef)) or not function.args.args:
        return None
    return function, function.args.args[0].arg  # type: ignore[return-value]


def _chain(node: ast.expr, this: str) -> list[str] | None:
    """``self.a.b["c"]`` as ``["a", "b", "c"]`` (``this`` is the name of ``self``); ``None`` otherwise."""
    names: list[str] = []
    while True:
        if isinstance(node, ast.Attribute):
            names.append(node.attr)
            node = node.value
        elif isinstance(node, ast.Subscript) and isinstance(node.slice, ast.Constant) and isinstance(
                node.slice.value, (str, int)):
            names.append(str(node.slice.value))
            node = node.value
        elif isinstance(node, ast.Name) and node.id == this and names:
            return names[::-1]
        else:
            return None


def _expressions(statement: ast.stmt) -> list[ast.AST]:
    """The nodes of ``statement`` outside its nested statements (those are visited on their own)."""
    found: list[ast.AST] = []
    pending: list[ast.AST] = [child for child in ast.iter_child_nodes(statement)
                              if not isinstance(child, (ast.stmt, ast.ExceptHandler))]
    while pending:
        node = pending.pop()
        found.append(node)
        pending.extend(ast.iter_child_nodes(node))
    return found


def first_segments(module: nn.Module, lists: list[str], containers: list[str],
                   resolve: Callable[[str], str | None]) -> dict[str, int] | None:
    """Per path that ``resolve`` knows (it maps a dotted attribute path to the owned path it falls in, or
    ``None``), the segment of its first use in ``module``'s forward: the number of block lists (``lists``,
    dotted paths, in the order they run) whose use ends before it. A list's use ends with the statement
    that last names it (the ``for`` loop over it, body included, or ``x = self.layer1(x)``); naming a
    container in ``containers`` (a path above some lists) names those lists. ``None`` without source."""
    found = _source_tree(module)
    if found is None:
        return None
    function, this = found
    ends: dict[str, Position] = {}
    uses: list[tuple[Position, str]] = []

    def visit(statement: ast.stmt) -> None:
        end = (statement.end_lineno or statement.lineno, statement.end_col_offset or 0)
        chains = {}
        for node in _expressions(statement):
            if isinstance(node, (ast.Attribute, ast.Subscript)):
                names = _chain(node, this)
                if names is not None:
                    chains[node] = names
        inner = {id(node.value) for node in chains if isinstance(node, (ast.Attribute, ast.Subscript))}
        for node, names in chains.items():
            if id(node) in inner:
                continue  # `self.a` within `self.a.b`: the longest chain is the use
            path = ".".join(names)
            named = [n for n in lists if path == n or path.startswith(f"{n}.")
                     or (path in containers and n.startswith(f"{path}."))]
            for name in named:
                ends[name] = max(ends.get(name, end), end)
            if not named:
                owned = resolve(path)
                if owned is not None:
                    uses.append(((node.lineno, node.col_offset), owned))

    def walk(statements: list[ast.stmt]) -> None:
        for statement in statements:
            visit(statement)
            for field in ("body", "orelse", "finalbody", "handlers"):
                inner = getattr(statement, field, None)
                if isinstance(inner, list):
                    walk([s for s in inner if isinstance(s, ast.stmt)] + [
                        s for h in inner if isinstance(h, ast.ExceptHandler) for s in h.body])

    walk(function.body)
    segments: dict[str, int] = {}
    for position, owned in sorted(uses):
        segment = sum(1 for name in lists if name in ends and ends[name] < position)
        segments.setdefault(owned, segment)
    return segments


def named_paths(module: nn.Module) -> set[str]:
    """Every dotted attribute path of ``self`` that ``module``'s forward source names (``self.layer1``,
    ``self.transformer.h``), outer chains and their prefixes alike; empty without source."""
    found = _source_tree(module)
    if found is None:
        return set()
    function, this = found
    paths = set()
    for node in ast.walk(function):
        if isinstance(node, (ast.Attribute, ast.Subscript)):
            names = _chain(node, this)
            if names is not None:
                paths.add(".".join(names))
    return paths
