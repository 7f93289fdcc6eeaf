"""The sharding plan: the settings (``ShardingConfig``), FSDP units, activation checkpointing, replicated parameters,
mixed precision, device placement, and ``parallelize_module`` which applies them to a model."""
