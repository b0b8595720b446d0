"""The engine's primitives, each on its own: host cells, gradient windows, the abort signal, CPU streams and events,
layer replicas, byte counts. Expectations are worked out by hand; ordering is checked through events."""

from __future__ import annotations

import collections
import dataclasses
import threading
import time
from collections.abc import Iterator

import pytest
import torch
from torch import nn
from torch.utils import _pytree as pytree

from lightning_roundpipe.engine import replica
from lightning_roundpipe.engine.call import HostCell
from lightning_roundpipe.engine.device import AbortSignal, DeviceCounters, EngineAborted, HostEvent, Stream
from lightning_roundpipe.engine.layers import Trunk, as_layer_input, single_argument
from lightning_roundpipe.engine.step.window import GradWindow
from lightning_roundpipe.engine.transfer import (
    nbytes_of,
    tensors_nbytes,
    tree_flatten,
    tree_leaves,
    tree_map,
    tree_nbytes,
    tree_unflatten,
)

WAIT = 10.0  # seconds: only a broken primitive ever waits this long


# ------------------------------------------------------------------ HostCell
def test_a_host_cell_keeps_its_value_until_its_last_counted_reader_consumes_it():
    cell = HostCell("the output of F0 microbatch 0")
    cell.expect_reader()
    cell.expect_reader()
    assert not cell.event.is_set()
    value = torch.arange(3)
    cell.put(value)
    assert cell.event.is_set() and cell.value is value
    cell.consume()
    assert cell.value is value  # one reader still to come
    cell.consume()
    assert cell.value is None


def test_a_host_cell_nobody_counted_keeps_its_value_and_refuses_a_read_too_many():
    ready = HostCell.ready("the caller's input")
    assert ready.event.is_set() and ready.value == "the caller's input"
    with pytest.raises(RuntimeError, match=r"ready was read by more jobs than were counted: call expect_reader\(\)"):
        ready.consume()
    assert ready.value == "the caller's input"  # the refused read dropped nothing

    cell = HostCell("a checkpoint")
    cell.expect_reader()
    cell.put(1)
    cell.consume()
    with pytest.raises(RuntimeError, match="a checkpoint was read by more jobs than were counted"):
        cell.consume()


# ------------------------------------------------------------------ GradWindow
def test_a_grad_window_sums_gradients_per_parameter_and_adds_them_into_param_grad():
    window = GradWindow(AbortSignal(WAIT))
    tied, other = nn.Parameter(torch.zeros(2)), nn.Parameter(torch.zeros(1))
    other.grad = torch.tensor([10.0])  # gradients already there are added to, not replaced
    first = window.job_started(None, [tied])
    second = window.job_started(None, [tied, other])
    window.deliver(first, [torch.tensor([1.0, 2.0])])    # two jobs use the tied parameter
    window.deliver(second, [torch.tensor([0.5, 0.25]), torch.tensor([3.0])])
    window.job_finished()
    window.job_finished()
    window.close()
    window.wait_complete()
    window.publish()
    assert torch.equal(tied.grad, torch.tensor([1.5, 2.25]))
    assert torch.equal(other.grad, torch.tensor([13.0]))
    window.publish()  # published gradients leave the window: a second publish adds nothing
    assert torch.equal(tied.grad, torch.tensor([1.5, 2.25]))


def test_a_grad_window_is_idle_between_jobs_and_complete_only_once_closed_and_drained():
    window = GradWindow(AbortSignal(WAIT))
    window.wait_idle()  # no job yet
    window.job_started(None)
    window.job_finished()
    window.wait_idle()  # idle again, though still open for more jobs
    window.job_started(None)
    window.close()
    window.job_finished()
    window.wait_complete()

    still_running = GradWindow(AbortSignal(0.1))
    still_running.job_started(None)
    still_running.close()
    with pytest.raises(TimeoutError, match="waited more than 0.1 s for the gradients of the iteration"):
        still_running.wait_complete()

    open_window = GradWindow(AbortSignal(0.1))
    with pytest.raises(TimeoutError, match="for the gradients of the iteration"):
        open_window.wait_complete()  # no job running, but not closed: more may come


