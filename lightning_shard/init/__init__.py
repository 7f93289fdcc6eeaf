"""Initialisation of a model built on the meta device: record its construction, plan and replay it shard by shard,
verify that nothing was left unwritten, materialise."""
