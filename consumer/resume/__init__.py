"""What survives a restart: the state directory, atomic checkpoints and the applied-batch audit log.

Nothing is re-exported: import the module you need (``melfeed.consumer.resume.<module>``).
"""

__all__: list[str] = []