def test_a_grad_window_waits_for_the_uploads_of_every_job_that_read_the_weights():
    abort = AbortSignal(0.1)
    window = GradWindow(abort)
    forward, backward = HostEvent("forward upload"), HostEvent("backward upload")
    window.job_read_only(forward)  # reads the weights, adds no gradient
    window.job_started(backward)
    forward.set()
    with pytest.raises(TimeoutError, match="backward upload"):
        window.wait_uploads()

    # by layer: a job's upload counts for each layer it reads; one of no layer only for the wait for all
    window = GradWindow(AbortSignal(0.1))
    both, second, none = HostEvent("layers 0 and 1"), HostEvent("layer 1"), HostEvent("no layer")
    window.job_read_only(both, [0, 1])
    window.job_started(second, layers=[1])
    window.job_read_only(none)
    assert not window.uploads_done([0]) and not window.uploads_done([1])
    assert window.uploads_done([2]) and window.uploads_done([])  # no upload reads them
    both.set()
    assert window.uploads_done([0]) and not window.uploads_done([0, 1])
    window.wait_uploads([0])
    second.set()
    assert window.uploads_done([0, 1])
    window.wait_uploads([1, 0])
    with pytest.raises(TimeoutError, match="no layer"):
        window.wait_uploads()  # all of them: the upload of no layer too

    window = GradWindow(AbortSignal(WAIT))
    uploads = [HostEvent(f"upload {index}") for index in range(3)]
    for event in uploads:
        window.job_read_only(event)
    for event in uploads:
        event.set()
    window.wait_uploads()


# ------------------------------------------------------------------ AbortSignal
def test_the_first_error_wins_and_an_abort_without_error_keeps_none():
    abort = AbortSignal(WAIT)
    assert not abort.aborted and abort.error is None
    first, second = ValueError("first"), KeyError("second")
    abort.fail(first)
    abort.fail(second)
    assert abort.aborted and abort.error is first

    shutdown = AbortSignal(WAIT)
    shutdown.abort()
    assert shutdown.aborted and shutdown.error is None


def test_an_abort_wakes_every_waiter_with_engine_aborted():
    abort = AbortSignal(WAIT)
    never = [HostEvent(f"never {index}") for index in range(3)]
    started = [threading.Event() for _ in never]
    raised: list[BaseException | None] = [None] * len(never)

    def wait(index: int) -> None:
        started[index].set()
        try:
            never[index].wait(abort)
        except BaseException as error:  # noqa: BLE001 - checked below
            raised[index] = error

    threads = [threading.Thread(target=wait, args=(index,)) for index in range(len(never))]
    for thread in threads:
        thread.start()
    for event in started:
        assert event.wait(WAIT)
    abort.abort()
    for thread in threads:
        thread.join(WAIT)
    assert not any(thread.is_alive() for thread in threads)
    assert [type(error) for error in raised] == [EngineAborted] * 3
    assert [str(error) for error in raised] == [f"engine stopped while waiting for never {i}" for i in range(3)]


def test_a_wait_past_the_timeout_fails_the_engine_with_a_timeout_error():
    abort = AbortSignal(0.05)
    with pytest.raises(TimeoutError, match=r"waited more than 0.05 s for the stuck event; the pipeline is stuck\. "
                                           r"Raise `wait_timeout`") as caught:
        HostEvent("the stuck event").wait(abort)
    assert abort.aborted and abort.error is caught.value

    done = HostEvent("done")
    done.set()
    done.wait(AbortSignal(0.05))  # a set event returns at once


# ------------------------------------------------------------------ Stream and HostEvent (CPU stand-ins)
@pytest.fixture
def abort() -> AbortSignal:
    return AbortSignal(WAIT)


