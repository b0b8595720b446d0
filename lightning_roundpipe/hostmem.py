"""What the machine allows now: available memory, the cgroup limit, the locked-memory limit.

Read from ``/proc/meminfo`` (``MemAvailable``), this process's cgroup (v2 ``memory.max`` minus
``memory.current``, v1 ``memory.limit_in_bytes`` minus ``memory.usage_in_bytes``, with reclaimable
inactive file cache not counted as used) and ``RLIMIT_MEMLOCK``. Standard library only (``format_bytes`` comes from
:mod:`lightning_roundpipe.planning.device_budget`, shared with the engine); every reader takes
its paths as arguments so that tests can hand it a fake ``/sys/fs/cgroup``. The pre-flight memory plan
(:mod:`lightning_roundpipe.preflight`) compares its figures with these.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from lightning_roundpipe.planning.device_budget import format_bytes

__all__ = [
    "CgroupMemory", "HostLimits", "format_bytes", "read_cgroup_memory", "read_cgroup_v1", "read_cgroup_v2",
    "read_host_limits", "read_mem_available", "read_memlock",
]

_UNLIMITED = 2**60  # cgroup v1 writes "unlimited" as a page-aligned LONG_MAX (9223372036854771712)


@dataclass(frozen=True)
class CgroupMemory:
    """A cgroup's memory limit and usage, in bytes. ``limit=None``: no limit (``max``)."""

    version: int
    limit: int | None
    usage: int
    reclaimable: int = 0  # inactive file cache: counted in usage, dropped by the kernel before an OOM
    path: str = ""

    @property
    def available(self) -> int | None:
        if self.limit is None:
            return None
        return max(0, self.limit - max(0, self.usage - self.reclaimable))

    def describe(self) -> str:
        name = "memory.max" if self.version == 2 else "memory.limit_in_bytes"
        if self.limit is None:
            return f"cgroup v{self.version}: no limit"
        return (f"cgroup v{self.version} {name} {format_bytes(self.limit)} - used "
                f"{format_bytes(max(0, self.usage - self.reclaimable))}")


@dataclass(frozen=True)
class HostLimits:
    """What the machine allows now. ``None`` fields are unknown or unlimited."""

    mem_available: int | None = None  # /proc/meminfo MemAvailable
    cgroup: CgroupMemory | None = None
    memlock: int | None = None        # RLIMIT_MEMLOCK soft limit; None: unlimited or unknown

    @property
    def available(self) -> int | None:
        """The smaller of ``MemAvailable`` and the cgroup's room; ``None`` if neither is known."""
        known = [v for v in (self.mem_available, self.cgroup.available if self.cgroup else None) if v is not None]
        return min(known) if known else None

    @property
    def cgroup_binds(self) -> bool:
        room = self.cgroup.available if self.cgroup is not None else None
        return room is not None and (self.mem_available is None or room < self.mem_available)

    def describe(self) -> str:
        parts = [f"MemAvailable {format_bytes(self.mem_available)}" if self.mem_available is not None
                 else "MemAvailable unknown"]
        parts.append(self.cgroup.describe() if self.cgroup is not None else "no cgroup memory limit found")
        return "; ".join(parts)


def _read_int(path: str) -> int | None:
    """An integer file (``max``/absent/unreadable: ``None``)."""
    try:
        with open(path) as file:
            text = file.read().strip()
    except OSError:
        return None
    if not text or text == "max":
        return None
    try:
        return int(text)
    except ValueError:
        return None


def _read_stat(path: str) -> dict[str, int]:
    stats: dict[str, int] = {}
    try:
        with open(path) as file:
            for line in file:
                key, _, value = line.partition(" ")
                if value.strip().isdigit():
                    stats[key] = int(value)
    except OSError:
        pass
    return stats


def read_mem_available(path: str = "/proc/meminfo") -> int | None:
    """``MemAvailable`` in bytes, or ``None`` when the file or the line is missing."""
    try:
        with open(path) as file:
            for line in file:
                if line.startswith("MemAvailable:"):
                    fields = line.split()
                    scale = 1024 if len(fields) > 2 and fields[2].lower() == "kb" else 1
                    return int(fields[1]) * scale
    except (OSError, ValueError, IndexError):
        return None
    return None


