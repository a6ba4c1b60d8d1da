"""Clients of the consumer library in other frameworks: a JAX hand-off for the stager and its measurement.

``jax_feed.py``: ``JaxStageAdapter`` (slot -> device with ``jax.device_put``, the slot freed when the copy
completed, or held until the step completed where JAX aliases host memory) and a small JAX training
step. ``jax_bench.py``: ``python -m melfeed.consumer.clients.jax_bench``, feed efficiency, copy overlap and
NVML utilisation of that step fed by melfeed. Nothing here imports TensorFlow; JAX is imported by these
modules only (the ``jax`` extra).
"""
