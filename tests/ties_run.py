"""Train the tied models of ``tied_models.py`` and CLIP (its 0-d ``logit_scale`` kept whole on every rank) with the
default settings, built in ``__init__`` (``NAME``) or in ``configure_model()`` on the meta device (``NAME_meta``);
save per-step global losses, the full weights when training starts and ends, and which tied names still share one
parameter at ``on_fit_start`` and at the end.

    python tests/ties_run.py --devices 2 --out OUT nanogpt nanogpt_meta bert bert_meta clip clip_meta ...
``--devices 1 --reference`` is the one-process reference (Lightning's single-device strategy, built eagerly).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

import lightning as L
import torch
from torch import Tensor, nn
from torch.utils.data import DataLoader

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import tied_models  # noqa: E402
from library_models import CASES as LIBRARY_CASES  # noqa: E402
from library_models import case_inputs  # noqa: E402
from library_run import SampleDataset  # noqa: E402
from toy import (  # noqa: E402
    N_SAMPLES,
    QUIET,
    GlobalLossRecorder,
    RankSliceBatchSampler,
    StateRecorder,
    raise_if_peer_gone,
    scenario_parser,
)

import lightning_shard  # noqa: E402,F401  (registers strategy="fully_sharded")

GLOBAL_BATCH = 8
# steps per model: CLIP's replicas drift apart slowly when their gradients are not averaged, so 20
STEPS = {"clip": 20, "nanogpt": 5}
MODELS = ["nanogpt", "clip", *tied_models.TRANSFORMERS]
SCENARIOS = [*MODELS, *(f"{name}_meta" for name in MODELS)]


class TiedModule(L.LightningModule):
    """A model of ``MODELS`` under Lightning: built in ``__init__`` or in ``configure_model()``."""

    def __init__(self, name: str, meta: bool) -> None:
        super().__init__()
        self.name = name
        self.build = LIBRARY_CASES["clip"].build if name == "clip" else tied_models.builder(name)
        self.model: nn.Module | None = None if meta else self.build()

    def configure_model(self) -> None:
        if self.model is None:
            self.model = self.build()

    def training_step(self, batch: dict[str, Tensor], batch_idx: int) -> Tensor:
        if self.name == "clip":
            return LIBRARY_CASES["clip"].loss(self.model, batch)
        return tied_models.loss(self.name, self.model, batch)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)


class TiesKept(L.Callback):
    """The tied names (as in an eager build) that share one parameter at ``on_fit_start`` and when training ends."""

    def __init__(self, ties: list[list[str]]) -> None:
        self.ties = ties
        self.kept: dict[str, list[bool]] = {}

    def _record(self, when: str, pl_module: L.LightningModule) -> None:
        params = dict(pl_module.model.named_parameters(remove_duplicate=False))
        self.kept[when] = [all(params[name] is params[names[0]] for name in names) for names in self.ties]

    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._record("fit_start", pl_module)

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._record("end", pl_module)


def run(name: str, devices: int, reference: bool, out: Path) -> None:
    model_name, meta = name.removesuffix("_meta"), name.endswith("_meta")
    L.seed_everything(0, verbose=False)
    module = TiedModule(model_name, meta)
    ties = tied_models.tied_names(module.build() if meta else module.model)
    L.seed_everything(0, verbose=False)  # the eager build above drew numbers: start again from the same seed
    losses, states, kept = GlobalLossRecorder(), StateRecorder(), TiesKept(ties)
    trainer = L.Trainer(
        accelerator="cpu",
        devices=devices,
        strategy="auto" if reference else "fully_sharded",
        max_steps=STEPS.get(model_name, 3),
        callbacks=[losses, states, kept],
        **QUIET,
    )
    if model_name == "clip":
        samples = case_inputs("clip", N_SAMPLES)
    else:
        samples = tied_models.inputs(model_name, N_SAMPLES)
    loader = DataLoader(SampleDataset(samples), batch_sampler=RankSliceBatchSampler(GLOBAL_BATCH))
    result: dict[str, Any] = {"ties": ties}
    try:
        trainer.fit(module, train_dataloaders=loader)
    except Exception as error:  # recorded, so that one model's failure does not hide the others'
        raise_if_peer_gone(error)
        result["error"] = f"{type(error).__name__}: {error}"
    result.update(losses=losses.losses, start=states.states.get("start"), end=states.states.get("end"), kept=kept.kept)
    if trainer.is_global_zero:
        torch.save(result, out / f"{name}.pt")


def main() -> None:
    args = scenario_parser(SCENARIOS).parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    for name in args.scenarios:
        run(name, args.devices, args.reference, args.out)


if __name__ == "__main__":
    main()
