"""Offline ``melfeed prepare``: LJSpeech-format wav corpus -> log-mel cache.

Nothing is re-exported: import the module you need (``melfeed.producer.prepare.<module>``).
"""

__all__: list[str] = []
