"""melfeed placeholder."""
__all__: list[str] = []
