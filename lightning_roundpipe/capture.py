"""Capturing a forward that loops over blocks as a graph: torch.fx's tracer, fed one example's values.

The trunk of a module without an ``nn.Sequential`` (see :mod:`~lightning_roundpipe.traced`) is the forward
that calls its blocks, cut at the block calls. To cut it, the calls around the blocks must be seen as a
graph. What records it, and why:

- ``torch.fx.symbolic_trace`` alone refuses any Python decision on a traced value: ``assert t <=
  block_size``, ``if mask.size(0) != t``, ``for x in h.shape`` all raise, and nearly every real forward
  has one.
- ``torch.export`` (and torch's pipelining frontend, which is built on it) traces every module down to
  aten operations, the blocks too, writes the tracing device into tensor factories (``device='cpu'``),
  so a piece could not run on another device, and refuses ``nn.Transformer``, whose causal-mask check
  reads the mask's values.

So this is fx's own :class:`torch.fx.Tracer`, extended through its documented hooks (``to_bool``,
``iter``, ``is_leaf_module``, ``proxy``): every proxy also carries the value it takes for one example
microbatch, computed as the graph is recorded. A Python decision on a value that follows from the input
*signature* alone (shapes, dtypes, devices, the non-tensor arguments, constants, masks made from shapes)
is taken with the example's value, so the graph is specialized to that signature and recorded once per
signature. A decision on a value that depends on the data (the inputs' values, parameters, buffers,
random numbers) cannot be specialized and is refused, naming the line.

Every module except the containers on the way to the blocks is a *leaf*: recorded as one call and run
as itself, with its own Python, hooks and ``training`` flag. Only the containers' own code becomes graph
operations. Running the example through the leaves must not change the model, so the trace runs without
autograd, with the random generator forked, and puts back every buffer and module attribute afterwards.
"""

from __future__ import annotations

import contextlib
import operator
import os
import threading
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import fx, nn
from torch.fx.node import map_aggregate
from torch.utils import _pytree as pytree

from lightning_roundpipe.engine.transfer import tree_unflatten

VALUE = "roundpipe_value"  #: node.meta key: the node's value for the example
DATA = "roundpipe_data"    #: node.meta key: whether that value depends on data (not on the signature only)

# reading these tells the signature (shape, dtype, device), never the data
METADATA_ATTRIBUTES = frozenset({"shape", "dtype", "device", "ndim", "is_cuda", "is_nested", "layout", "is_sparse",
                                 "is_quantized", "is_meta", "requires_grad", "is_leaf"})
METADATA_METHODS = frozenset({"size", "dim", "ndimension", "numel", "nelement", "get_device", "is_contiguous",
                              "is_floating_point", "is_complex", "element_size", "stride"})
# a value drawn from the random generator differs between calls: nothing may be decided on it
RANDOM_WORDS = ("rand", "dropout", "bernoulli", "normal", "multinomial", "poisson", "uniform", "exponential",
                "geometric", "cauchy")
# factories that fx does not record when a size is a proxy (``torch.ones(t, t)``): wrapped while tracing
FACTORIES = ("ones", "zeros", "empty", "full", "rand", "randn", "randint", "eye", "tensor", "as_tensor",
             "linspace", "logspace", "arange")


class CaptureError(ValueError):
    """The forward cannot be recorded as a graph; the message says where and what to do."""


def is_random(target: Any) -> bool:
    name = target if isinstance(target, str) else getattr(target, "__name__", "")
    return any(word in name for word in RANDOM_WORDS)


_SKIPPED = (os.path.dirname(torch.__file__) + os.sep, os.path.dirname(os.path.abspath(__file__)) + os.sep)


def user_location() -> str:
    """``file:line: code`` of the innermost frame outside torch and this package (the user's line)."""
    for frame in reversed(traceback.extract_stack()):
        if frame.filename.startswith(_SKIPPED) or frame.filename.startswith("<"):
            continue
        return f"{frame.filename}:{frame.lineno}: {(frame.line or '').strip()}"
    return "an unknown line"


