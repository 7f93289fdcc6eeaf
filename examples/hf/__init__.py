"""Fine-tuning a Hugging Face causal LM with the sharded strategy (LightningCLI)."""
