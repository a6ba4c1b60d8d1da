"""Offline and diagnostic commands: bench, doctor, prepare, live figures and report."""
