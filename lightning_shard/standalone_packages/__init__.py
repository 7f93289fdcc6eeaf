"""``lightning_shard.standalone``: the package for Lightning's standalone packages, ``pytorch_lightning`` and
``lightning_fabric``, from the same source files.

``lightning`` and ``pytorch_lightning`` hold the same code under two names, so a Trainer from one refuses the other's
strategies, callbacks and plugins. Lightning makes ``pytorch_lightning`` from ``lightning``'s sources by renaming
``lightning.pytorch`` to ``pytorch_lightning`` and ``lightning.fabric`` to ``lightning_fabric``; this does the same
renaming at import time, and only for the statements that use the framework:

- :mod:`.dependencies` reads the package's source and marks each module-level statement that names a Lightning object,
  directly or through the package's other definitions (``ShardedStrategy``, ``ShardedCheckpointIO``, the callbacks,
  the launchers, the registrations in ``__init__``). That is 28 of about 75 modules, and a fraction of their statements.
- :mod:`.loader` loads ``lightning_shard.standalone.<module>`` as the unified module's namespace, then runs the marked
  statements of the same file on top of it with their imports renamed (:mod:`.rewrite`).

Why it is safe: there is one source (no generated copy to fall out of date); a new use of Lightning anywhere is found
by the analysis, not by a list someone must keep; whatever does not use the framework is the *same object* under both
names, so the sharding engine, the initialisation rule, their registries and module state (background saves in
flight) exist once; line numbers and files are the originals', so tracebacks point at the real source; an import the
renaming cannot express is refused when the module loads. ``import lightning_shard`` loads the namespace only once
``pytorch_lightning`` or ``lightning_fabric`` is imported (before or after it), so ``lightning`` users pay nothing.

Example:
    >>> import pytorch_lightning as pl  # doctest: +SKIP
    >>> import lightning_shard  # registers "fully_sharded" with pytorch_lightning too  # doctest: +SKIP
    >>> trainer = pl.Trainer(strategy=lightning_shard.standalone.ShardedStrategy(), devices=2)  # doctest: +SKIP
"""

from lightning_shard.standalone_packages.loader import load_when_imported
from lightning_shard.standalone_packages.rewrite import STANDALONE

__all__ = ["STANDALONE", "load_when_imported"]
