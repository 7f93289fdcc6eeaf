"""Hugging Face (tiny Llama, tied GPT-2, Mixtral) and litgpt models under the sharded strategy.

One 2-rank run (``tests/hf_run.py``, gloo) against one process (Lightning's single-device strategy, same global
batches, the models built eagerly, pretrained ones by transformers' own ``from_pretrained``): per-step loss and final
weights within 1e-5 (measured: losses 4.8e-7, weights 1.2e-7), the meta-device build equal to the eager one tensor by
tensor, buffers included (measured: equal), pretrained weights read shard by shard equal to the files, checkpoints
in layouts transformers converts on load (a Mixtral's per-expert tensors, a Llama's fused qkv) loaded equal to
transformers' load (measured: equal; losses 4.8e-7), a bf16 checkpoint kept in fp32 under "bf16-mixed" and in bf16
under "bf16-true" (AdamW states alike), a Lightning checkpoint winning over pretrained weights on resume, and the
model called directly after fit (forward, ``generate``) equal to one process. Then what needs no processes: FSDP1
arguments, ``init_module``, transformers' ``from_pretrained`` on the meta device, checkpoints refused before sharding,
the "auto" wrap policy.
"""

from __future__ import annotations

import contextlib
import importlib.util
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
from conftest import REPO, run_script
from lightning.fabric.utilities.warnings import PossibleUserWarning
from torch import nn
from torch.distributed.fsdp import (
    MixedPrecisionPolicy,
    OffloadPolicy,
)
from torch.distributed.tensor import DTensor

transformers = pytest.importorskip("transformers")
from hf_run import PRETRAINED, gpt2_config, llama_config, write_checkpoints  # noqa: E402
from transformers import AutoModelForCausalLM  # noqa: E402

import lightning_shard  # noqa: E402
from lightning_shard import ShardedStrategy, ShardingConfig  # noqa: E402
from lightning_shard.init.materialize import meta_construction  # noqa: E402
from lightning_shard.plan.parallelize import parallelize_module  # noqa: E402
from lightning_shard.plan.wrap import select_modules  # noqa: E402

TOL = 1e-5
TRANSFORMERS = ["llama", "gpt2", "pretrained"]
CONVERTED = ["mixtral", "fused_qkv"]  # checkpoints in a layout transformers converts on load
PRECISIONS = ["bf16_mixed", "bf16_true"]
HAS_LITGPT = importlib.util.find_spec("litgpt") is not None
LITGPT = pytest.param(
    "litgpt",
    marks=pytest.mark.skipif(
        not HAS_LITGPT,
        reason="litgpt is not installed (`pip install --no-deps litgpt`: its pins would change huggingface_hub)",
    ),
)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("checkpoints")
    write_checkpoints(root)  # llama, llama-bf16, mixtral: model.safetensors each
    return root


@pytest.fixture(scope="module")
def pretrained_dir(checkpoints: Path) -> Path:
    return checkpoints / "llama"


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory, checkpoints: Path) -> dict[str, Path]:
    out = tmp_path_factory.mktemp("hf")
    scenarios = [*TRANSFORMERS, *(["litgpt"] if HAS_LITGPT else []), *CONVERTED, *PRECISIONS]
    common = ["--checkpoints", str(checkpoints), *scenarios]
    run_script("tests/hf_run.py", "--devices", "2", "--out", str(out / "two"), *common)
    run_script("tests/hf_run.py", "--devices", "1", "--reference", "--out", str(out / "ref"), *common)
    return {"two": out / "two", "ref": out / "ref"}


def load(results: dict[str, Path], run: str, scenario: str) -> dict[str, Any]:
    return torch.load(results[run] / f"{scenario}.pt", weights_only=False)


def max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys(), f"names differ: {sorted(a.keys() ^ b.keys())}"
    return max([(a[k].float() - b[k].float()).abs().max().item() for k in a] or [0.0])


