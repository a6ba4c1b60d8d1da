"""The built-in training loop, the compiled step per bucket, and the reference model.

Nothing is re-exported: import the module you need (``melfeed.consumer.train.<module>``).
"""

__all__: list[str] = []
