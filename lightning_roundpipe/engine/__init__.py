"""The engine: executes a plan on a ring of devices with worker threads and a host optimizer thread.

Plain PyTorch, no Lightning: :class:`~lightning_roundpipe.engine.engine.RoundPipeEngine` is usable alone.
Imports :mod:`lightning_roundpipe.planning` and :mod:`lightning_roundpipe.observe`, never the adapter.

The main thread plans a call, splits it into microbatches and hands stage jobs to devices in ring
order (job j to device j mod N, the counter continuing across calls and iterations). Each device
has a worker thread that turns a job into stream operations: upload the stage's parameters
(prefetched while the previous job computes), then for every microbatch upload its input, compute,
download the output. Data moves between devices only through the host. A device holds at most two
stages' parameters: the upload of its k-th job waits until its (k-2)-th job has released its own.

Job kinds (see ``planning/schedule.py``)::

    forward   run layers without autograd; keep the inputs backward stages will need (checkpoints)
    fused     run the deepest layers, the loss and the backward per microbatch; never recomputed
    backward  recompute the stage's layers from their checkpoint (ahead of the output gradient), then
              back-propagate

A transparent call (the engine called like a module, its backward through autograd) runs its deepest
layers as one more forward stage; on a one-device ring, where its backward job runs on the same device,
that stage keeps its autograd graphs and stage copy on the device until the backward uses them, when they
fit (``stage.HeldGraph``), so nothing of it is recomputed, as for a training call's fused stage.

A training call (``forward_backward``) may dispatch its microbatches in rounds (``round_size``): each
round is the whole chain of jobs over its share of the batch, so backward starts before the last
microbatch has run forward.

Gradients of parameters accumulate on the device over the job's microbatches, then are added on
the host into the optimizer step's :class:`~lightning_roundpipe.engine.step.window.GradWindow`, in an order
fixed at dispatch, so that results do not depend on which job finishes first.
"""
