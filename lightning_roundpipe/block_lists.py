"""Where a module's blocks are: the block lists its forward runs (each an ``nn.ModuleList`` or ``nn.Sequential`` of
modules of one type, holding parameters) and the :class:`TracedPlan` of what a traced trunk records and cuts.

Read by the trunk finder (:mod:`~lightning_roundpipe.trunk`) and the traced trunk (:mod:`~lightning_roundpipe.traced`).
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from lightning_roundpipe.engine.layers import parameter_count
from lightning_roundpipe.uses import named_paths

HOW_TO_PROCEED = ("Name the trunk with RoundPipeStrategy(pipeline=...): an nn.Sequential of the layers (e.g. "
                  "self.net = nn.Sequential(embedding, *blocks, head)), or the nn.ModuleList of the blocks")


def _is_block_list(module: nn.Module) -> bool:
    """An ``nn.ModuleList`` or ``nn.Sequential`` of modules of one type that hold parameters: blocks."""
    children = list(module.children())
    return (isinstance(module, (nn.ModuleList, nn.Sequential)) and len(children) > 0
            and len({type(c) for c in children}) == 1 and parameter_count(module) > 0)


def find_block_lists(module: nn.Module) -> list[str]:
    """The names (within ``module``) of its block lists, in registration order: every ``nn.ModuleList`` or
    ``nn.Sequential`` of modules of one type, holding parameters, that is not inside another one and that
    the source of a forward above it names (a ResNet's four stages, an encoder's layers then a decoder's;
    not a list the forward never runs)."""
    found: list[str] = []
    for name, candidate in module.named_modules():
        if not name or any(name.startswith(f"{outer}.") for outer in found):
            continue
        if _is_block_list(candidate) and _named_by_a_forward(module, name):
            found.append(name)
    return found


def _named_by_a_forward(module: nn.Module, name: str) -> bool:
    """Whether the forward source of ``name``'s parent, or of a module above it, names it or a module
    between (``self.layer1``, ``self.transformer`` above ``transformer.encoder.layers``)."""
    parts = name.split(".")
    for depth in range(len(parts)):
        above = module.get_submodule(".".join(parts[:depth])) if depth else module
        if not has_own_forward(above):
            continue
        rest = parts[depth:]
        if any(".".join(rest[:k]) in named_paths(above) for k in range(1, len(rest) + 1)):
            return True
    return False


def find_blocks(module: nn.Module) -> str | None:
    """The name (within ``module``) of its largest ``nn.ModuleList`` of modules of one type, by parameters
    (the shallowest on a tie), or ``None``."""
    lists = {name: m for name, m in module.named_modules()
             if name and isinstance(m, nn.ModuleList) and len(m) > 0 and len({type(c) for c in m}) == 1}
    if not lists:
        return None
    return max(lists, key=lambda n: (parameter_count(lists[n]), -n.count(".")))


def has_own_forward(module: nn.Module) -> bool:
    """Whether ``module``'s class defines a forward (not nn.Module's missing one, a container's, or the
    LightningModule base class's)."""
    forward = getattr(type(module), "forward", None)
    return (forward is not None and forward is not nn.Module.forward
            and getattr(forward, "__qualname__", "") != "LightningModule.forward")


@dataclass
class TracedPlan:
    """Where the traced trunk lies in a module: ``root`` (named ``root_name`` in it; ``""`` is the module
    itself) is the module whose forward is recorded and taken over; ``lists`` are the names of the block
    lists within ``root``, in the order the forward runs them (none: one stage); ``containers`` are the
    modules traced through (``root``, those between it and the lists, and the ``nn.Sequential`` lists,
    whose own forward calls the blocks)."""

    root_name: str
    root: nn.Module
    lists: list[str]
    containers: list[nn.Module]

    @property
    def block_modules(self) -> list[nn.Module]:
        return [block for name in self.lists for block in self.root.get_submodule(name).children()]

    def qualified(self, name: str) -> str:
        return f"{self.root_name}.{name}" if self.root_name else name


def _lists_of(module: nn.Module, name: str | None) -> list[str]:
    """The block lists of ``module`` (names within it): ``name`` alone when it names an ``nn.ModuleList``,
    else those of ``name``'s module (:func:`find_block_lists`) when there are several, else its largest
    ``nn.ModuleList`` (the single-list choice)."""
    target = module.get_submodule(name) if name else module
    prefix = f"{name}." if name else ""
    if name and isinstance(target, nn.ModuleList):
        return [name]
    lists = find_block_lists(target)
    if len(lists) > 1:
        return [prefix + n for n in lists]
    found = find_blocks(target)
    return [prefix + found] if found else []


def plan_traced(module: nn.Module, name: str | None = None) -> TracedPlan:
    """The :class:`TracedPlan` of ``module``: ``name`` (``pipeline=``) is an ``nn.ModuleList`` of blocks or
    the module to record (its block lists are used); by default the block lists of ``module`` with, as
    root, the module's child that holds them all (what ``self.model(x)`` calls), or no blocks and
    ``module`` itself as one stage."""
    target = module.get_submodule(name) if name else module
    names = _lists_of(module, name)
    if not names:
        root_name = name or ""
    elif name and not isinstance(target, nn.ModuleList):
        root_name = name
    else:
        firsts = {n.split(".")[0] for n in names}
        first = next(iter(firsts))
        child = module.get_submodule(first)
        root_name = (first if len(firsts) == 1 and first not in names and has_own_forward(child) else "")
    root = module.get_submodule(root_name) if root_name else module
    if not has_own_forward(root):
        shown = f"`{root_name}`" if root_name else type(module).__name__
        around = ", ".join(f"`{n}`" for n in names)
        raise ValueError(
            f"{type(module).__name__} has no nn.Sequential submodule or Hugging Face causal LM to pipeline, and "
            f"{shown} ({type(root).__name__}) has no forward of its own to record"
            f"{f' around the blocks {around}' if names else ''}. {HOW_TO_PROCEED}")
    containers = [root]
    relatives = [n[len(root_name) + 1:] if root_name else n for n in names]
    for relative, full in zip(relatives, names, strict=True):
        parts = relative.split(".")
        for depth in range(1, len(parts)):
            container = root.get_submodule(".".join(parts[:depth]))
            if all(container is not c for c in containers):
                containers.append(container)
        blocks = root.get_submodule(relative)
        if not any(True for _ in blocks.children()):
            raise ValueError(f"`{full}` is an empty nn.ModuleList: there are no blocks to pipeline")
        if isinstance(blocks, nn.Sequential):  # `self.layer1(x)`: its forward's loop calls the blocks
            containers.append(blocks)
    return TracedPlan(root_name, root, relatives, containers)
