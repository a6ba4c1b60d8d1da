"""The built-in training loop, the compiled step per bucket, and the reference model."""

__all__: list[str] = []
