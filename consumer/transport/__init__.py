"""The consumer's sockets: the receiver thread, BATCH intake into ring slots, shared-memory slot files."""

__all__: list[str] = []
