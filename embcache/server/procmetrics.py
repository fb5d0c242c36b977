"""What an operator expects of any server's /metrics: the process, the build, the memory limit.

- ``process_*`` (prometheus_client's process collector: resident memory, CPU seconds, open file
  descriptors, start time), since memory is this server's main operational risk;
- ``embcache_build_info{version}`` = 1;
- ``embcache_memory_limit_bytes``: the container's memory limit (cgroup v2 ``memory.max`` or v1
  ``memory.limit_in_bytes``), absent when there is none, so that
  ``process_resident_memory_bytes / embcache_memory_limit_bytes`` says how close a pod is to
  being OOM-killed.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from ..config import memory_limit_bytes

__all__ = ["memory_limit_bytes", "register_process_metrics"]

class _Collector:
    def __init__(self, version: str) -> None:
        self._version = version
        self._limit = memory_limit_bytes()

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import GaugeMetricFamily, InfoMetricFamily

        yield InfoMetricFamily("embcache_build", "The embcache version this server runs",
                               value={"version": self._version})
        if self._limit is not None:
            yield GaugeMetricFamily("embcache_memory_limit_bytes", "Memory limit of the server's container (cgroup)",
                                    value=self._limit)


def register_process_metrics(registry: Any, version: str) -> None:
    """Add the process, build and memory-limit metrics to ``registry``."""
    from prometheus_client import ProcessCollector

    ProcessCollector(registry=registry)
    registry.register(_Collector(version))
