"""Initialisation of a model built on the meta device, as one pipeline: record -> plan -> replay -> verify, run by
materialise. The rule it implements (weights equal an eager build on one process, at any world size) is in
:mod:`~lightning_shard.init.materialize`. What flows: a ``ConstructionLog`` per recorded build -> an ``InitPlan`` ->
full-size CPU buffers, written into each rank's shards -> a check of every allocated tensor.

Record (from ``meta_construction()`` / ``init_module(empty_init=True)`` until setup):

- :mod:`~lightning_shard.init.meta_window`: when the recording runs - from the meta-device block until setup.
- :mod:`~lightning_shard.init.construction`: the recorder (:class:`~lightning_shard.init.construction.Recording`),
  made of :mod:`~lightning_shard.init.op_recorder` (the ATen ops on meta tensors),
  :mod:`~lightning_shard.init.python_calls` (the ``nn.init`` calls and ``get/set_rng_state`` no op shows) and
  :mod:`~lightning_shard.init.rng_watch` (the generator's state changes); :mod:`~lightning_shard.init.recorded_inputs`
  keeps the real tensors an op read, and :mod:`~lightning_shard.init.skipped_draws` the draws a meta build owes the
  live generators.
- gives: a :class:`~lightning_shard.init.construction_log.ConstructionLog` on each module of the model
  (:mod:`~lightning_shard.init.construction_log`: ops, RNG events, registrations, where each meta tensor is held).

Plan (at setup, after sharding, before anything is allocated):

- :mod:`~lightning_shard.init.init_plan`: takes the sharded meta model, its logs and the models its libraries claim
  (:mod:`~lightning_shard.init.libraries`, the per-library init rule); gives the ops in program order, those the
  weights depend on (:mod:`~lightning_shard.init.init_skip`: none that a checkpoint load right after setup writes), and
  the modules that fall back to ``reset_parameters()``; refuses, naming the tensors, what it cannot initialise.

Replay (driven by the plan, on the allocated tensors):

- :mod:`~lightning_shard.init.replay`: takes the planned ops and rank 0's random stream
  (:mod:`~lightning_shard.init.rng_timeline`); runs them on full-size CPU buffers and writes each rank its shard
  (:mod:`~lightning_shard.init.shard_init`); a library's init or a ``reset_parameters()`` runs on full-size stand-ins
  (:mod:`~lightning_shard.init.full_size`). Draws whose values nothing keeps are jumped over
  (:mod:`~lightning_shard.init.draw_counts`, :mod:`~lightning_shard.init.stream_jump`), which lets
  :mod:`~lightning_shard.init.split_replay` give each rank a share of the tensors to replay and send the others
  their shards.

Verify (after the replay, or after the load for the tensors left to it):

- :mod:`~lightning_shard.init.verify`: takes the allocated tensors and what the replay found; raises, naming them, for
  any that nothing wrote (the sentinel of :mod:`~lightning_shard.init.unset`); :mod:`~lightning_shard.init.names`
  words the errors.

Materialise (the entry points, one at each end):

- :mod:`~lightning_shard.init.materialize`: ``meta_construction()`` starts the record; ``materialize_sharded_module()``
  allocates the meta tensors (each holding the sentinel) and runs plan -> replay -> verify.

Carried through setup (noted before sharding, restored after, by :mod:`lightning_shard.plan.parallelize`; the
allocation keeps the ties too): :mod:`~lightning_shard.init.ties` (every tie of the model as built is a tie after
setup) and :mod:`~lightning_shard.init.attached` (the hooks and attributes on parameters and buffers).
"""
