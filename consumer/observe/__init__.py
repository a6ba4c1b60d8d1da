"""Live figures of a running consumer: snapshots, control socket, status, Prometheus, NVML, report."""

__all__: list[str] = []
