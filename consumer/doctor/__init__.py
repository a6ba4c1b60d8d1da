"""``melfeed doctor``: measure every stage with the real code and name the bottleneck.

Nothing is re-exported: import the module you need (``melfeed.consumer.doctor.<module>``).
"""

__all__: list[str] = []
