"""Live figures of a running consumer: snapshots, control socket, status, Prometheus, NVML, report.

Nothing is re-exported: import the module you need (``melfeed.consumer.observe.<module>``).
"""

__all__: list[str] = []
