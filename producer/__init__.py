"""melfeed producer package."""

__all__: list[str] = []