class ConcreteProxy(fx.Proxy):
    """A proxy that knows its value for the example: ``len``, ``int`` and iteration use it."""

    @property
    def value(self) -> Any:
        return self.node.meta[VALUE]

    @property
    def data(self) -> bool:
        return bool(self.node.meta[DATA])

    def __getattr__(self, name: str) -> ConcreteAttribute:  # type: ignore[override]
        return ConcreteAttribute(self, name)

    def __len__(self) -> int:
        return len(self.value)  # the length of a tensor is its shape, of a tuple its structure

    def _concrete(self, convert: Callable[[Any], Any], what: str) -> Any:
        if self.data:
            tracer = self.tracer
            assert isinstance(tracer, ConcreteTracer)
            raise tracer.failure(f"`{what}()` of a value computed from the values of tensors, not only their shapes, "
                                 f"at {user_location()}; one graph cannot stand for every batch")
        return convert(self.value)

    def __index__(self) -> int:
        return self._concrete(operator.index, "int")

    def __int__(self) -> int:
        return self._concrete(int, "int")

    def __float__(self) -> float:
        return self._concrete(float, "float")


class ConcreteAttribute(ConcreteProxy):
    """fx's lazy attribute proxy (``x.shape``, or ``x.view`` before its call), as a :class:`ConcreteProxy`."""

    def __init__(self, root: fx.Proxy, attr: str) -> None:  # fx.proxy.Attribute's, as a ConcreteProxy
        self.root = root
        self.attr = attr
        self.tracer = root.tracer
        self._node: fx.Node | None = None

    @property
    def node(self) -> fx.Node:  # type: ignore[override]
        if self._node is None:
            self._node = self.tracer.create_proxy("call_function", getattr, (self.root, self.attr), {}).node
        return self._node

    def __call__(self, *args: Any, **kwargs: Any) -> fx.Proxy:
        return self.tracer.create_proxy("call_method", self.attr, (self.root, *args), kwargs)


@dataclass
class Recorded:
    """What one trace recorded: the graph (placeholders are the example's tensor leaves, in order), the
    output's structure, the tensor constants its ``get_attr`` nodes name, and the attributes the traced
    forwards assigned (put back afterwards)."""

    graph: fx.Graph
    out_spec: pytree.TreeSpec
    out_leaves: list[Any]  # the output's leaves: a Proxy where the graph computes it, else the value itself
    constants: dict[str, torch.Tensor] = field(default_factory=dict)
    assigned: list[str] = field(default_factory=list)


