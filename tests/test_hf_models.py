"""Hugging Face (tiny Llama, tied GPT-2) and litgpt models under the sharded strategy.

One 2-rank run (``tests/hf_run.py``, gloo) against one process (Lightning's single-device strategy, same global
batches, the models built eagerly): per-step loss and final weights within 1e-5 (measured: losses 4.8e-7, weights
1.2e-7), the meta-device build equal to the eager one tensor by tensor, buffers included (measured: equal),
pretrained weights read shard by shard equal to the files, a Lightning checkpoint winning over them on resume, and
the model called directly after fit (forward, ``generate``) equal to one process. Then what needs no processes:
FSDP1 arguments, ``init_module``, transformers' ``from_pretrained`` on the meta device, the "auto" wrap policy.
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
from conftest import REPO, run_script
from lightning.fabric.utilities.warnings import PossibleUserWarning
from torch import nn
from torch.distributed.fsdp import (
    FSDPModule,
    MixedPrecisionPolicy,
    OffloadPolicy,
)

transformers = pytest.importorskip("transformers")
from hf_run import gpt2_config, llama_config  # noqa: E402
from transformers import AutoModelForCausalLM  # noqa: E402

import lightning_shard  # noqa: E402
from lightning_shard import ShardedStrategy, ShardingConfig  # noqa: E402
from lightning_shard.materialize import meta_construction  # noqa: E402
from lightning_shard.parallelize import parallelize_module  # noqa: E402
from lightning_shard.wrap import select_modules  # noqa: E402

TOL = 1e-5
TRANSFORMERS = ["llama", "gpt2", "pretrained"]
HAS_LITGPT = importlib.util.find_spec("litgpt") is not None
LITGPT = pytest.param(
    "litgpt",
    marks=pytest.mark.skipif(
        not HAS_LITGPT,
        reason="litgpt is not installed (`pip install --no-deps litgpt`: its pins would change huggingface_hub)",
    ),
)


@pytest.fixture(scope="module")
def pretrained_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("pretrained") / "tiny-llama"
    torch.manual_seed(7)
    AutoModelForCausalLM.from_config(llama_config()).save_pretrained(path)  # model.safetensors
    return path


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory, pretrained_dir: Path) -> dict[str, Path]:
    out = tmp_path_factory.mktemp("hf")
    scenarios = [*TRANSFORMERS, *(["litgpt"] if HAS_LITGPT else [])]
    common = ["--pretrained", str(pretrained_dir), *scenarios]
    run_script("tests/hf_run.py", "--devices", "2", "--out", str(out / "two"), *common)
    run_script("tests/hf_run.py", "--devices", "1", "--reference", "--out", str(out / "ref"), *common)
    return {"two": out / "two", "ref": out / "ref"}


def load(results: dict[str, Path], run: str, scenario: str) -> dict[str, Any]:
    return torch.load(results[run] / f"{scenario}.pt", weights_only=False)


def max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys(), f"names differ: {sorted(a.keys() ^ b.keys())}"
    return max([(a[k].float() - b[k].float()).abs().max().item() for k in a] or [0.0])


# ---------------------------------------------------------------------------------------------- 2 ranks vs 1


@pytest.mark.parametrize("scenario", [*TRANSFORMERS, LITGPT])
def test_two_ranks_match_one_process(results: dict[str, Path], scenario: str) -> None:
    two, ref = load(results, "two", scenario), load(results, "ref", scenario)
    assert len(two["losses"]) == len(ref["losses"]) == 4
    assert two["losses"] == pytest.approx(ref["losses"], abs=TOL)
    assert max_diff(two["end"], ref["end"]) < TOL
    assert two["losses"][-1] < two["losses"][0], "the model should learn"


@pytest.mark.parametrize("scenario", ["llama", "gpt2", LITGPT])
def test_meta_build_equals_eager_build(results: dict[str, Path], scenario: str) -> None:
    # 2 ranks: built on the meta device in configure_model(), sharded, initialised by transformers' _init_weights
    # (litgpt: reset_parameters) after replaying the constructors' draws; reference: built eagerly, same seed.
    two, ref = load(results, "two", scenario), load(results, "ref", scenario)
    assert two["start"].keys() == ref["start"].keys()
    for key in ref["start"]:
        assert torch.equal(two["start"][key], ref["start"][key]), key
    assert two["buffers"].keys() == ref["buffers"].keys()  # Llama: rotary inv_freq; litgpt: cos, sin
    for key in ref["buffers"]:
        assert torch.equal(two["buffers"][key], ref["buffers"][key]), key


def test_tied_gpt2_weights_stay_tied(results: dict[str, Path]) -> None:
    assert load(results, "two", "gpt2")["tied"] is True  # lm_head.weight is transformer.wte.weight after fit


def test_auto_wrap_picks_no_split_modules(results: dict[str, Path]) -> None:
    assert load(results, "two", "llama")["units"] == ["LlamaDecoderLayer"]  # LlamaForCausalLM._no_split_modules
    # GPT-2 ran under FSDP1 spellings: ModuleWrapPolicy({GPT2Block}), activation_checkpointing_policy={GPT2Block},
    # ShardingStrategy.FULL_SHARD, CPUOffload(offload_params=False); the blocks' checkpoint wrappers became the units.
    assert load(results, "two", "gpt2")["units"] == ["GPT2Block"]


@pytest.mark.parametrize("scenario", [LITGPT])
def test_auto_wrap_without_no_split_modules_picks_repeated_blocks(results: dict[str, Path], scenario: str) -> None:
    assert load(results, "two", scenario)["units"] == ["Block"]


def test_pretrained_weights_are_read_shard_by_shard(results: dict[str, Path], pretrained_dir: Path) -> None:
    from safetensors.torch import load_file

    on_disk = load_file(pretrained_dir / "model.safetensors")
    two, ref = load(results, "two", "pretrained"), load(results, "ref", "pretrained")
    assert max_diff(two["start"], {f"model.{key}": value for key, value in on_disk.items()}) == 0.0
    for key in ref["buffers"]:  # not in the files: transformers' init computed them
        assert torch.equal(two["buffers"][key], ref["buffers"][key]), key
    # each rank read its half of every tensor, never the whole model
    total = sum(t.numel() for t in on_disk.values())
    assert sum(two["elements_read"]) == total
    assert two["elements_read"] == [total // 2, total // 2]


def test_resuming_a_checkpoint_wins_over_pretrained_weights(results: dict[str, Path], pretrained_dir: Path) -> None:
    two, ref = load(results, "two", "pretrained"), load(results, "ref", "pretrained")
    resumed = two["resumed"]
    assert max_diff(resumed["start"], two["end"]) == 0.0  # the checkpoint's weights, not the files'
    assert max_diff(resumed["start"], two["start"]) > 1e-3
    assert resumed["losses"] == pytest.approx(ref["resumed"]["losses"], abs=TOL)


@pytest.mark.parametrize("scenario", TRANSFORMERS)
def test_generate_after_fit_matches_one_process(results: dict[str, Path], scenario: str) -> None:
    # every rank called `lightning_module.model(prompt)` and `.generate(prompt)` after fit, outside the step methods
    two, ref = load(results, "two", scenario), load(results, "ref", scenario)
    assert (two["logits"] - ref["logits"]).abs().max().item() < TOL
    assert two["generated"] == ref["generated"]
    assert len(two["generated"][0]) == 5 + 6


@pytest.mark.parametrize("scenario", [LITGPT])
def test_forward_after_fit_matches_one_process(results: dict[str, Path], scenario: str) -> None:
    two, ref = load(results, "two", scenario), load(results, "ref", scenario)
    assert (two["logits"] - ref["logits"]).abs().max().item() < TOL


# ---------------------------------------------------------------------------------------------- no processes


def test_init_module_follows_lightnings_convention() -> None:
    trainer = L.Trainer(strategy=ShardedStrategy(), accelerator="cpu", devices=2, logger=False)
    # Lightning warns for every strategy with a `model_sharded_context`
    with pytest.warns(PossibleUserWarning, match="init_module"), trainer.init_module():
        eager = nn.Linear(2, 2)
    with pytest.warns(PossibleUserWarning, match="init_module"), trainer.init_module(empty_init=True):
        empty = nn.Linear(2, 2)
    assert eager.weight.device.type == "cpu"
    assert empty.weight.is_meta


def test_transformers_from_pretrained_in_configure_model_names_the_ways_that_work(pretrained_dir: Path) -> None:
    with pytest.raises(RuntimeError, match=r"lightning_shard\.hf\.from_pretrained\(AutoModelForCausalLM, path\)"):
        with ShardedStrategy().model_sharded_context():
            AutoModelForCausalLM.from_pretrained(pretrained_dir)


def test_from_pretrained_refuses_placement_arguments_before_building(pretrained_dir: Path) -> None:
    with pytest.raises(TypeError, match="device_map"), meta_construction():
        lightning_shard.hf.from_pretrained(AutoModelForCausalLM, pretrained_dir, device_map="auto")
    with pytest.raises(FileNotFoundError, match="save_pretrained"):
        lightning_shard.hf.from_pretrained(AutoModelForCausalLM, pretrained_dir / "missing")


def test_auto_policy_reads_no_split_modules() -> None:
    # one decoder layer: no block repeats, so only `_no_split_modules` names it
    with meta_construction():
        model = AutoModelForCausalLM.from_config(llama_config(layers=1))
    assert [type(m).__name__ for m in select_modules(model, "auto")] == ["LlamaDecoderLayer"]
    with meta_construction():
        model = AutoModelForCausalLM.from_config(gpt2_config())
    assert {type(m).__name__ for m in select_modules(model, "auto")} == {"GPT2Block"}


def test_importing_the_package_does_not_import_transformers_models() -> None:
    code = "import sys, lightning_shard, lightning_shard.hf; assert 'transformers.modeling_utils' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True, cwd=REPO)


def test_parameter_that_transformers_init_does_not_cover_is_an_error(mesh) -> None:
    from transformers import PretrainedConfig, PreTrainedModel

    class Uncovered(PreTrainedModel):
        config_class = PretrainedConfig

        def __init__(self, config: PretrainedConfig) -> None:
            super().__init__(config)
            self.proj = nn.Linear(4, 4)
            self.scale = nn.Parameter(torch.ones(4))  # set in __init__ only: `_init_weights` has no rule for it
            self.post_init()

    with meta_construction():
        model = Uncovered(PretrainedConfig())
    with pytest.raises(RuntimeError, match=r"`Uncovered.scale` was left uninitialised"):
        parallelize_module(
            model,
            mesh,
            ShardingConfig(auto_wrap_policy=None),
            mp_policy=MixedPrecisionPolicy(),
            offload_policy=OffloadPolicy(),
            device=torch.device("cpu"),
        )
    assert isinstance(model, FSDPModule)


def test_the_slice_reader_reads_rows_by_file_reads_and_converts_dtypes(tmp_path: Path) -> None:
    # A rank's slice is a run of rows, read with plain file reads (no mapping left in RSS); a bf16 file loads into
    # fp32 targets through a buffer, and the tensor after the first one starts at its own offset.
    import torch.distributed.checkpoint as dcp
    from safetensors.torch import save_file
    from torch.distributed.checkpoint import HuggingFaceStorageReader

    from lightning_shard.hf.pretrained import _slice_reader_class

    saved = {"a": torch.randn(6, 4).to(torch.bfloat16), "b": torch.randn(3, 2), "c": torch.arange(5.0)}
    save_file(saved, tmp_path / "model.safetensors")
    targets = {"a": torch.empty(6, 4), "b": torch.empty(3, 2), "c": torch.empty(5)}
    dcp.load(targets, storage_reader=_slice_reader_class(HuggingFaceStorageReader)(str(tmp_path)))
    for name, tensor in saved.items():
        assert torch.equal(targets[name], tensor.float()), name
