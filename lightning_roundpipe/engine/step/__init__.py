"""The host optimizer step, one module per part.

* ``caller.py``: :class:`~.caller.StepQueue`, the caller's-thread half of a step (what the step is);
* ``queued.py``: :class:`~.queued.QueuedStep`, the optimizer-thread half (one step, group by group);
* ``thread.py``: the optimizer thread (:class:`~.thread.HostOptimizer`) and the stand-ins it steps;
* ``window.py``: :class:`~.window.GradWindow`, a step's gradients in a fixed order, never in ``param.grad``;
* ``summing.py``: :class:`~.summing.GradSummer`, the threads that sum the jobs' gradients into the window;
* ``groups.py``: the policy, how a step is cut into groups and when an optimizer may be cut;
* ``kernels.py``: torch's fused CPU kernels where they are safe, and the step's measured cost;
* ``eight_bit.py``: bitsandbytes' 8-bit optimizers through the stand-ins (their per-parameter settings), and
  the bytes their state takes;
* ``rounding.py``: ``stochastic_rounding``, bfloat16 parameters stepped in float32 and rounded back
  stochastically;
* ``disk_tier.py``: :class:`~.disk_tier.DiskTier`, the optimizer state in files (``offload="optimizer"``), read
  ahead of each group and written behind it by a thread of its own.

The module's parameters are the master weights. Devices never read them while a step may be writing:

* ``sync``: every upload after a step waits for that step to have updated the parameters it uploads, so
  results are exactly those of plain training (with ``host_optimizer="fused"``, up to the fused kernels'
  float rounding). The step itself runs off the main thread, cut by stage where the optimizer allows
  (``groups.py``): each part as soon as its gradients are final, so most of it overlaps the backward.
* ``async`` (the paper's schedule): devices read a *published* copy of the weights
  (``transport.UploadSources``, which also holds the low-precision copies devices read under mixed
  precision). Step k first publishes the masters (which hold W(k-1)) once every upload of iteration k
  has read the old copy, then computes W(k) = step(W(k-1), g(k)), both part by part. Iteration k+1 waits
  only for the publish of what it uploads, so it runs on W(k-1) while step k runs: exactly one step stale,
  whatever the timing.
"""
