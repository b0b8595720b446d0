"""Trunks beyond ``nn.Sequential``: a module whose forward loops over ``nn.ModuleList`` block lists.

Lightning's demo Transformer, nanoGPT-style GPTs, litgpt and most research code keep their blocks in an
``nn.ModuleList`` and call them in a Python loop; a ResNet runs four ``nn.Sequential`` stages one after
another, an encoder-decoder two lists. Such a forward is recorded as a graph
(:mod:`~lightning_roundpipe.capture`) and cut at every block call of every list into the trunk's layers::

    prologue | block 0 (+ what runs before block 1) | ... | block n-1 | epilogue
    (args)  -> (values live here)                  -> ... ->         -> (the forward's output)

A layer passes on every value a later layer still reads: the hidden state, masks, positional tables,
several tensors. Values that follow from the input signature alone (a causal mask, position ids) travel in
a :class:`~lightning_roundpipe.engine.transfer.NoGrad`; the rest are differentiable activations.

The layers are fixed when the strategy is set up: which module's parameters each one holds (its *state*)
must be known before the engine plans, before any input is seen. Each block layer holds its block; a
module (or a parameter or buffer of the modules that hold the blocks) outside the blocks goes where the
forward's own source first uses it (:mod:`~lightning_roundpipe.uses`: litgpt registers ``lm_head`` before
its blocks and uses it after them), else where it is registered: before the first list to the prologue,
between two lists to the last block of the first, after the last to the epilogue. Modules without state
may be used anywhere. What a layer runs is recorded at the first call with each input signature (shapes,
dtypes, non-tensor arguments, ``training`` flags), because only then are the inputs known. A buffer read
by later layers than its own (a causal mask, a rotary table handed to every block) is read once by its
layer and passed along, read-only, in the ``NoGrad``; any other module or parameter that another layer
reads is refused at that point, saying which and what to do.

The module itself is not changed: the layers are wrappers outside its module tree that hold its own
modules and parameters, so the optimizer, ``state_dict`` keys and checkpoints stay as they are; while the
strategy drives it, the module's ``forward`` is an instance attribute (:class:`TracedForward`).

Here: recording and cutting the graphs (:class:`Registry`), the trunk and its forward. Where the blocks are is
:mod:`~lightning_roundpipe.block_lists`; the layers and the input signatures, :mod:`~lightning_roundpipe.traced_layer`.
"""

from __future__ import annotations

import linecache
import logging
import warnings
from collections.abc import Callable
from typing import Any

import torch
from torch import fx, nn

from lightning_roundpipe.block_lists import (
    HOW_TO_PROCEED,
    TracedPlan,
    find_block_lists,
    find_blocks,
    has_own_forward,
    plan_traced,
)
from lightning_roundpipe.capture import DATA, VALUE, CaptureError, ConcreteTracer, Recorded, is_random
from lightning_roundpipe.engine.layers import Trunk
from lightning_roundpipe.engine.microbatch import batch_size, microbatch_sizes, split
from lightning_roundpipe.engine.pipelined import PipelinedForward
from lightning_roundpipe.engine.transfer import tree_flatten
from lightning_roundpipe.hf.base_model import prepare_call
from lightning_roundpipe.traced_layer import Captured, Modes, Program, TracedLayer, describe_signature, signature
from lightning_roundpipe.uses import first_segments

log = logging.getLogger(__name__)


