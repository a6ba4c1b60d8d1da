"""``run_pipeline.py bench``: melfeed against tuned tf.data, the naive loader and tf.data service."""

__all__: list[str] = []
