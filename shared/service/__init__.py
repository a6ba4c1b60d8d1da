"""Process lifecycle shared by both sides: signals, sd_notify, child processes, unit rendering, CLI.

Nothing is re-exported: import the module you need (``melfeed.shared.service.<module>``).
"""

__all__: list[str] = []