# ---------------------------------------------------------------------------- recording and cutting
class Registry:
    """The traced trunk's layers and every graph recorded for them, by signature."""

    def __init__(self, plan: TracedPlan, module_name: str) -> None:
        self.plan = plan
        self.module_name = module_name
        self.ids: dict[tuple[Any, ...], int] = {}
        self.captured: list[Captured] = []
        self.random_layers: set[int] = set()
        self.layers: list[TracedLayer] = []
        self._owners: list[dict[str, str]] = []  # per layer: owned path -> "module" or "tensor"
        self._stateless: set[str] = set()
        self._warned_assigned = False
        self._build_layers()

    # -------------------------------------------------------------- ownership, fixed at setup
    def _build_layers(self) -> None:
        plan = self.plan
        container_ids = {id(m) for m in plan.containers}
        list_ids = {id(plan.root.get_submodule(name)) for name in plan.lists}
        registered: dict[str, int] = {}  # path outside the blocks -> how many block lists are registered before it
        values: dict[str, nn.Module | torch.Tensor] = {}
        lists_seen = 0

        def walk(container: nn.Module, prefix: str) -> None:
            nonlocal lists_seen
            for name, tensor in [*container._parameters.items(), *container._buffers.items()]:
                if tensor is not None:
                    registered[prefix + name], values[prefix + name] = lists_seen, tensor
            for name, child in container._modules.items():
                if child is None:
                    continue
                if id(child) in list_ids:
                    lists_seen += 1
                elif id(child) in container_ids:
                    walk(child, f"{prefix}{name}.")
                else:
                    if not any(True for _ in child.parameters()) and not any(True for _ in child.buffers()):
                        self._stateless.add(prefix + name)
                    # where the source does not say, a module holding only derived tables (rotary frequencies)
                    # feeds the blocks, even where it is registered after them, as Hugging Face decoders register
                    # `rotary_emb`
                    early = _holds_only_derived_tables(child)
                    registered[prefix + name], values[prefix + name] = (0 if early else lists_seen), child

        walk(plan.root, "")
        segments = dict(registered)
        if plan.lists:
            segments.update(self._segments_by_use(set(registered)))
        lists = [list(plan.root.get_submodule(name).named_children()) for name in plan.lists]
        # the layer each segment's state goes to: the prologue, the last block of the list before it, the epilogue
        ends = [sum(len(blocks) for blocks in lists[:j]) for j in range(len(lists) + 1)]
        count = ends[-1]
        layer_of_segment = [0, *ends[1:-1], count + 1] if lists else [0]
        owned: list[dict[str, nn.Module | torch.Tensor]] = [{} for _ in range(count + 2 if lists else 1)]
        for name, blocks, first in zip(plan.lists, lists, ends, strict=False):
            for j, (child, block) in enumerate(blocks):
                owned[1 + first + j][f"{name}.{child}"] = block
        for path, segment in segments.items():
            if path not in self._stateless:
                owned[layer_of_segment[segment]][path] = values[path]
        stateless = {path: values[path] for path in self._stateless}
        labels = (["prologue", *(f"block {i}" for i in range(count)), "epilogue"] if lists else ["single stage"])
        for index, (state, label) in enumerate(zip(owned, labels, strict=True)):
            layer = TracedLayer(index, label, self)
            mounted = {**stateless, **state}
            for path, value in mounted.items():
                assert value is not None
                layer.mount(path, value)
            self.layers.append(layer)
            self._owners.append({path: "module" if isinstance(v, nn.Module) else "tensor"
                                 for path, v in mounted.items()})

    def _segments_by_use(self, paths: set[str]) -> dict[str, int]:
        """Per path outside the blocks, the segment where the root's forward source first uses it (see
        :mod:`~lightning_roundpipe.uses`); paths it does not name keep their place by registration."""
        plan = self.plan
        containers = {name for name, m in plan.root.named_modules()
                      if name and any(m is c for c in plan.containers)}

        def resolve(path: str) -> str | None:
            parts = path.split(".")
            return next((p for p in (".".join(parts[:d]) for d in range(len(parts), 0, -1)) if p in paths), None)

        return first_segments(plan.root, plan.lists, sorted(containers), resolve) or {}

    def _owns(self, index: int, target: str) -> bool:
        owners = self._owners[index]
        parts = target.split(".")
        return any(".".join(parts[:depth]) in owners for depth in range(1, len(parts) + 1))

    def _owner_of(self, target: str) -> str:
        for index, layer in enumerate(self.layers):
            if self._owns(index, target):
                return f"the {layer.label} layer"
        return "no layer"

    # -------------------------------------------------------------- per call
    def modes(self) -> Modes:
        return Modes(tuple(m.training for m in self.plan.containers))

    def ensure(self, modes: Modes, args: tuple[Any, ...], kwargs: dict[str, Any], num_microbatches: int,
               before_recording: Callable[[], None]) -> None:
        """Record a graph for every microbatch signature of this call that has none yet."""
        inputs = (args, kwargs)
        leaves, spec = tree_flatten(inputs)
        size = batch_size(inputs)
        sizes = [] if size is None else microbatch_sizes(size, num_microbatches)
        distinct: list[int | None] = [*sorted(set(sizes), reverse=True)] or [None]
        for samples in distinct:
            sig = signature(leaves, spec, samples)
            if (modes.key, sig) in self.ids:
                continue
            example = inputs if samples is None else split(inputs, sizes)[sizes.index(samples)]
            before_recording()
            example_leaves, example_spec = tree_flatten(example)
            self.record(modes, example_leaves, example_spec)

    def record(self, modes: Modes, leaves: list[Any], spec: Any) -> None:
        plan = self.plan
        sig = signature(leaves, spec)
        shown = f"`{plan.root_name}`" if plan.root_name else self.module_name

        def describe(reason: str) -> str:
            return (f"RoundPipe could not record the forward of {shown} ({type(plan.root).__name__}) for the inputs "
                    f"{describe_signature(sig)}: {reason}. {HOW_TO_PROCEED}")

        tracer = ConcreteTracer(plan.root, plan.containers, describe)
        recorded = tracer.record(leaves, spec)
        if recorded.assigned and not self._warned_assigned:
            self._warned_assigned = True
            warnings.warn(
                f"the forward of {shown} assigns {', '.join(f'`{n}`' for n in recorded.assigned)} (an attribute "
                "cache, say); under RoundPipe the recorded graph computes such values on every call and the "
                "assignment is not kept on the module", UserWarning, stacklevel=2)
        ident = len(self.captured)
        self.captured.append(self._cut(recorded, ident, describe))
        self.ids[(modes.key, sig)] = ident
        log.debug(f"RoundPipe recorded graph #{ident} of {shown} for the inputs {describe_signature(sig)}")

    def _cut(self, recorded: Recorded, ident: int, describe: Callable[[str], str]) -> Captured:
        plan, graph = self.plan, recorded.graph
        nodes = list(graph.nodes)
        block_index = {id(block): i for i, block in enumerate(plan.block_modules)}
        calls = [block_index[id(plan.root.get_submodule(str(node.target)))] for node in nodes
                 if node.op == "call_module" and id(plan.root.get_submodule(str(node.target))) in block_index]
        count = len(block_index)
        if calls != list(range(count)):
            raise CaptureError(describe(
                f"it calls the blocks of {', '.join(f'`{plan.qualified(n)}`' for n in plan.lists)} in the order "
                f"{calls}; RoundPipe cuts the forward at the block calls, so each of the {count} blocks must be "
                "called once, in order (list after list, in the order they are registered)"))
        last = 0 if count == 0 else count + 1
        layer_of: dict[fx.Node, int] = {}
        seen = 0
        for node in nodes:
            if node.op == "get_attr":
                continue  # issued again in every layer that reads it: parameters are not activations
            if node.op == "output":
                layer_of[node] = last
            elif node.op == "call_module" and id(plan.root.get_submodule(str(node.target))) in block_index:
                seen += 1
                layer_of[node] = seen
            elif node.op == "placeholder" or seen == 0:
                layer_of[node] = 0
            else:
                layer_of[node] = seen if seen < count else last
        carried = self._carried_buffers(nodes, layer_of)
        last_use = {node: max([layer_of[node], *(layer_of[user] for user in node.users)])
                    for node in layer_of if node.op != "output"}
        live = [[node for node in layer_of if node.op != "output" and layer_of[node] <= k < last_use[node]]
                for k in range(last)]
        programs = []
        output = next(n for n in nodes if n.op == "output")
        for k in range(last + 1):
            inputs = [n for n in nodes if n.op == "placeholder"] if k == 0 else live[k - 1]
            body = [n for n in nodes if layer_of.get(n) == k and n.op not in ("placeholder", "output")]
            self._check_owned(k, body, recorded, carried, describe)
            segment = self._segment(k, ident, inputs, body, tuple(live[k]) if k < last else output.args[0],
                                    recorded.constants)
            constant_in = tuple(n in carried or not n.meta[DATA] for n in inputs) if k else ()
            constant_out = tuple(n in carried or not n.meta[DATA] for n in live[k]) if k < last else ()
            programs.append(Program(_compile(segment, f"<roundpipe: {self.layers[k].label}, graph {ident}>"),
                                    constant_in, constant_out))
        computed = [isinstance(leaf, fx.Proxy) for leaf in recorded.out_leaves]
        return Captured(programs, recorded.out_spec,
                        [None if is_computed else leaf
                         for leaf, is_computed in zip(recorded.out_leaves, computed, strict=True)], computed)

    def _segment(self, k: int, ident: int, inputs: list[fx.Node], body: list[fx.Node], output: Any,
                 constants: dict[str, torch.Tensor]) -> fx.Graph:
        """Layer ``k``'s graph: ``inputs`` as placeholders, a copy of ``body``, ``output`` returned; the
        parameters and constants it reads are fetched here again (never carried between layers)."""
        segment = fx.Graph()
        env: dict[fx.Node, fx.Node] = {node: segment.placeholder(node.name) for node in inputs}

        def lookup(node: fx.Node) -> fx.Node:
            if node not in env:
                assert node.op == "get_attr", f"{node} is not live into layer {k}"
                target = str(node.target)
                if target in constants:
                    name = f"_roundpipe_constant_{ident}_{target.rsplit('_', 1)[1]}"
                    setattr(self.layers[k], name, constants[target])
                    target = name
                env[node] = segment.get_attr(target)
            return env[node]

        for node in body:
            env[node] = segment.node_copy(node, lookup)
            if node.op in ("call_function", "call_method") and is_random(node.target):
                self.random_layers.add(k)
        segment.output(fx.node.map_arg(output, lookup))
        return segment

    def _carried_buffers(self, nodes: list[fx.Node], layer_of: dict[fx.Node, int]) -> set[fx.Node]:
        """The reads of a buffer of the root or a container (a causal mask, a rotary table) by layers after
        the one that holds it: read once there and passed along, read-only, in the ``NoGrad`` (placed in
        ``layer_of``). A parameter is never passed along: its gradient must reach its own layer."""
        carried = set()
        for node in nodes:
            if node.op != "get_attr" or isinstance(node.meta.get(VALUE), nn.Parameter):
                continue
            owner = next((k for k in range(len(self.layers)) if self._owns(k, str(node.target))), None)
            readers = {layer_of[user] for user in node.users}
            if owner is not None and readers and min(readers) >= owner and readers != {owner}:
                layer_of[node] = owner
                carried.add(node)
        return carried

    def _check_owned(self, k: int, body: list[fx.Node], recorded: Recorded, carried: set[fx.Node],
                     describe: Callable[[str], str]) -> None:
        for node in body:
            for used in [node, *(n for n in node.all_input_nodes if n.op == "get_attr")]:
                if (used.op not in ("call_module", "get_attr") or str(used.target) in recorded.constants
                        or (used in carried and used is not node)):
                    continue
                target = str(used.target)
                if not self._owns(k, target):
                    raise CaptureError(describe(
                        f"the {self.layers[k].label} layer uses `{self.plan.qualified(target)}`, which belongs to "
                        f"{self._owner_of(target)}. RoundPipe gives each module outside the blocks to the layer "
                        "where the forward's own code first uses it (else by where it is registered: before, "
                        "between or after the block lists), as it must fix each layer's parameters before any "
                        "input is seen; use it in one place only (between the same two block calls), or register "
                        "it on the side where it is used"))


