"""GPT-3 style language model example trained with lightning-shard."""
