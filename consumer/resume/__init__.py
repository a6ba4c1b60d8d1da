"""What survives a restart: the state directory, atomic checkpoints and the applied-batch audit log."""

__all__: list[str] = []
