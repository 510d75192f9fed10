"""How many CPU threads torch's intra-op pool may use without oversubscribing the machine.

torch sizes its pool from the host's cores; in a container limited by a CFS quota, or next to
other jobs, that many spinning threads fight each other for fewer CPUs. On this project's
2-core machine the tiny model's step p50 was 52 ms with torch's 2 threads and 50-54 ms with
one when the machine was idle, but 0.07-4.5 s (mean 1.6-8.1 s) with 2 threads against
52-195 ms (mean 0.12-0.39 s) with one while other jobs kept it busy (load average 5-8).
So the default is the physical cores this process may run on (its CPU affinity counted once
per core, SMT siblings together, bounded by the cgroup CPU quota) less the cores other
processes keep busy (the 1-minute load average, scaled to this process's share of the
machine), and at least 1.
"""
from __future__ import annotations

import math
import os
from pathlib import Path


def parse_cpu_max(text: str) -> float | None:
    """CPUs allowed by a cgroup v2 ``cpu.max`` (``"QUOTA PERIOD"`` or ``"max PERIOD"``); None: unlimited."""
    fields = text.split()
    if len(fields) != 2 or fields[0] == "max":
        return None
    try:
        quota, period = int(fields[0]), int(fields[1])
    except ValueError:
        return None
    return quota / period if quota > 0 and period > 0 else None


def cgroup_cpu_limit(root: Path = Path("/sys/fs/cgroup")) -> float | None:
    """CPUs the cgroup of this process may use (v2 ``cpu.max``, else v1 CFS quota); None: no limit."""
    try:
        return parse_cpu_max((root / "cpu.max").read_text())
    except OSError:
        pass
    try:
        quota = int((root / "cpu" / "cpu.cfs_quota_us").read_text())
        period = int((root / "cpu" / "cpu.cfs_period_us").read_text())
    except (OSError, ValueError):
        return None
    return quota / period if quota > 0 and period > 0 else None


def physical_cores(cpus, sys_cpu: Path = Path("/sys/devices/system/cpu")) -> int:
    """Distinct physical cores among logical ``cpus`` (package and core id from sysfs; a CPU
    without topology counts as a core of its own)."""
    cores = set()
    for cpu in cpus:
        topology = sys_cpu / f"cpu{cpu}" / "topology"
        try:
            cores.add(((topology / "physical_package_id").read_text().strip(),
                       (topology / "core_id").read_text().strip()))
        except OSError:
            cores.add(("cpu", str(cpu)))
    return len(cores)


def usable_cores(sys_cpu: Path = Path("/sys/devices/system/cpu"),
                 cgroup: Path = Path("/sys/fs/cgroup")) -> int:
    """Physical cores in this process's affinity mask, capped by the cgroup quota (rounded down:
    a thread beyond the quota only gets throttled); at least 1."""
    cpus = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else range(os.cpu_count() or 1)
    cores = physical_cores(cpus, sys_cpu)
    limit = cgroup_cpu_limit(cgroup)
    if limit is not None:
        cores = min(cores, math.floor(limit))
    return max(1, cores)


def free_cores(cores: int, load: float, cpus: int) -> int:
    """Of ``cores`` usable physical cores, those not kept busy by other processes: the
    1-minute ``load`` average of a machine of ``cpus`` logical CPUs, scaled to this process's
    share of them (other jobs spread over all of them), rounded to the nearest core and taken
    off; at least 1."""
    busy = round(max(load, 0.0) * cores / max(cpus, 1))
    return max(1, cores - busy)


def default_threads() -> int:
    """The intra-op thread count that does not oversubscribe this machine right now."""
    try:
        load = os.getloadavg()[0]
    except OSError:  # no load average on this platform: assume an idle machine
        load = 0.0
    return free_cores(usable_cores(), load, os.cpu_count() or 1)


def set_torch_threads(threads: int | None) -> int:
    """Set torch's intra-op threads to ``threads``, or by default cap the current count at
    :func:`default_threads` (never raising it: a smaller count set by OMP_NUM_THREADS or the
    caller stays). Returns the count in effect."""
    import torch

    if threads is not None and threads < 1:
        raise ValueError(f"threads must be >= 1, got {threads}")
    torch.set_num_threads(threads if threads is not None else min(torch.get_num_threads(), default_threads()))
    return torch.get_num_threads()


def child_thread_env(threads: int | None, environ) -> dict[str, str]:
    """Environment entries giving the torch of a child process (the Triton Python stub)
    ``threads`` intra-op threads through OMP_NUM_THREADS, which torch reads when it starts.
    By default :func:`default_threads`, unless ``environ`` sets OMP_NUM_THREADS already (the
    user's own choice stays)."""
    if threads is None:
        if environ.get("OMP_NUM_THREADS"):
            return {}
        threads = default_threads()
    elif threads < 1:
        raise ValueError(f"threads must be >= 1, got {threads}")
    return {"OMP_NUM_THREADS": str(threads)}
