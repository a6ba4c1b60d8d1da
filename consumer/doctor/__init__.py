"""``run_pipeline.py doctor``: measure every stage with the real code and name the bottleneck."""

__all__: list[str] = []
