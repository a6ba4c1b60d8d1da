"""What producer and consumer share: ``errors``, ``metrics``, and the subpackages ``config/`` (the settings),
``wire/`` (the contract both sides speak), ``cache/`` (what is on disk) and ``service/`` (process lifecycle).

Imports flow producer -> shared <- consumer; nothing here imports either side. Nothing is
re-exported: import the module you need (``from melfeed.shared.config.loader import load_config``).
"""

__all__: list[str] = []
