"""Pure decisions of the consumer: epoch plan, leases, ring, peers, rejects (no sockets, no clocks)."""

__all__: list[str] = []