@pytest.fixture
def make_stream(abort: AbortSignal) -> Iterator:
    """Streams on ``abort``, stopped and joined after the test (other tests check that no thread is left)."""
    made: list[Stream] = []

    def make(name: str, jitter: float = 0.0, seed: int = 0) -> Stream:
        stream = Stream(f"test-{name}", abort, jitter=jitter, seed=seed)
        made.append(stream)
        return stream

    yield make
    abort.abort()
    for stream in made:
        stream.stop()
    for stream in made:
        assert stream.join(time.monotonic() + WAIT) is None


def test_a_recorded_event_is_set_only_after_the_operations_before_it(abort, make_stream):
    stream = make_stream("one")
    gate = threading.Event()
    log: list[str] = []
    stream.submit(lambda: log.append("first") if gate.wait(WAIT) else None)
    reached = stream.record("after first")
    assert not reached.is_set()  # the first operation cannot return before the gate opens
    gate.set()
    reached.wait(abort)
    assert log == ["first"]
    assert reached.name == "after first (stream test-one)"


def test_an_operation_waiting_on_another_streams_event_runs_after_it(abort, make_stream):
    producer, consumer = make_stream("producer"), make_stream("consumer")
    gate, consumer_done = threading.Event(), threading.Event()
    log: list[str] = []

    def produce() -> None:
        gate.wait(WAIT)
        log.append("produced")

    def consume() -> None:
        log.append("consumed after " + ",".join(log))
        consumer_done.set()

    producer.submit(produce)
    consumer.wait_event(producer.record("produced"))
    consumer.submit(consume)
    # without the wait the consumer would run now, while the producer is held at the gate
    consumer_done.wait(0.2)
    gate.set()
    assert consumer_done.wait(WAIT)
    assert log == ["produced", "consumed after produced"]


def test_a_chain_of_waits_over_jittered_streams_keeps_its_order(abort, make_stream):
    streams = [make_stream(f"jitter{index}", jitter=0.002, seed=index) for index in range(3)]
    log: list[int] = []
    previous: HostEvent | None = None
    for step in range(30):
        stream = streams[step % 3]
        stream.wait_event(previous)
        stream.submit(lambda step=step: log.append(step))
        previous = stream.record(f"step {step}")
    assert previous is not None
    previous.wait(abort)
    assert log == list(range(30))


def test_a_failing_operation_fails_the_engine_and_the_stream_runs_nothing_after_it(abort, make_stream):
    stream = make_stream("failing")
    log: list[str] = []
    error = OSError("copy failed")

    def fail() -> None:
        raise error

    stream.submit(fail)
    stream.submit(lambda: log.append("after"))
    never = stream.record("after the failure")
    with pytest.raises(EngineAborted):
        never.wait(abort)
    assert abort.error is error
    assert log == [] and not never.is_set()


