"""What is on disk: manifest, ``.npy`` headers, index, verify-cache, text vocabulary, demo data.

Nothing is re-exported: import the module you need (``melfeed.shared.cache.<module>``).
"""

__all__: list[str] = []
