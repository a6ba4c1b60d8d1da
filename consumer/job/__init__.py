"""A multi-worker job: the strategy, the agreement on a checkpoint, losing a peer (consumer/README.md, "Ranks")."""
