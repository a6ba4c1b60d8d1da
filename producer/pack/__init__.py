"""The producer's reader of a packed cache (``shared/cache/pack_format.py``): one ``preadv`` per row."""
