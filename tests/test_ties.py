"""Tied parameters and what is attached to parameters, through setup (issue 34, parts 1 and 2).

In one process: the default wrapping (``"auto"``) never makes a unit of a module holding one end of a tie, on
nanoGPT and tiny configs of 14 transformers families that tie their embeddings; a policy that would split a tie is
refused naming both parameters; a meta-device build (as in ``configure_model()``) materialises every tie as one
parameter holding the eager build's numbers (T5/BART/Pegasus/Marian's ``shared`` embedding included); what was
attached to a meta parameter (a flag, a gradient hook) is on the live one after setup.

On 2 gloo ranks against one process (``tests/ties_run.py``, two launches, about 1.5 minutes on 2 busy cores): nanoGPT
(``tests/nanogpt.py``) and the masked-LM heads the default wrapping split before (BERT, RoBERTa, ModernBERT) train
under ``strategy="fully_sharded"`` with default settings, built eagerly and in ``configure_model()``, with per-step
losses and final weights within 1e-5 and the ties holding at ``on_fit_start`` and after training; CLIP built in
``configure_model()`` trains 20 steps exactly as built eagerly (its replicated ``logit_scale``'s gradient averaging on
the live parameter).
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import load, max_weight_diff, run_script
from torch import nn
from torch.distributed.fsdp import MixedPrecisionPolicy, OffloadPolicy

if importlib.util.find_spec("transformers") is None:
    pytest.skip("not installed: transformers (pip install -e '.[test,hf]')", allow_module_level=True)

from tied_models import TRANSFORMERS, builder, tied_names  # noqa: E402

import lightning_shard.hf  # noqa: E402,F401  (registers transformers' initialisation)
from lightning_shard import ShardingConfig  # noqa: E402
from lightning_shard.init.materialize import materialize_sharded_module, meta_construction  # noqa: E402
from lightning_shard.plan.parallelize import parallelize_module  # noqa: E402
from lightning_shard.plan.wrap import plan_units  # noqa: E402

TOL = 1e-5
CORPUS = ["nanogpt", *TRANSFORMERS]
# trained on 2 ranks: (scenario, reference scenario); `_meta`: built in configure_model()
TRAINED = ["nanogpt", "bert", "roberta", "modernbert", "clip"]
TWO_RANKS = [*TRAINED, "nanogpt_meta", "bert_meta", "modernbert_meta", "clip_meta", "t5_meta", "bart_meta"]
REFERENCE = [*TRAINED, "t5", "bart"]


def _splits(unit_name: str, names: list[str]) -> bool:
    inside = [name for name in names if name.startswith(f"{unit_name}.")]
    return 0 < len(inside) < len(names)


@pytest.mark.parametrize("name", CORPUS)
def test_the_default_wrapping_keeps_every_tie_in_one_unit(name: str) -> None:
    model = builder(name)()
    ties = tied_names(model)
    assert ties
    unit_names = {id(m): n for n, m in model.named_modules()}
    units = [unit_names[id(unit)] for unit in plan_units(model, "auto").modules]
    assert [(unit, names) for unit in units for names in ties if _splits(unit, names)] == []


@pytest.mark.parametrize(
    ("name", "policy", "pair"),
    [
        ("nanogpt", {nn.Embedding}, ("transformer.wte.weight", "lm_head.weight")),
        ("bert", ["BertEmbeddings", "BertLayer"], ("bert.embeddings.word_embeddings.weight", "cls.predictions")),
        ("gpt2", 1000, ("transformer.wte.weight", "lm_head.weight")),
    ],
)
def test_a_policy_that_would_split_a_tie_is_refused_naming_both_parameters(name: str, policy: Any, pair) -> None:
    model = builder(name)()
    with pytest.raises(ValueError, match="tied parameter") as error:
        plan_units(model, policy)
    assert all(part in str(error.value) for part in pair), str(error.value)
    assert "auto_wrap_policy='auto'" in str(error.value)
    # checkpointing such a module splits nothing
    assert plan_units(model, policy, "activation_checkpointing", shards=False).modules


@pytest.mark.parametrize("name", CORPUS)
def test_a_meta_device_build_materialises_each_tie_as_one_parameter_with_the_eager_numbers(name: str) -> None:
    torch.manual_seed(0)
    eager = builder(name)()
    torch.manual_seed(0)
    with meta_construction():
        meta = builder(name)()
    materialize_sharded_module(meta, torch.device("cpu"))
    assert tied_names(meta) == tied_names(eager)
    built = dict(eager.named_parameters(remove_duplicate=False))
    for key, value in meta.named_parameters(remove_duplicate=False):
        assert torch.equal(value, built[key]), key


class Scaled(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(4, 4)
        self.scale = nn.Parameter(torch.tensor(2.0))  # 0-d: kept whole beside the shards

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(x) * self.scale


def test_what_is_attached_to_a_meta_parameter_is_on_the_live_one_after_setup(mesh) -> None:
    torch.manual_seed(0)
    with meta_construction():
        model = Scaled()
    seen: list[float] = []
    model.scale.register_post_accumulate_grad_hook(lambda p: seen.append(float(p.grad)))
    model.scale._is_hf_initialized = True
    model.proj.weight._is_hf_initialized = True
    model.proj.weight.register_hook(lambda grad: grad)  # carried to the sharded DTensor: harmless there
    parallelize_module(
        model,
        mesh,
        ShardingConfig(),
        mp_policy=MixedPrecisionPolicy(),
        offload_policy=OffloadPolicy(),
        device=torch.device("cpu"),
    )
    assert not model.scale.is_meta and model.scale._is_hf_initialized and model.proj.weight._is_hf_initialized
    model(torch.ones(2, 4)).sum().backward()
    assert seen == [float(model.scale.grad)] != []


def test_a_tie_lost_in_setup_is_an_error() -> None:
    from lightning_shard.init.ties import check_ties, find_ties

    model = builder("nanogpt")()
    ties = find_ties(model)
    model.lm_head.weight = nn.Parameter(model.lm_head.weight.detach().clone())
    with pytest.raises(RuntimeError, match=r"\[\['transformer.wte.weight', 'lm_head.weight'\]\] are no longer one"):
        check_ties(model, ties)


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    out = tmp_path_factory.mktemp("ties")
    run_script("tests/ties_run.py", "--devices", "2", "--out", str(out / "two"), *TWO_RANKS, timeout=900)
    run_script("tests/ties_run.py", "--devices", "1", "--reference", "--out", str(out / "ref"), *REFERENCE, timeout=600)
    return {"two": out / "two", "ref": out / "ref"}


@pytest.mark.parametrize("scenario", [s for s in TWO_RANKS if s.removesuffix("_meta") in TRAINED])
def test_tied_models_train_on_two_ranks_as_in_one_process(results: dict[str, Path], scenario: str) -> None:
    run, reference = load(results, "two", scenario), load(results, "ref", scenario.removesuffix("_meta"))
    assert "error" not in run, run["error"]
    assert max_weight_diff(run["start"]["weights"], reference["start"]["weights"]) == 0.0
    assert len(run["losses"]) == len(reference["losses"]) > 0
    assert run["losses"] == pytest.approx(reference["losses"], rel=TOL, abs=TOL)
    # CLIP: 20 steps at lr 0.05 with momentum; fp32 summation order alone moves its weights 2.3e-5 (built eagerly too)
    assert max_weight_diff(run["end"]["weights"], reference["end"]["weights"]) < (1e-4 if "clip" in scenario else TOL)
    assert all(run["kept"]["fit_start"]) and all(run["kept"]["end"])


def test_clip_built_in_configure_model_trains_exactly_as_built_eagerly(results: dict[str, Path]) -> None:
    # its 0-d `logit_scale` is kept whole on every rank; the gradient averaging must be on the live parameter
    meta, eager = load(results, "two", "clip_meta"), load(results, "two", "clip")
    assert len(meta["losses"]) == 20
    assert meta["losses"] == eager["losses"]
    assert max_weight_diff(meta["end"]["weights"], eager["end"]["weights"]) == 0.0


@pytest.mark.parametrize("name", ["t5", "bart"])
def test_a_shared_embedding_built_in_configure_model_starts_and_trains_as_built_eagerly(results, name) -> None:
    meta, eager = load(results, "two", f"{name}_meta"), load(results, "ref", name)
    assert "error" not in meta, meta["error"]
    assert max_weight_diff(meta["start"]["weights"], eager["start"]["weights"]) == 0.0
    assert meta["losses"] == pytest.approx(eager["losses"], rel=TOL, abs=TOL)
    assert all(meta["kept"]["fit_start"]) and all(meta["kept"]["end"])
