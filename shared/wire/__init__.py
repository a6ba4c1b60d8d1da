"""The contract both sides speak: protocol messages, bucket shapes, batch byte layout, CURVE keys."""

__all__: list[str] = []
