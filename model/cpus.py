"""The CPUs this process may use; no torch here, so that the supervisor can ask."""

from __future__ import annotations

import math
import os
from pathlib import Path


def available_cpus(cgroup: Path = Path("/sys/fs/cgroup/cpu.max")) -> int:
    """CPUs this process may use: its affinity, capped by a cgroup v2 CPU quota (a container's
    --cpus or a Kubernetes limit), which torch's own default (the host's cores) ignores."""
    cpus = len(os.sched_getaffinity(0))
    try:
        quota, period = cgroup.read_text().split()[:2]
    except (OSError, ValueError):
        return cpus
    if quota == "max":
        return cpus
    return max(1, min(cpus, math.ceil(int(quota) / int(period))))
