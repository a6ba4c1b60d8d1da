"""Pure decisions of the consumer: epoch plan, leases, ring, peers, rejects (no sockets, no clocks).

Nothing is re-exported: import the module you need (``melfeed.consumer.flow.<module>``).
"""

__all__: list[str] = []
