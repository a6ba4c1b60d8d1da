"""What is on disk: manifest, ``.npy`` headers, index, verify-cache, text vocabulary, demo data."""

__all__: list[str] = []