class ConcreteTracer(fx.Tracer):
    """Records ``type(root).forward`` on one example; the modules in ``containers`` are traced through,
    every other module is one leaf call. See the module docstring."""

    def __init__(self, root: nn.Module, containers: list[nn.Module], describe: Callable[[str], str]) -> None:
        super().__init__(autowrap_functions=())
        self.root = root
        self._containers = {id(module) for module in containers}
        self._installed = {id(module) for module in root.modules()}
        self._describe = describe  # turns a reason into the whole error message
        self._executing = 0         # > 0 while the example runs for real: nothing is recorded then
        self._thread = threading.get_ident()
        self._inputs: dict[str, Any] = {}
        self._example: tuple[list[Any], pytree.TreeSpec] | None = None
        self._recorded_output: tuple[pytree.TreeSpec, list[Any]] | None = None
        self.constants: dict[str, torch.Tensor] = {}
        self._buffer_views: dict[int, tuple[torch.Tensor, fx.Node]] = {}  # by id: the view, and its node

    def failure(self, reason: str) -> CaptureError:
        return CaptureError(self._describe(reason))

    # ------------------------------------------------------------------ fx hooks
    def proxy(self, node: fx.Node) -> fx.Proxy:
        return ConcreteProxy(node, self)

    def is_leaf_module(self, m: nn.Module, module_qualified_name: str) -> bool:
        return id(m) not in self._containers

    def _recording(self) -> bool:
        return self._executing == 0 and threading.get_ident() == self._thread

    def call_module(self, m: nn.Module, forward: Callable[..., Any], args: tuple[Any, ...],
                    kwargs: dict[str, Any]) -> Any:
        if not self._recording():  # a leaf running for real calls its own submodules
            return forward(*args, **kwargs)
        if id(m) not in self._installed:
            # made inside the forward (litgpt's `nn.Identity()`): there is no path to record a call by, and
            # its code is the forward's own code, run again on every call; so it is traced through
            if any(True for _ in m.parameters()) or any(True for _ in m.buffers()):
                raise self.failure(
                    f"the forward calls a {type(m).__name__} that is not a submodule of it (made inside the forward, "
                    f"at {user_location()}) and holds parameters or buffers, which no layer could own; register it "
                    "as a submodule in __init__")
            return forward(*args, **kwargs)
        return super().call_module(m, forward, args, kwargs)

    def getattr(self, attr: str, attr_val: Any, parameter_proxy_cache: dict[str, Any]) -> Any:
        if not self._recording():
            return attr_val
        return super().getattr(attr, attr_val, parameter_proxy_cache)

    def to_bool(self, obj: fx.Proxy) -> bool:
        assert isinstance(obj, ConcreteProxy)
        if obj.data:
            raise self.failure(
                f"a Python condition depends on the values of tensors (the inputs', the parameters' or random "
                f"numbers), not only on their shapes, at {user_location()}; one graph cannot stand for every "
                "batch. Make the condition depend on shapes only (or compute it outside the module's forward)")
        return bool(obj.value)

    def iter(self, obj: fx.Proxy) -> Iterator[Any]:
        assert isinstance(obj, ConcreteProxy)
        items: Any = obj
        return iter([items[index] for index in range(len(obj))])

    def keys(self, obj: fx.Proxy) -> Any:
        assert isinstance(obj, ConcreteProxy)
        return list(obj.value.keys())

    def create_arg(self, a: Any) -> Any:
        if isinstance(a, torch.Tensor) and not isinstance(a, nn.Parameter) and not _is_state(self.root, a):
            view = self._buffer_view(a)
            if view is not None:
                return view
            # a tensor made during the trace without a proxy (`torch.ones(3)`), or a plain tensor attribute
            # (not a registered buffer): a constant of this capture, captured by reference
            name = next((key for key, constant in self.constants.items() if constant is a), None)
            if name is None:
                name = f"_roundpipe_constant_{len(self.constants)}"
                self.constants[name] = a
            node = self.create_node("get_attr", name, (), {})
            node.meta[VALUE], node.meta[DATA] = a, False
            return node
        argument = super().create_arg(a)
        if isinstance(argument, fx.Node) and argument.op == "get_attr" and VALUE not in argument.meta:
            argument.meta[VALUE], argument.meta[DATA] = a, True  # a parameter or buffer met as a plain value
        return argument

    def _buffer_view(self, tensor: torch.Tensor) -> fx.Node | None:
        """``tensor`` as a view of a registered buffer, recorded as such (``torch.as_strided`` of the buffer), or
        ``None`` when it is no view of one. fx does not proxy buffers, so ``self.cos[:t]`` runs eagerly and hands
        the blocks a view of the host's rotary table: captured as a constant, every layer on every device would
        read the host's buffer instead of its own copy (a GPU could not, and a CPU stand-in's job writing the
        buffer back would change memory a saved view reads). Recorded from the buffer, each layer takes the view
        of the copy bound where it runs. Only views of a contiguous buffer that starts its storage qualify: the
        layout of its device copies is then the same."""
        held = self._buffer_views.get(id(tensor))  # the view is held there too: its id stays its own
        if held is not None:
            return held[1]
        storage = tensor.untyped_storage().data_ptr()
        for name, buffer in self.root.named_buffers():
            if (buffer.untyped_storage().data_ptr() != storage or buffer.device != tensor.device
                    or not buffer.is_contiguous() or buffer.storage_offset() != 0):
                continue
            base = self.create_node("get_attr", name, (), {})
            base.meta[VALUE], base.meta[DATA] = buffer, True
            node = self.create_node("call_function", torch.as_strided,
                                    (base, tuple(tensor.shape), tuple(tensor.stride()), tensor.storage_offset()), {})
            node.meta[VALUE], node.meta[DATA] = tensor, False  # read-only, from the signature: travels in the NoGrad
            self._buffer_views[id(tensor)] = (tensor, node)
            return node
        return None

    def create_args_for_root(self, root_fn: Callable[..., Any], is_module: bool,
                             concrete_args: Any = None) -> tuple[Any, list[Any]]:
        assert self._example is not None
        leaves, spec = self._example
        placeholders: list[Any] = []
        for leaf in leaves:
            if isinstance(leaf, torch.Tensor):
                name = f"input_{len(placeholders)}"
                self._inputs[name] = leaf
                placeholders.append(self.create_proxy("placeholder", name, (), {}))

        def entry(*proxies: Any) -> tuple[Any, ...]:
            given = iter(proxies)
            args, kwargs = tree_unflatten([next(given) if isinstance(leaf, torch.Tensor) else leaf
                                           for leaf in leaves], spec)
            output = root_fn(self.root, *args, **kwargs)
            out_leaves, out_spec = pytree.tree_flatten(output)
            self._recorded_output = (out_spec, out_leaves)
            return tuple(leaf for leaf in out_leaves if isinstance(leaf, fx.Proxy))

        return entry, placeholders

    def create_proxy(self, kind: str, target: Any, args: tuple[Any, ...], kwargs: dict[str, Any],
                     name: str | None = None, type_expr: Any = None,
                     proxy_factory_fn: Callable[[fx.Node], fx.Proxy] | None = None) -> fx.Proxy:
        proxy = super().create_proxy(kind, target, args, kwargs, name, type_expr, proxy_factory_fn)
        node = proxy.node
        if kind == "placeholder":
            node.meta[VALUE], node.meta[DATA] = self._inputs[target], True
        else:
            node.meta[VALUE], node.meta[DATA] = self._evaluate(kind, target, args, kwargs)
        return proxy

    # ------------------------------------------------------------------ the example's values
    def _evaluate(self, kind: str, target: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, bool]:
        depends = [False]

        def value_of(a: Any) -> Any:
            if isinstance(a, ConcreteProxy):
                depends[0] = depends[0] or a.data
                return a.value
            if isinstance(a, nn.Parameter):
                depends[0] = True
            return a

        real_args = map_aggregate(args, value_of)
        real_kwargs = map_aggregate(kwargs, value_of)
        assert isinstance(real_args, tuple) and isinstance(real_kwargs, dict)
        data = depends[0] or kind in ("get_attr", "call_module") or is_random(target)
        if kind == "call_function" and target is getattr and args[1] in METADATA_ATTRIBUTES:
            data = False
        elif kind == "call_method" and target in METADATA_METHODS:
            data = False
        self._executing += 1
        try:
            if kind == "call_function":
                value = target(*real_args, **real_kwargs)
            elif kind == "call_method":
                value = getattr(real_args[0], target)(*real_args[1:], **real_kwargs)
            elif kind == "call_module":
                value = self.root.get_submodule(target)(*real_args, **real_kwargs)
            elif kind == "get_attr":
                value = self.root
                for part in target.split("."):
                    value = getattr(value, part)
            else:
                raise AssertionError(f"unexpected node kind {kind!r}")
        except CaptureError:
            raise
        except Exception as error:
            what = target if isinstance(target, str) else getattr(target, "__name__", repr(target))
            raise self.failure(f"running `{what}` on the example raised {type(error).__name__}: {error} (at "
                               f"{user_location()})") from error
        finally:
            self._executing -= 1
        return value, data

    # ------------------------------------------------------------------ one trace
    def record(self, leaves: list[Any], spec: pytree.TreeSpec) -> Recorded:
        """Trace ``type(root).forward`` on the example whose flattened ``(args, kwargs)`` are ``leaves``."""
        self._example = (leaves, spec)
        snapshot = _Snapshot(self.root, self._containers)
        try:
            with torch.no_grad(), torch.random.fork_rng(devices=[]), _factories_recorded(self):
                graph = self.trace(self.root)
        except CaptureError:
            raise
        except Exception as error:
            raise self.failure(f"torch.fx could not trace it: {type(error).__name__}: {error}") from error
        finally:
            assigned = snapshot.restore()
        assert self._recorded_output is not None
        out_spec, out_leaves = self._recorded_output
        return Recorded(graph, out_spec, out_leaves, dict(self.constants), assigned)


