"""The host optimizer step, one module per part.

* ``caller.py``: :class:`~.caller.StepQueue`, the caller's-thread half of a step (what the step is);
* ``queued.py``: :class:`~.queued.QueuedStep`, the optimizer-thread half (one step, group by group);
* ``thread.py``: the gradient window, and the optimizer thread (:class:`~.thread.HostOptimizer`);
* ``groups.py``: the policy, how a step is cut into groups and when an optimizer may be cut;
* ``kernels.py``: torch's fused CPU kernels where they are safe, and the step's measured cost.
"""