# ---------------------------------------------------------------------------------------------- 2 ranks vs 1


@pytest.mark.parametrize("scenario", [*TRANSFORMERS, LITGPT, *CONVERTED])
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


@pytest.mark.parametrize(
    ("scenario", "stored", "loaded"),
    [
        # Mixtral in the Hub's per-expert layout: MergeModulelist + Concatenate into one tensor per layer
        ("mixtral", "layers.0.block_sparse_moe.experts.3.w1.weight", "layers.0.mlp.experts.gate_up_proj"),
        # a registered conversion that splits one tensor into three: each rank needs the whole one first
        ("fused_qkv", "layers.0.self_attn.qkv_proj.weight", "layers.0.self_attn.k_proj.weight"),
    ],
)
def test_converted_checkpoint_loads_as_transformers_loads_it(
    results: dict[str, Path], checkpoints: Path, scenario: str, stored: str, loaded: str
) -> None:
    from safetensors import safe_open

    with safe_open(checkpoints / PRETRAINED[scenario][0] / "model.safetensors", "pt") as files:
        names = set(files.keys())
    assert f"model.{stored}" in names and f"model.{loaded}" not in names  # save_pretrained wrote the converted layout
    two, ref = load(results, "two", scenario), load(results, "ref", scenario)
    # reference: transformers' `from_pretrained` in one process; 2 ranks: shard by shard through its conversion mapping
    assert f"model.model.{loaded}" in two["start"]
    assert max_diff(two["start"], ref["start"]) == 0.0


def test_each_rank_reads_only_its_experts(results: dict[str, Path]) -> None:
    for rank, read in enumerate(load(results, "two", "mixtral")["converted_reads"]):
        experts = {int(name.split(".experts.")[1].split(".")[0]) for name in read}
        assert experts == {2 * rank, 2 * rank + 1}, rank  # dim 0 of the fused tensors: 4 experts over 2 ranks
        assert len(read) == len(set(read)) == 2 * 2 * 3  # layers x own experts x (w1, w3, w2), each once


@pytest.mark.parametrize(
    ("scenario", "stored", "inv_freq"),
    [("bf16_mixed", "torch.float32", torch.float32), ("bf16_true", "torch.bfloat16", torch.bfloat16)],
)
def test_bf16_checkpoint_is_stored_in_the_precisions_dtype(
    results: dict[str, Path], scenario: str, stored: str, inv_freq: torch.dtype
) -> None:
    # config.json says `dtype: bfloat16` and the file holds bf16; "-mixed" keeps fp32 master weights (the file upcast
    # as each rank reads its slices), "-true" the precision's dtype. AdamW's states follow the sharded parameters.
    two, ref = load(results, "two", scenario), load(results, "ref", scenario)
    assert two["stored_dtypes"] == two["adamw_dtypes"] == [stored]
    assert two["buffers"]["model.rotary_emb.inv_freq"].dtype == inv_freq  # "-mixed": fp32, as transformers computes it
    # reference: one process, same strategy and precision, transformers' `from_pretrained(dtype=torch.float32)`
    assert max_diff(two["start"], ref["start"]) == 0.0
    # bf16 rounding differs with the per-rank batch size: measured 1.1e-4 (mixed), 2.4e-5 (true) over 4 AdamW steps;
    # bf16 master weights under "bf16-mixed" differ by 1.25e-3
    assert two["losses"] == pytest.approx(ref["losses"], abs=5e-4)


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


@pytest.mark.parametrize("build", ["meta", "eager"])
def test_from_pretrained_takes_local_files_only(pretrained_dir: Path, build: str) -> None:
    # it was passed twice to transformers (a duplicate-keyword TypeError)
    with meta_construction() if build == "meta" else contextlib.nullcontext():
        model = lightning_shard.hf.from_pretrained(AutoModelForCausalLM, pretrained_dir, local_files_only=True)
    assert model.model.embed_tokens.weight.is_meta == (build == "meta")


