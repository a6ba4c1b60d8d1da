"""melfeed shared package."""

__all__: list[str] = []
