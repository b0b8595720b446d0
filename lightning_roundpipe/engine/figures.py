"""The figures the engine reports about its ring: ``RoundPipeEngine.pipeline_metrics`` and the CUDA allocator's.

:class:`PipelineFigures` turns the devices' running counters (``device.py``) and the optimizer thread's busy time
into figures over the span since the previous report; :func:`cuda_memory_figures` sets the caching allocator's
peaks per GPU beside what the engine accounted there.
"""

from __future__ import annotations

import torch

from lightning_roundpipe.engine.device import Device
from lightning_roundpipe.engine.step.disk_tier import DiskTier
from lightning_roundpipe.engine.step.thread import HostOptimizer
from lightning_roundpipe.observe.trace import Timeline

_TOTALS = ("compute", "uploaded", "optimizer", "exposed", "download", "disk_read", "disk_written", "disk_wait")


class PipelineFigures:
    """Reports figures since the previous report (the first counts from the ring's start, when this is made).
    ``disk``: the disk tier (``offload``), whose figures are added."""

    def __init__(self, devices: list[Device], optimizer: HostOptimizer, timeline: Timeline,
                 disk: DiskTier | None = None) -> None:
        self.devices = devices
        self.optimizer = optimizer
        self.timeline = timeline
        self.disk = disk
        self._mark: tuple[float, dict[str, float]] = (timeline.now(), self._totals())  # the tier wrote at setup

    def _totals(self) -> dict[str, float]:
        devices = self.devices
        return {
            "compute": sum(d.counters.compute_seconds for d in devices),
            "uploaded": float(sum(d.counters.uploaded_bytes for d in devices)),
            "optimizer": self.optimizer.busy_seconds,
            "exposed": sum(d.counters.weight_wait_seconds for d in devices),
            "download": sum(d.counters.gradient_download_seconds for d in devices),
            "disk_read": float(self.disk.bytes_read) if self.disk is not None else 0.0,
            "disk_written": float(self.disk.bytes_written) if self.disk is not None else 0.0,
            "disk_wait": self.disk.read_wait_seconds if self.disk is not None else 0.0,
        }

    def report(self) -> dict[str, float]:
        """The figures over the span since the previous report:

        ``bubble_ratio``: share of device time not spent computing over that wall time; ``uploaded_bytes``:
        host-to-device traffic; ``optimizer_seconds``: host step time; ``optimizer_exposed_seconds``: device
        time spent waiting for a step's weights (the part of the step the pipeline did not hide);
        ``gradient_download_seconds``: download-thread time bringing jobs' gradients to the host (all devices;
        off the compute stream, but it delays the release of a stage's memory; their sum runs after the release,
        on the summing threads);
        ``peak_device_bytes``: the largest resident bytes on any device so far (accounted: stages, stage-boundary
        activations, what the compute keeps for backward and, on GPUs, the workspace reserve).

        With the disk tier (``offload``): ``disk_read_bytes`` and ``disk_written_bytes``, what it read and wrote;
        ``disk_wait_seconds``, the time the host step waited for its reads; ``disk_bandwidth_to_hide``, in bytes per
        second, what a disk must move for that I/O to take no longer than the span without those waits (the pace
        at which the tier would cost nothing; compare it with the disk's own).

        Compute time is device time (``timing.py``), counted when a job finishes: a job still running is counted
        in a later report. On CUDA devices the allocator's own figures per GPU come next to the accounted peak
        (:func:`cuda_memory_figures`).
        """
        now, totals = self.timeline.now(), self._totals()
        last_time, last = self._mark
        self._mark = (now, totals)
        num_devices = len(self.devices)
        span = (now - last_time) * num_devices
        busy = totals["compute"] - last["compute"]
        disk = {}
        if self.disk is not None:
            moved = (totals["disk_read"] - last["disk_read"]) + (totals["disk_written"] - last["disk_written"])
            waited = totals["disk_wait"] - last["disk_wait"]
            unwaited = now - last_time - waited
            disk = {"disk_read_bytes": totals["disk_read"] - last["disk_read"],
                    "disk_written_bytes": totals["disk_written"] - last["disk_written"],
                    "disk_wait_seconds": waited,
                    "disk_bandwidth_to_hide": moved / unwaited if unwaited > 0 else 0.0}
        return {
            "bubble_ratio": max(0.0, 1.0 - busy / span) if span > 0 else 0.0,
            "uploaded_bytes": totals["uploaded"] - last["uploaded"],
            "optimizer_seconds": totals["optimizer"] - last["optimizer"],
            "optimizer_exposed_seconds": (totals["exposed"] - last["exposed"]) / num_devices,
            "gradient_download_seconds": totals["download"] - last["download"],
            "peak_device_bytes": float(max(device.residency.peak for device in self.devices)),
            **disk,
            **cuda_memory_figures(self.devices),
        }


def cuda_memory_figures(devices: list[Device]) -> dict[str, float]:
    """Per GPU of the ring ``devices`` (``cuda<i>_...``), the caching allocator's peaks next to what the engine
    accounted there: ``max_reserved_bytes``, what the allocator held from the driver (the figure an out-of-memory
    error is about); ``max_allocated_bytes``, what tensors used; ``accounted_peak_bytes``, the sum of the accounted
    peaks of the ring members on that GPU (they need not peak at once, so it bounds their joint peak); and
    ``alloc_retries``, how often the allocator freed its cache and retried an allocation (a device-wide
    synchronization: a silent slowdown near the limit). Peaks count from the process's start or the last
    ``torch.cuda.reset_peak_memory_stats``. Empty without CUDA devices."""
    figures: dict[str, float] = {}
    for index in sorted({device.torch_device.index for device in devices if device.is_cuda}):
        members = [device for device in devices if device.is_cuda and device.torch_device.index == index]
        figures[f"cuda{index}_max_reserved_bytes"] = float(torch.cuda.max_memory_reserved(index))
        figures[f"cuda{index}_max_allocated_bytes"] = float(torch.cuda.max_memory_allocated(index))
        figures[f"cuda{index}_accounted_peak_bytes"] = float(sum(member.residency.peak for member in members))
        figures[f"cuda{index}_alloc_retries"] = float(torch.cuda.memory_stats(index).get("num_alloc_retries", 0))
    return figures