def _rewrite_checkpoint(source: Path, target: Path, rename: Callable[[str], str], config: dict[str, Any]) -> Path:
    """A copy of ``source`` with its tensors renamed and its config.json updated."""
    import json
    import shutil

    from safetensors.torch import load_file, save_file

    shutil.copytree(source, target)
    tensors = load_file(source / "model.safetensors")
    save_file({rename(name): tensor for name, tensor in tensors.items()}, target / "model.safetensors")
    settings = json.loads((source / "config.json").read_text())
    (target / "config.json").write_text(json.dumps({**settings, **config}))
    return target


@pytest.mark.parametrize(
    ("directory", "rename", "config", "match"),
    [
        # a layout transformers does not convert: the experts and routers would stay random
        (
            "mixtral",
            lambda name: name.replace(".block_sparse_moe.", ".sparse_moe."),
            {},
            r"does not fill 6 tensors of MixtralForCausalLM: \['model.layers.0.mlp.experts.down_proj'"
            r".*holds 26 tensors the model does not use: \['model.layers.0.sparse_moe.experts.0.w1.weight'",
        ),
        # a tensor missing from the files
        (
            "llama",
            lambda name: name.replace("layers.1.mlp.up_proj", "layers.1.mlp.unknown"),
            {},
            "layers.1.mlp.up_proj",
        ),
        # the head under a name transformers does not convert: an unused tensor of the unfilled head's shape
        ("llama", lambda name: name.replace("lm_head", "output"), {}, r"lm_head.weight'\].*\['output.weight'\]"),
        # a config that is not the checkpoint's
        ("llama", lambda name: name, {"intermediate_size": 96}, r"do not have the shapes.*\[128, 64\] -> model"),
    ],
)
def test_checkpoint_that_does_not_fill_the_model_is_refused_before_sharding(
    checkpoints: Path, tmp_path: Path, directory: str, rename: Callable[[str], str], config: dict, match: str
) -> None:
    path = _rewrite_checkpoint(checkpoints / directory, tmp_path / directory, rename, config)
    with pytest.raises(ValueError, match=match), meta_construction():
        lightning_shard.hf.from_pretrained(AutoModelForCausalLM, path)


def test_new_head_gets_transformers_init_with_a_warning(pretrained_dir: Path) -> None:
    # a classifier from a causal LM checkpoint, as in transformers: `score` is new, `lm_head` is left unused
    from transformers import AutoModelForSequenceClassification

    with pytest.warns(UserWarning) as warned, meta_construction():
        lightning_shard.hf.from_pretrained(AutoModelForSequenceClassification, pretrained_dir, num_labels=3)
    messages = "\n".join(str(warning.message) for warning in warned)
    assert "holds no ['score.weight']: they get LlamaForSequenceClassification's initialisation" in messages
    assert "does not use; not loaded: ['lm_head.weight']" in messages


def test_tied_checkpoint_fills_the_tied_head(tmp_path: Path) -> None:
    # save_pretrained writes a tied weight once (the embedding); the head is the same tensor, not missing
    import warnings

    from lightning_shard.hf.pretrained import _PRETRAINED

    AutoModelForCausalLM.from_config(llama_config(tie_word_embeddings=True)).save_pretrained(tmp_path)
    with warnings.catch_warnings(record=True) as warned, meta_construction():
        warnings.simplefilter("always")
        model = lightning_shard.hf.from_pretrained(AutoModelForCausalLM, tmp_path)
    assert not [warning for warning in warned if "lm_head" in str(warning.message)]
    assert "lm_head.weight" not in model.__dict__[_PRETRAINED].renamed.values()
    assert model.lm_head.weight is model.model.embed_tokens.weight


