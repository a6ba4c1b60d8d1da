"""The contract both sides speak: protocol messages, bucket shapes, batch byte layout, CURVE keys.

Nothing is re-exported: import the module you need (``melfeed.shared.wire.<module>``).
"""

__all__: list[str] = []
