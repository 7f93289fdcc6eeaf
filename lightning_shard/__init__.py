"""lightning-shard."""