def _is_state(root: nn.Module, tensor: torch.Tensor) -> bool:
    return any(tensor is buffer for buffer in root.buffers())


@contextlib.contextmanager
def _factories_recorded(tracer: ConcreteTracer) -> Iterator[None]:
    """``torch.ones(t, t)`` with a proxy size is recorded (fx records it only for some factories); without
    a proxy among the arguments the factory runs as usual (also on other threads)."""
    originals = {name: getattr(torch, name) for name in FACTORIES}

    def wrap(original: Callable[..., Any]) -> Callable[..., Any]:
        def factory(*args: Any, **kwargs: Any) -> Any:
            found = [False]

            def look(a: Any) -> Any:
                found[0] = found[0] or isinstance(a, fx.Proxy)
                return a

            map_aggregate((args, kwargs), look)
            if found[0] and tracer._recording():
                return tracer.create_proxy("call_function", original, args, kwargs)
            return original(*args, **kwargs)

        return factory

    for name, original in originals.items():
        setattr(torch, name, wrap(original))
    try:
        yield
    finally:
        for name, original in originals.items():
            setattr(torch, name, original)


class _Snapshot:
    """The state of every module under ``root`` (attributes and buffer values), to put back after a trace:
    running the example must not change the model (a BatchNorm's statistics, a cached table, a proxy stored
    in an attribute by the traced forward)."""

    _TABLES = ("_parameters", "_buffers", "_modules")

    def __init__(self, root: nn.Module, reported: set[int]) -> None:
        named = list(root.named_modules())
        self.reported = reported  # whose assignments are reported (leaves' writes are the stage runner's to report)
        self.modules = [module for _, module in named]
        self.prefixes = [f"{name}." if name else "" for name, _ in named]
        self.attributes = [{name: (dict(value) if name in self._TABLES else value)
                            for name, value in module.__dict__.items()} for module in self.modules]
        self.buffers = [(buffer, buffer.detach().clone()) for buffer in root.buffers()]

    def restore(self) -> list[str]:
        """Put everything back; the plain attributes of the ``reported`` modules that had been assigned
        (``path.name``)."""
        assigned = []
        for prefix, module, saved in zip(self.prefixes, self.modules, self.attributes, strict=True):
            now = module.__dict__
            changed = [name for name in now if name not in saved]
            for name in changed:
                del now[name]
            for name, value in saved.items():
                if name in self._TABLES:
                    table = now[name]
                    if table.keys() != value.keys() or any(table[k] is not value[k] for k in value):
                        table.clear()
                        table.update(value)
                elif now.get(name, _MISSING) is not value:
                    changed.append(name)
                    now[name] = value
            if id(module) in self.reported:
                assigned += [prefix + name for name in changed]
        with torch.no_grad():
            for buffer, saved_value in self.buffers:
                if buffer.shape == saved_value.shape:
                    buffer.copy_(saved_value)
        return assigned


_MISSING = object()