def read_cgroup_v2(directory: str) -> CgroupMemory | None:
    """One cgroup v2 directory: ``memory.max`` (``max``: no limit), ``memory.current``, and
    ``inactive_file`` from ``memory.stat``. ``None`` if ``memory.current`` is missing."""
    usage = _read_int(os.path.join(directory, "memory.current"))
    if usage is None:
        return None
    limit = _read_int(os.path.join(directory, "memory.max"))
    reclaimable = _read_stat(os.path.join(directory, "memory.stat")).get("inactive_file", 0)
    return CgroupMemory(2, limit, usage, reclaimable, directory)


def read_cgroup_v1(directory: str) -> CgroupMemory | None:
    """One cgroup v1 memory directory: ``memory.limit_in_bytes`` (or the smaller
    ``hierarchical_memory_limit`` of ``memory.stat``; about ``2**63`` means no limit),
    ``memory.usage_in_bytes`` and ``total_inactive_file``. ``None`` if the usage file is missing."""
    usage = _read_int(os.path.join(directory, "memory.usage_in_bytes"))
    if usage is None:
        return None
    stats = _read_stat(os.path.join(directory, "memory.stat"))
    limits = [v for v in (_read_int(os.path.join(directory, "memory.limit_in_bytes")),
                          stats.get("hierarchical_memory_limit")) if v is not None and v < _UNLIMITED]
    reclaimable = stats.get("total_inactive_file", stats.get("inactive_file", 0))
    return CgroupMemory(1, min(limits) if limits else None, usage, reclaimable, directory)


def _own_cgroup_paths(proc_cgroup: str) -> tuple[str | None, str | None]:
    """This process's (v2 path, v1 memory path) from ``/proc/self/cgroup``."""
    v2 = v1 = None
    try:
        with open(proc_cgroup) as file:
            for line in file:
                parts = line.strip().split(":", 2)
                if len(parts) != 3:
                    continue
                if parts[0] == "0" and parts[1] == "":
                    v2 = parts[2]
                elif "memory" in parts[1].split(","):
                    v1 = parts[2]
    except OSError:
        pass
    return v2, v1


def read_cgroup_memory(root: str = "/sys/fs/cgroup", proc_cgroup: str = "/proc/self/cgroup") -> CgroupMemory | None:
    """The tightest cgroup memory limit of this process, or ``None`` when no cgroup files are found.

    v2 (``root/cgroup.controllers`` or ``root/memory.current`` exists): this process's cgroup (from
    ``proc_cgroup``) and each ancestor up to ``root``; the limited one with the least room wins. v1:
    ``root/memory/<own path>``, or ``root/memory`` when that does not exist (a container's namespace
    root). A cgroup without a limit comes back with ``limit=None``."""
    v2_path, v1_path = _own_cgroup_paths(proc_cgroup)
    top = os.path.normpath(root)
    if os.path.exists(os.path.join(top, "cgroup.controllers")) or os.path.exists(os.path.join(top, "memory.current")):
        directory = os.path.normpath(os.path.join(top, (v2_path or "/").lstrip("/")))
        if not directory.startswith(top + os.sep) or not os.path.isdir(directory):
            directory = top
        entries = []
        while True:
            entry = read_cgroup_v2(directory)
            if entry is not None:
                entries.append(entry)
            if directory == top:
                break
            directory = os.path.dirname(directory)
        limited = [entry for entry in entries if entry.limit is not None]
        if limited:
            return min(limited, key=lambda entry: entry.available or 0)
        return entries[0] if entries else None
    base = os.path.join(top, "memory")
    directory = os.path.normpath(os.path.join(base, (v1_path or "/").lstrip("/")))
    if not os.path.exists(os.path.join(directory, "memory.usage_in_bytes")):
        directory = base
    return read_cgroup_v1(directory)


def read_memlock() -> int | None:
    """The soft ``RLIMIT_MEMLOCK`` in bytes; ``None`` if unlimited or unknown (no ``resource`` module)."""
    try:
        import resource
    except ImportError:  # not on POSIX
        return None
    soft, _ = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    return None if soft == resource.RLIM_INFINITY or soft < 0 else soft


def read_host_limits() -> HostLimits:
    """What this machine allows now. The strategy calls this at setup; tests replace it."""
    return HostLimits(read_mem_available(), read_cgroup_memory(), read_memlock())
