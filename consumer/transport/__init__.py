"""The consumer's sockets: the receiver thread, BATCH intake into ring slots, shared-memory slot files.

Nothing is re-exported: import the module you need (``melfeed.consumer.transport.<module>``).
"""

__all__: list[str] = []
