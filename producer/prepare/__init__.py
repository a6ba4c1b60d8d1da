"""Offline ``run_pipeline.py prepare``: LJSpeech-format wav corpus -> log-mel cache."""

__all__: list[str] = []
