"""``melfeed bench``: melfeed against tuned tf.data, the naive loader and tf.data service.

Nothing is re-exported: import the module you need (``melfeed.consumer.bench.<module>``).
"""

__all__: list[str] = []