def _compile(graph: fx.Graph, filename: str) -> Callable[..., Any]:
    """``forward(self, *inputs)`` from ``graph``, with ``self`` the layer (or its device replica)."""
    code = graph.python_code(root_module="self")
    namespace = dict(code.globals)
    linecache.cache[filename] = (len(code.src), None, code.src.splitlines(keepends=True), filename)
    exec(compile(code.src, filename, "exec"), namespace)  # noqa: S102 - fx's own generated code, as GraphModule runs it
    return namespace["forward"]


# ---------------------------------------------------------------------------- the trunk and the forward
class TracedTrunk(Trunk):
    """The trunk of a traced module; ``registry`` records and holds its graphs."""

    def __init__(self, registry: Registry, source: str) -> None:
        super().__init__(list(registry.layers), source=source)
        self.registry = registry


def build_traced_trunk(module: nn.Module, name: str | None = None) -> tuple[TracedTrunk, nn.Module, str]:
    """The traced trunk of ``module`` (see :func:`plan_traced`), the module whose forward it takes over, and
    that module's name (``""``: ``module`` itself)."""
    plan = plan_traced(module, name)
    registry = Registry(plan, type(module).__name__)
    if not plan.lists:
        source = f"{type(plan.root).__name__} traced with torch.fx: no repeated blocks, one stage"
    else:
        source = (f"{type(plan.root).__name__} traced with torch.fx: {len(plan.block_modules)} blocks of "
                  f"{' then '.join(f'`{plan.qualified(n)}`' for n in plan.lists)} between a prologue and an epilogue")
    return TracedTrunk(registry, source), plan.root, plan.root_name


