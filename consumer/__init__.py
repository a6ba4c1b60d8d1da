"""melfeed consumer package."""

__all__: list[str] = []
