"""Process lifecycle shared by both sides: signals, sd_notify, child processes, unit rendering, CLI."""

__all__: list[str] = []