def test_mixed_precision_keeps_fp32_parameters_of_a_model_built_in_bf16() -> None:
    from lightning_shard.plan.precision import ShardedPrecision

    config = llama_config(num_hidden_layers=1)
    config.tie_word_embeddings = True
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)  # eagerly, as in `__init__`
    inv_freq = model.model.rotary_emb.inv_freq.clone()
    ShardedPrecision("bf16-mixed").convert_module(model)
    assert {param.dtype for param in model.parameters()} == {torch.float32}
    assert model.lm_head.weight is model.model.embed_tokens.weight  # still tied
    assert torch.equal(model.model.rotary_emb.inv_freq, inv_freq)  # buffers as built (fp32, as transformers computes)
    ShardedPrecision("bf16-true").convert_module(model)
    assert {param.dtype for param in model.parameters()} == {torch.bfloat16}


def test_auto_policy_reads_no_split_modules() -> None:
    # one decoder layer: no block repeats, so only `_no_split_modules` names it
    with meta_construction():
        model = AutoModelForCausalLM.from_config(llama_config(num_hidden_layers=1))
    assert [type(m).__name__ for m in select_modules(model, "auto")] == ["LlamaDecoderLayer"]
    with meta_construction():
        model = AutoModelForCausalLM.from_config(gpt2_config())
    assert {type(m).__name__ for m in select_modules(model, "auto")} == {"GPT2Block"}


def test_importing_the_package_does_not_import_transformers_models() -> None:
    code = "import sys, lightning_shard, lightning_shard.hf; assert 'transformers.modeling_utils' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True, cwd=REPO)


def test_tensors_transformers_init_does_not_set_keep_their_constructors_values(mesh) -> None:
    from transformers import PretrainedConfig, PreTrainedModel

    class Uncovered(PreTrainedModel):
        config_class = PretrainedConfig

        def __init__(self, config: PretrainedConfig) -> None:
            super().__init__(config)
            self.proj = nn.Linear(4, 4)
            self.scale = nn.Parameter(torch.linspace(0.5, 2.0, 4))  # `_init_weights` has no rule for it (CLIP's
            self.register_buffer("offset", torch.tensor([0.25, 0.5]))  # `logit_scale`): its constructor's value
            self.post_init()

    torch.manual_seed(0)
    eager = Uncovered(PretrainedConfig()).state_dict()
    torch.manual_seed(0)
    with meta_construction():
        model = Uncovered(PretrainedConfig())
    parallelize_module(
        model,
        mesh,
        ShardingConfig(auto_wrap_policy=None),
        mp_policy=MixedPrecisionPolicy(),
        offload_policy=OffloadPolicy(),
        device=torch.device("cpu"),
    )
    built = {k: v.full_tensor() if isinstance(v, DTensor) else v for k, v in model.state_dict().items()}
    assert built.keys() == eager.keys()
    for key in eager:
        assert torch.equal(built[key], eager[key]), key


def test_the_slice_reader_reads_rows_by_file_reads_and_converts_dtypes(tmp_path: Path) -> None:
    # A rank's slice is a run of rows, read with plain file reads (no mapping left in RSS); a bf16 file loads into
    # fp32 targets through a buffer, and the tensor after the first one starts at its own offset.
    import torch.distributed.checkpoint as dcp
    from safetensors.torch import save_file
    from torch.distributed.checkpoint import HuggingFaceStorageReader

    from lightning_shard.hf.safetensors_files import slice_reader_class

    saved = {"a": torch.randn(6, 4).to(torch.bfloat16), "b": torch.randn(3, 2), "c": torch.arange(5.0)}
    save_file(saved, tmp_path / "model.safetensors")
    targets = {"a": torch.empty(6, 4), "b": torch.empty(3, 2), "c": torch.empty(5)}
    dcp.load(targets, storage_reader=slice_reader_class(HuggingFaceStorageReader)(str(tmp_path)))
    for name, tensor in saved.items():
        assert torch.equal(targets[name], tensor.float()), name
