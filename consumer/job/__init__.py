"""A multi-worker job: the strategy, the agreement on a checkpoint, losing a peer (docs/guide/several-hosts.md)."""