# ------------------------------------------------------------------ replicas
class Inner(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(2, 3)
        self.register_buffer("count", torch.zeros(()))
        self.scale = 1.0


class Layer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inner = Inner()
        self.again = self.inner  # one submodule at two names
        self.norm = nn.LayerNorm(3)


class CachingLayer(nn.Module):
    roundpipe_transient = ("cache",)

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(2, 2)
        self.cache = None


def test_a_replica_shares_tensors_and_hooks_but_has_its_own_tables_and_flags():
    host = Layer()
    copy = replica.make_replica(host)
    assert copy is not host and copy.inner is not host.inner and copy.norm is not host.norm
    assert copy.again is copy.inner  # the structure is kept
    assert copy.inner.linear.weight is host.inner.linear.weight  # shared until a job binds its own
    assert copy.inner.linear._parameters is not host.inner.linear._parameters
    copy.eval()
    assert host.training and host.inner.training and not copy.inner.training
    assert copy.inner.linear._forward_hooks is host.inner.linear._forward_hooks  # hooks registered later fire too


def binding_of(host: nn.Module) -> replica.Binding:
    return replica.Binding(host, Trunk([host]).states[0])


def test_bind_and_unbind_swap_the_replicas_tensors_and_leave_the_host_alone():
    host = Layer()
    state = Trunk([host]).states[0]
    assert [paths[0].module_path + "." + paths[0].name for paths in state.param_paths] == [
        "inner.linear.weight", "inner.linear.bias", "norm.weight", "norm.bias"]
    assert [[where.module_path for where in paths] for paths in state.buffer_paths] == [["inner", "again"]]
    binding = replica.Binding(host, state)
    copy = binding.replica
    params = [param.detach() + 1 for param in state.params]
    buffers = [torch.full((), 7.0)]
    binding.bind(params, buffers)
    assert copy.inner.linear.weight is params[0] and copy.norm.bias is params[3]
    assert copy.inner.count is buffers[0] and copy.again.count is buffers[0]
    assert host.inner.linear.weight is state.params[0] and host.inner.count is state.buffers[0]
    assert binding.rebound_buffers(state, buffers) == []
    copy.inner._buffers["count"] = torch.ones(())  # what `self.count = self.count + 1` does
    assert binding.rebound_buffers(state, buffers) == ["inner.count", "again.count"]  # one module, two names
    binding.unbind(state)
    assert copy.inner.linear.weight is state.params[0] and copy.inner.count is state.buffers[0]


def test_sync_attributes_gives_the_replica_the_hosts_attributes_and_written_attributes_finds_its_own_writes():
    host = Layer()
    binding = binding_of(host)
    copy = binding.replica
    assert [type(pair[0]) for pair in binding.pairs] == [Layer, Inner, nn.Linear, nn.LayerNorm]
    host.inner.scale = 0.5         # changed on the host after the replica was made
    host.label = "new"             # added
    del host.norm.eps              # deleted
    copy.eval()                    # the replica's own training flags are not synced
    snapshot = binding.sync_attributes()
    assert copy.inner.scale == 0.5 and copy.label == "new" and "eps" not in copy.norm.__dict__
    assert not copy.training and host.training
    assert replica.written_attributes(copy, snapshot) == []
    copy.label = host.label        # the same object written again is no write
    assert replica.written_attributes(copy, snapshot) == []

    copy.inner.calls = 1           # added in a forward
    copy.label = "changed"
    del copy.inner.scale
    assert replica.written_attributes(copy, snapshot) == ["label", "inner.calls", "inner.scale"]
    assert host.inner.scale == 0.5 and not hasattr(host.inner, "calls")


def test_attributes_a_layer_declares_transient_are_no_writes():
    binding = binding_of(CachingLayer())
    copy = binding.replica
    snapshot = binding.sync_attributes()
    copy.cache = torch.zeros(1)
    assert replica.written_attributes(copy, snapshot) == []
    copy.other = 1
    assert replica.written_attributes(copy, snapshot) == ["other"]


def test_set_training_flags_sets_each_module_in_modules_order():
    host = Layer()
    binding = binding_of(host)
    copy = binding.replica
    binding.set_training_flags((False, True, False, True))
    assert [module.training for module in copy.modules()] == [False, True, False, True]
    assert [type(module) for module in copy.modules()] == [Layer, Inner, nn.Linear, nn.LayerNorm]
    assert host.training


# ------------------------------------------------------------------ byte counts
def test_byte_counts():
    half = torch.zeros(3, 4, dtype=torch.float16)
    assert nbytes_of(half) == 24
    assert nbytes_of(half[0]) == 8            # a view counts its own elements, not the whole storage
    assert tensors_nbytes([half, half]) == 48  # each time it appears
    assert tensors_nbytes([]) == 0
    assert tree_nbytes({"a": half, "b": [torch.zeros(2, dtype=torch.float64), "text", None]}) == 40
    counters = DeviceCounters()
    counters.uploaded_param_bytes += 100     # the parameter stream's count
    counters.uploaded_activation_bytes += 24  # the activation stream's count
    assert counters.uploaded_bytes == 124


def test_the_layer_input_convention():
    output = torch.ones(2)
    layer_input = as_layer_input(output)
    assert layer_input == ((output,), {})
    assert single_argument(layer_input) is output


# ------------------------------------------------------------------ tree walks
@dataclasses.dataclass
class _Output:
    logits: torch.Tensor
    extra: tuple = ()


def test_tree_walks_agree_with_pytree_and_open_dataclasses():
    a, b = torch.zeros(2), torch.ones(3)
    parameter = nn.Parameter(torch.ones(1))
    # without a dataclass the leaves and the spec are exactly ``_pytree``'s, lone tensors and flat tuples and lists
    # included
    for tree in (a, parameter, (a, b), [a, b, parameter], (a, None), [a, 1.5], {"x": a, "y": (b, [a])}, (),
                 (a, (b,))):
        leaves, spec = tree_flatten(tree)
        reference_leaves, reference_spec = pytree.tree_flatten(tree)
        assert spec == reference_spec and len(leaves) == len(reference_leaves)
        assert all(x is y for x, y in zip(leaves, reference_leaves, strict=True))
        rebuilt = tree_unflatten(leaves, spec)
        assert type(rebuilt) is type(tree) and pytree.tree_flatten(rebuilt)[1] == reference_spec
        mapped = tree_map(lambda leaf: leaf + 1 if isinstance(leaf, torch.Tensor) else leaf, tree)
        assert all(torch.equal(x, y + 1) if isinstance(y, torch.Tensor) else x == y
                   for x, y in zip(pytree.tree_leaves(mapped), reference_leaves, strict=True))
    # a dataclass is opened into its init fields and rebuilt
    output = _Output(a, (b, 2))
    leaves, spec = tree_flatten(output)
    assert leaves[0] is a and leaves[1] is b and leaves[2] == 2
    rebuilt = tree_unflatten(leaves, spec)
    assert type(rebuilt) is _Output and rebuilt.logits is a and rebuilt.extra[0] is b and rebuilt.extra[1] == 2


class _Pair(collections.namedtuple("_Pair", "left right")):
    pass


def test_the_plain_tree_walk_gives_pytrees_leaves_and_containers():
    # tree_leaves and tree_map walk plain tuples, lists and dicts themselves and leave anything else to _pytree:
    # against _pytree itself, every mix of the two gives the same leaves, in the same order, the same containers
    a, b = torch.zeros(2), torch.ones(3)
    parameter = nn.Parameter(torch.ones(1))
    trees = [
        a, None, 3, "text", True, 2.5, (), [], {},
        ((a,), {}), {"z": a, "a": b, "m": None},  # a dict's leaves in insertion order, not sorted
        [a, (b, [parameter, {"k": 1}]), "s"],
        (a, _Pair(b, [a])), {"p": _Pair(a, None)},  # a namedtuple inside a plain tree: the general path
        collections.OrderedDict(y=a, x=b), [collections.OrderedDict(y=a), (b,)],
        (a, collections.defaultdict(list, {"d": [b]})),
    ]
    for tree in trees:
        reference_leaves, reference_spec = pytree.tree_flatten(tree)
        leaves = tree_leaves(tree)
        assert len(leaves) == len(reference_leaves)
        assert all(x is y for x, y in zip(leaves, reference_leaves, strict=True)), tree
        mapped = tree_map(lambda leaf: ("seen", leaf), tree)
        mapped_leaves, mapped_spec = pytree.tree_flatten(mapped, is_leaf=lambda node: type(node) is tuple
                                                         and len(node) == 2 and node[0] == "seen")
        assert mapped_spec == reference_spec, tree  # the same container types, keys and order
        assert all(x == ("seen", y) if not isinstance(y, torch.Tensor) else x[1] is y
                   for x, y in zip(mapped_leaves, reference_leaves, strict=True))
