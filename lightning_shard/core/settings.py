"""``StrategySettings``: every argument the Trainer and the Fabric strategies take, translated and checked once.

Both front-ends accept the same names: :class:`~lightning_shard.ShardingConfig`'s fields (what to shard and how),
the process-group and checkpoint settings below, and Lightning ``FSDPStrategy`` / FSDP1 spellings, which
:mod:`lightning_shard.plan.fsdp1_compat` translates or refuses. Every check runs when the strategy is built, before any
process starts.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields
from datetime import timedelta
from typing import Any, Literal, get_args

import torch
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout

from lightning_shard.plan.config import ShardingConfig
from lightning_shard.plan.fsdp1_compat import translate_fsdp_strategy_arguments
from lightning_shard.plan.precision import check_reduce_dtype

StartMethod = Literal["popen", "spawn", "fork", "forkserver"]


@dataclass(frozen=True)
class StrategySettings:
    """The sharding configuration plus what the strategies themselves use.

    Example:
        >>> settings = StrategySettings.from_arguments({"sharding_strategy": "full_shard", "state_dict_type": "full"})
        >>> settings.config.sharding_strategy, settings.start_method
        ('FULL_SHARD', 'popen')
    """

    config: ShardingConfig = ShardingConfig()
    reduce_dtype: torch.dtype | None = None
    async_save: bool = False
    preemption: bool = True
    process_group_backend: str | None = None
    timeout: timedelta | None = default_pg_timeout
    start_method: StartMethod = "popen"

    def __post_init__(self) -> None:
        if self.start_method not in get_args(StartMethod):
            raise ValueError(f"`start_method={self.start_method!r}` is not one of {get_args(StartMethod)}.")
        if self.timeout is not None and not isinstance(self.timeout, timedelta):
            raise TypeError(f"`timeout={self.timeout!r}` must be a datetime.timedelta, e.g. `timedelta(minutes=10)`.")
        check_reduce_dtype(self.reduce_dtype)
        if not isinstance(self.preemption, bool):
            raise TypeError(f"`preemption={self.preemption!r}` must be a bool (True: stop at an agreed step).")
        if self.async_save and self.config.state_dict_type != "sharded":
            raise ValueError("`async_save=True` writes sharded checkpoints; use `state_dict_type='sharded'`.")

    @classmethod
    def names(cls) -> list[str]:
        """The argument names the strategies take (besides Lightning's FSDPStrategy ones)."""
        own = [field.name for field in fields(cls) if field.name != "config"]
        return [field.name for field in fields(ShardingConfig)] + own

    @classmethod
    def from_arguments(cls, arguments: Mapping[str, Any]) -> StrategySettings:
        """Build the settings from a strategy's keyword arguments (unset ones take their defaults)."""
        accepted = cls.names()
        own = {name: value for name, value in arguments.items() if name in accepted}
        extra = {name: value for name, value in arguments.items() if name not in accepted}
        translated = translate_fsdp_strategy_arguments(own, extra, accepted=accepted)
        config_names = {field.name for field in fields(ShardingConfig)}
        config = ShardingConfig(**{name: value for name, value in translated.items() if name in config_names})
        return cls(config=config, **{name: value for name, value in translated.items() if name not in config_names})