class TracedForward(PipelinedForward):
    """The ``forward`` of a traced module driven by an engine: records a graph for each new input signature
    (on the main thread, with the engine idle), then runs the pipeline."""

    def prepare(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[tuple[Any, ...], dict[str, Any]]:
        trunk = self.engine.trunk
        assert isinstance(trunk, TracedTrunk)
        registry = trunk.registry
        modes = registry.modes()
        args, kwargs = prepare_call(registry.plan.root, args, kwargs)  # a Hugging Face model's: no KV cache
        # the tracer patches torch.nn.Module globally while it records: no worker may be running a layer
        registry.ensure(modes, args, kwargs, self.engine.num_microbatches, self.engine.synchronize)
        return (modes, *args), kwargs

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        args, kwargs = self.prepare(args, kwargs)
        return self.engine(*args, **kwargs)


def _holds_only_derived_tables(module: nn.Module) -> bool:
    """Whether ``module`` has no parameters and only non-persistent buffers (tables computed from the
    configuration, outside the ``state_dict``), at least one."""
    buffers = [(owner, name) for owner in module.modules() for name in owner._buffers
               if owner._buffers[name] is not None]
    return (bool(buffers) and not any(True for _ in module.parameters())
            and all(name in owner._non_persistent_buffers_set for owner, name in buffers))


# find_block_lists, find_blocks and has_own_forward live in block_lists.py: imported from here too
__all__ = ["CaptureError", "TracedForward", "TracedTrunk", "build_traced_trunk", "find_block_lists", "find_blocks",
           "has_own_forward", "plan_traced"]
