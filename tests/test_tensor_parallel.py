"""Tensor parallelism on a (data-parallel x tensor-parallel) mesh: ``ShardedStrategy(tensor_parallel_size=2)``.

Runs (``tests/tensor_parallel_run.py``, gloo, fp32, AdamW, 6 steps): the GPT example (its declared plan) and a tiny
transformers Llama (its own ``tp_plan``, applied by transformers' code) on 4 ranks as 2 x 2 and on 2 ranks as 1 x 2,
against one process (Lightning's single-device strategy on the same global batches) and against Lightning's
``ModelParallelStrategy`` with the same plan written by hand. Measured: losses within 9.5e-7 of one process, weights
within 3.6e-6, the meta-device build equal to the eager build (0.0) and generation after fit equal; against
``ModelParallelStrategy`` bit-identical (0.0) with the same bytes on every rank. On the 2 x 2 mesh also: clipping over
both dimensions with accumulation and selective activation checkpointing, bf16-mixed, pretrained files read slice by
slice, LoRA adapters following their base layer's plan, Fabric, a configure_model() that shards by hand, the sharded
checkpoint resumed at 2 x 2, 1 x 2 and by one process and, converted to a full file, by Lightning itself, Lightning
ModelParallelStrategy's own checkpoint resumed, and the full file exported with ``export-hf``; litgpt's GPT (1 x 2) with
the plan lightning-shard ships; the Llama with a dict plan whose output layer is "loss_parallel" (1 x 2). Then what
needs no processes: the settings, the plan forms and their errors (on a fake 2-rank process group). 46 tests; the four
launches take 76 s on 2 idle cores, 122 s at load average 5.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
import torch.distributed as dist
from conftest import max_weight_diff, run_script
from tensor_parallel_run import LORA_TARGETS, MAX_STEPS, SAVE_STEP, TinyGPT, write_pretrained
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, OffloadPolicy, fully_shard
from torch.distributed.tensor import Replicate, Shard

from lightning_shard import ShardedStrategy, ShardingConfig, estimate_memory
from lightning_shard.checkpoint.read import read_sharded_keys
from lightning_shard.cli import main as cli_main
from lightning_shard.init.materialize import meta_construction
from lightning_shard.plan.parallelize import parallelize_module
from lightning_shard.tensor_parallel import apply_tensor_parallel_plan, resolve_plan
from lightning_shard.torch_compat.fsdp import memory_simulation_tools

LOSS_TOL, WEIGHT_TOL = 1e-5, 5e-5  # AdamW on near-zero gradients sets the floor (issue 30)
SCRIPT = "tests/tensor_parallel_run.py"
BOTH = ["gpt", "llama"]
TWO_BY_TWO = [*BOTH, "gpt_resume", "gpt_clip_accumulate", "gpt_bf16", "pretrained", "lora", "gpt_by_hand",
              "fabric_gpt"]  # fmt: skip
ONE_BY_TWO = [*BOTH, "gpt_resume", "gpt_resume_full", "gpt_auto", "litgpt", "llama_loss_parallel"]
AFTER_MODEL_PARALLEL = ["gpt_resume_mp"]  # one process (the sharded strategy) resumes ModelParallelStrategy's save


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    out = tmp_path_factory.mktemp("tensor_parallel")
    checkpoints = out / "checkpoints"
    write_pretrained(checkpoints)
    common = ["--checkpoints", str(checkpoints)]
    run_script(SCRIPT, "--devices", "4", "--tp", "2", "--out", str(out / "2x2"), *common, *TWO_BY_TWO, timeout=900)
    assert cli_main(["convert", str(checkpoints / "gpt-4.ckpt"), str(checkpoints / "gpt-4-full.ckpt")]) == 0
    run_script(SCRIPT, "--devices", "2", "--tp", "2", "--out", str(out / "1x2"), *common, *ONE_BY_TWO, timeout=600)
    mp = ["--model-parallel", "--out", str(out / "mp")]
    run_script(SCRIPT, "--devices", "4", "--tp", "2", *mp, *common, *BOTH, timeout=600)  # saves gpt-4-mp.ckpt
    scenarios = sorted({*TWO_BY_TWO, *ONE_BY_TWO, *AFTER_MODEL_PARALLEL} - {"gpt_by_hand"})
    run_script(SCRIPT, "--devices", "1", "--reference", "--out", str(out / "ref"), *common, *scenarios, timeout=600)
    return {"2x2": out / "2x2", "1x2": out / "1x2", "mp": out / "mp", "ref": out / "ref", "ckpt": checkpoints}


def load(results: dict[str, Path], run: str, scenario: str) -> dict[str, Any]:
    return torch.load(results[run] / f"{scenario}.pt", weights_only=False)


def assert_close(run: dict[str, Any], reference: dict[str, Any], loss_tol: float = LOSS_TOL) -> None:
    assert len(run["losses"]) == len(reference["losses"]) > 0
    assert run["losses"] == pytest.approx(reference["losses"], abs=loss_tol)
    assert max_weight_diff(run["weights"], reference["weights"]) < WEIGHT_TOL


@pytest.mark.parametrize("shape", ["2x2", "1x2"])
@pytest.mark.parametrize("model", BOTH)
def test_tensor_parallel_matches_one_process(results: dict[str, Path], model: str, shape: str) -> None:
    run, ref = load(results, shape, model), load(results, "ref", model)
    assert_close(run, ref)
    assert run["losses"][-1] < run["losses"][0], "the model should learn"
    # the initialisation rule: built on the meta device, split, sharded, then initialised - equal to the eager build
    assert max_weight_diff(run["start"], ref["start"]) == 0.0
    assert run["generated"] == ref["generated"]  # generate after fit, every rank calling it


def test_fabric_front_end(results: dict[str, Path]) -> None:
    # lightning_shard.fabric.ShardedStrategy(tensor_parallel_size=2): the same core, in a Fabric loop
    run, ref = load(results, "2x2", "fabric_gpt"), load(results, "ref", "fabric_gpt")
    assert_close(run, ref)
    assert max_weight_diff(run["start"], ref["start"]) == 0.0


@pytest.mark.parametrize("model", BOTH)
def test_tensor_parallel_equals_lightning_model_parallel_by_hand(results: dict[str, Path], model: str) -> None:
    ours, theirs = load(results, "2x2", model), load(results, "mp", model)
    assert ours["losses"] == pytest.approx(theirs["losses"], abs=1e-6)
    assert max_weight_diff(ours["weights"], theirs["weights"]) < 1e-6
    assert ours["parameter_bytes"] == theirs["parameter_bytes"]
    # the 2 x 2 ranks hold half of what the 1 x 2 ranks hold: FSDP shards the tensor-parallel pieces once more
    assert ours["parameter_bytes"] == [load(results, "1x2", model)["parameter_bytes"][0] // 2] * 4


def test_transformers_plan_splits_as_transformers_does(results: dict[str, Path]) -> None:
    placements = load(results, "2x2", "llama")["tensor_parallel_placements"]
    layer = "model.model.layers.0."
    assert placements[layer + "self_attn.q_proj.weight"] == "S(0)"
    assert placements[layer + "mlp.down_proj.weight"] == "S(1)"
    assert placements["model.model.embed_tokens.weight"] == "S(0)"  # the vocabulary
    assert placements["model.lm_head.weight"] == "S(0)"
    assert placements[layer + "input_layernorm.weight"] is None  # not in the plan: FSDP only


def test_clipping_over_both_dimensions_with_accumulation(results: dict[str, Path]) -> None:
    # gradient_clip_val=0.05 (active) and 2 micro-batches per step: the norm over the split layers' 2-D gradients and
    # the others' data-parallel ones together
    run, ref = load(results, "2x2", "gpt_clip_accumulate"), load(results, "ref", "gpt_clip_accumulate")
    assert len(run["losses"]) == 2 * MAX_STEPS
    assert_close(run, ref)
    assert max_weight_diff(run["weights"], load(results, "ref", "gpt")["weights"]) > 1e-3  # the clip changed them


def test_bf16_mixed(results: dict[str, Path]) -> None:
    # against one process under the same strategy and precision; bf16 rounding differs with the split matmuls'
    # partial sums (measured: losses within 1.4e-4)
    run, ref = load(results, "2x2", "gpt_bf16"), load(results, "ref", "gpt_bf16")
    assert run["losses"] == pytest.approx(ref["losses"], abs=2e-3)


def test_pretrained_weights_are_read_slice_by_slice(results: dict[str, Path]) -> None:
    run, ref = load(results, "2x2", "pretrained"), load(results, "ref", "pretrained")
    assert_close(run, ref)
    assert max_weight_diff(run["start"], ref["start"]) == 0.0  # transformers' own from_pretrained
    # each rank reads exactly its tensor-parallel x FSDP slice of every tensor (fp32: 4 bytes an element)
    assert run["elements_read"] == [size // 4 for size in run["parameter_bytes"]]


def test_a_loss_parallel_output_layer_keeps_the_logits_split(results: dict[str, Path]) -> None:
    # A dict plan with `"model.lm_head": "loss_parallel"`: the logits stay split over the vocabulary, the step's
    # cross-entropy runs under torch's loss_parallel() (all-reduces only, no gather of the logits; without it the
    # step fails: "aten.nll_loss_forward.default got mixed torch.Tensor and DTensor"), the backward too, and the loss
    # the step logs (a DTensor) and returns reaches Lightning as the plain value.
    run, ref = load(results, "1x2", "llama_loss_parallel"), load(results, "ref", "llama_loss_parallel")
    assert_close(run, ref)
    assert max_weight_diff(run["start"], ref["start"]) == 0.0
    assert run["logits_placements"] == "(Shard(dim=2),)" and ref["logits_placements"] == "None"
    assert set(run["loss_collectives"]) == {"all_reduce"}
    assert run["logged_loss"] == pytest.approx(run["losses"][-1], abs=1e-6)


def test_lora_adapters_follow_their_base_layer(results: dict[str, Path]) -> None:
    run, ref = load(results, "2x2", "lora"), load(results, "ref", "lora")
    assert_close(run, ref)
    placements = run["tensor_parallel_placements"]
    layer = "model.base_model.model.model.layers.0.self_attn."
    assert set(LORA_TARGETS) == {"q_proj", "v_proj", "o_proj"}
    # column-wise q_proj: base and B split by output features, A replicated over the tensor-parallel ranks
    assert placements[layer + "q_proj.base_layer.weight"] == "S(0)"
    assert placements[layer + "q_proj.lora_B.default.weight"] == "S(0)"
    assert placements[layer + "q_proj.lora_A.default.weight"] is None
    # row-wise o_proj: base and A split by input features, B replicated
    assert placements[layer + "o_proj.base_layer.weight"] == "S(1)"
    assert placements[layer + "o_proj.lora_A.default.weight"] == "S(1)"
    assert placements[layer + "o_proj.lora_B.default.weight"] is None


@pytest.mark.parametrize(("shape", "scenario"), [("2x2", "gpt_resume"), ("1x2", "gpt_resume"),
                                                 ("ref", "gpt_resume"), ("1x2", "gpt_resume_full"),
                                                 ("ref", "gpt_resume_mp")])  # fmt: skip
def test_checkpoints_resume_at_any_shape(results: dict[str, Path], shape: str, scenario: str) -> None:
    # The 2 x 2 run's sharded checkpoint at step 3, resumed at 2 x 2 (the same shape), 1 x 2 and by one process
    # ("ref": the sharded strategy on one process), and as a full file (`lightning-shard convert`), all against
    # Lightning's own single-device resume from that full file. "gpt_resume_mp": the checkpoint Lightning's
    # ModelParallelStrategy wrote at the same step of the same (bit-identical) run, with its optimizer states under
    # "optimizer_0" and the loops in "meta.pt" (before: KeyError "holds no optimizer states").
    run, lightning = load(results, shape, scenario), load(results, "ref", "gpt_resume_full")
    assert len(run["losses"]) == MAX_STEPS - SAVE_STEP
    assert max_weight_diff(run["start"], lightning["start"]) == 0.0  # what the resume loaded
    assert_close(run, lightning)


def test_a_configure_model_that_shards_by_hand_is_kept(results: dict[str, Path]) -> None:
    # parallelize_module + fully_shard in configure_model(), as for ModelParallelStrategy, under the sharded strategy:
    # kept as it is (not sharded twice), built on the meta device and initialised by the rule
    run, ref = load(results, "2x2", "gpt_by_hand"), load(results, "ref", "gpt")
    assert_close(run, ref)
    assert max_weight_diff(run["start"], ref["start"]) == 0.0
    assert run["parameter_bytes"] == load(results, "2x2", "gpt")["parameter_bytes"]


def test_litgpt_with_the_plan_lightning_shard_ships(results: dict[str, Path]) -> None:
    run, ref = load(results, "1x2", "litgpt"), load(results, "ref", "litgpt")
    assert_close(run, ref)
    assert max_weight_diff(run["start"], ref["start"]) == 0.0
    placements = run["tensor_parallel_placements"]
    assert placements["model.transformer.h.0.mlp.fc_1.weight"] == "S(0)"
    assert placements["model.transformer.h.0.mlp.proj.weight"] == "S(1)"
    assert placements["model.lm_head.weight"] == "S(0)"
    assert placements["model.transformer.h.0.attn.qkv.weight"] is None  # attention whole (module docstring)


def test_full_file_conversion_holds_the_sharded_checkpoint(results: dict[str, Path]) -> None:
    sharded = read_sharded_keys(results["ckpt"] / "gpt-4.ckpt", {"state_dict"})["state_dict"]
    full = torch.load(results["ckpt"] / "gpt-4-full.ckpt", weights_only=False)["state_dict"]
    assert max_weight_diff(sharded, full) == 0.0


def test_export_hf_of_a_tensor_parallel_checkpoint(results: dict[str, Path], tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    # "llama" saved a full checkpoint after fit from the 2 x 2 mesh
    out = tmp_path / "export"
    args = ["export-hf", str(results["ckpt"] / "llama-4.ckpt"), str(out), "--config"]
    assert cli_main([*args, str(results["ckpt"] / "llama-pretrained")]) == 0
    exported = AutoModelForCausalLM.from_pretrained(out).state_dict()
    trained = {name.removeprefix("model."): value for name, value in load(results, "2x2", "llama")["weights"].items()}
    assert max_weight_diff(exported, trained) == 0.0


def test_auto_sharding_with_tensor_parallelism(results: dict[str, Path]) -> None:
    run = load(results, "1x2", "gpt_auto")
    assert run["sharding_strategy"] == "NO_SHARD"  # the tiny model fits: the least communication
    assert_close(run, load(results, "ref", "gpt_auto"))


@pytest.mark.parametrize(("shape", "world_size"), [("2x2", 4), ("1x2", 2)])
def test_estimator_counts_each_ranks_share(results: dict[str, Path], shape: str, world_size: int) -> None:
    # the formula's parameter bytes per rank: the plan's split parameters / 2, sharded over the data-parallel ranks
    model = TinyGPT()
    model.configure_model()
    estimate = estimate_memory(model, world_size=world_size, tensor_parallel_size=2)
    assert [estimate.per_rank.params] * world_size == load(results, shape, "gpt")["parameter_bytes"]


# ------------------------------------------------------------------------------------------- without processes


def test_mesh_shapes_and_names() -> None:
    config = ShardingConfig(tensor_parallel_size=2)
    assert (config.mesh_shape(8, 4), config.mesh_dim_names(1)) == ((4,), ("shard", "tensor_parallel"))
    hybrid = ShardingConfig(sharding_strategy="HYBRID_SHARD", tensor_parallel_size=2)
    # a shard group: the data-parallel ranks of one node (8 devices / 2)
    assert hybrid.mesh_shape(16, 8) == (2, 4)
    assert hybrid.mesh_dim_names(2) == ("replicate", "shard", "tensor_parallel")
    assert ShardingConfig(sharding_strategy="NO_SHARD", tensor_parallel_size=4).mesh_shape(8, 8) == (2, 1)
    assert ShardingConfig().mesh_dim_names(1) == ("shard",)  # no tensor parallelism: the mesh as before
    with pytest.raises(ValueError, match="tensor_parallel_size=3` does not divide the world size 8"):
        ShardingConfig(tensor_parallel_size=3).mesh_shape(8, 8)


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"tensor_parallel_size": 0}, ValueError, "must be a positive int"),
        ({"tensor_parallel_size": True}, ValueError, "must be a positive int"),
        ({"tensor_parallel_plan": {"h.*.fc": "colwise"}}, ValueError, "`tensor_parallel_size=1` splits nothing"),
        ({"tensor_parallel_size": 2, "tensor_parallel_plan": "megatron"}, ValueError, "pass 'auto'"),
        ({"tensor_parallel_size": 2, "tensor_parallel_plan": {"h.*.fc": "col"}}, ValueError, "'col' is not a style"),
        ({"tensor_parallel_size": 2, "tensor_parallel_plan": {}}, TypeError, "non-empty dict"),
        ({"tensor_parallel_size": 2, "cpu_collectives": "shared_memory"}, ValueError, "keep the default 'gloo'"),
    ],
)
def test_settings_are_checked_when_the_strategy_is_built(kwargs: dict, error: type, match: str) -> None:
    with pytest.raises(error, match=match):
        ShardedStrategy(**kwargs)


def test_sampler_spans_the_data_parallel_ranks() -> None:
    # 4 ranks as 2 x 2: ranks 2 and 3 form the second tensor-parallel group and read the second data-parallel slice
    strategy = ShardedStrategy(tensor_parallel_size=2, parallel_devices=[torch.device("cpu")] * 4)
    trainer = L.Trainer(strategy=strategy, accelerator="cpu", devices=4, logger=False)
    trainer.strategy.cluster_environment.set_global_rank(3)
    assert trainer.strategy.distributed_sampler_kwargs == {"num_replicas": 2, "rank": 1}


class Tied(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(8, 4)
        self.head = nn.Linear(4, 8, bias=False)
        self.head.weight = self.embed.weight
        self.norm = nn.LayerNorm(4)


@pytest.mark.parametrize(
    ("plan", "match"),
    [
        ({"body.*.fc": "colwise"}, r"entry 'body.\*.fc' matches no module of Tied; its modules are named like"),
        ({"norm": "colwise"}, "`norm` is a LayerNorm; name its linear layers"),
        ({"head": "colwise"}, r"splits a weight tied between \['embed', 'head'\]"),
        ("auto", "found no tensor-parallel plan for Tied"),
    ],
)
def test_a_plan_that_does_not_fit_the_model_is_refused(plan: Any, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        resolve_plan(Tied(), plan, 2)


def test_estimate_of_the_13b_gpt_with_tensor_parallelism() -> None:
    # 16 ranks (2 nodes x 8) as 2 x 8: every block's linear layers and the vocabulary split 8 ways, FSDP over 2
    from examples.gpt.model import GPT

    with torch.device("meta"):
        model = GPT(n_layer=40, n_head=40, n_embd=5120, vocab_size=50272, block_size=2048)
        model.configure_model()
    dims = {"n_layer": 40, "n_embd": 5120, "n_head": 40, "seq_len": 2048, "micro_batch_size": 2, "vocab_size": 50272}
    common = {"world_size": 16, "num_nodes": 2, "precision": "bf16-mixed", "activation_checkpointing": True, **dims}
    fsdp = estimate_memory(model, **common)
    tp = estimate_memory(model, **common, tensor_parallel_size=8)
    whole = 12_853_463_040
    split = 40 * (12 * 5120**2 + 7 * 5120) + 50272 * 5120  # weights, the qkv and fc biases (3h + 4h), the vocabulary
    per_rank = (whole - split) + split // 8  # one tensor-parallel rank's parameters
    assert tp.n_params == fsdp.n_params == whole
    assert tp.per_rank.params == pytest.approx(4 * per_rank / 2, abs=8)  # fp32, sharded over 2 data-parallel ranks
    assert fsdp.per_rank.params == pytest.approx(4 * whole / 16, abs=8)
    # Korthikanti's tensor-parallel activations (10 + 24/8 instead of 34 s·b·h for the recomputed layer)
    assert tp.per_rank.activations < fsdp.per_rank.activations


def test_the_13b_tensor_parallel_config_builds_its_strategy() -> None:
    import yaml

    config = yaml.safe_load((Path(__file__).parents[1] / "configs" / "gpt3_13b_tp8.yaml").read_text())
    strategy = ShardedStrategy(**config["trainer"]["strategy"]["init_args"])
    assert (config["trainer"]["devices"], config["trainer"]["num_nodes"]) == (8, 2)
    assert strategy.config.mesh_shape(16, 8) == (2,)  # FSDP over one rank per node; 8-way splits inside the node
    assert strategy.config.mesh_dim_names(1) == ("shard", "tensor_parallel")


def test_the_gpt_example_refuses_a_size_that_does_not_divide_its_heads() -> None:
    from examples.gpt.model import GPT

    model = GPT(n_layer=1, n_head=6, n_embd=24, vocab_size=64, block_size=8)
    model.configure_model()
    assert [found.origin for found in resolve_plan(model, "auto", 2)] == ["GPT.tensor_parallel_plan"]
    with pytest.raises(ValueError, match="does not divide the GPT's n_head=6"):
        resolve_plan(model, "auto", 4)


@pytest.fixture(scope="module")
def tp_mesh():
    """A 2-rank tensor-parallel mesh on a fake process group (this process is rank 0; nothing is communicated):
    plans are applied to meta-device models, whose placements and checks need no values."""
    dist.init_process_group("fake", rank=0, world_size=2, store=memory_simulation_tools()["FakeStore"]())
    yield init_device_mesh("cpu", (2,), mesh_dim_names=("tensor_parallel",))
    dist.destroy_process_group()


def test_a_model_sharded_by_hand_in_part_is_refused(tp_mesh) -> None:
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    fully_shard(model[0], mesh=tp_mesh)  # the second layer and the root left out
    config = ShardingConfig()
    with pytest.raises(ValueError, match=r"applied `fully_shard` to part of Sequential by hand, leaving \['1.weight'"):
        parallelize_module(model, tp_mesh, config, mp_policy=MixedPrecisionPolicy(), offload_policy=OffloadPolicy(),
                           device=torch.device("cpu"))  # fmt: skip


def test_a_split_that_does_not_divide_is_refused(tp_mesh) -> None:
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(4, 5), nn.Linear(5, 4))
    with pytest.raises(ValueError, match=r"splits `0.weight` of shape \(5, 4\) along dimension 0 \(5\)"):
        apply_tensor_parallel_plan(model, tp_mesh, {"0": "colwise", "1": "rowwise"})


def test_a_parallelize_fn_that_splits_nothing_is_refused(tp_mesh) -> None:
    with torch.device("meta"):
        model = nn.Linear(4, 4)
    with pytest.raises(ValueError, match="parallelize_fn 'leave' split no parameter of Linear"):
        apply_tensor_parallel_plan(model, tp_mesh, lambda_named("leave"))


def lambda_named(name: str) -> Any:
    def parallelize_fn(model: nn.Module, mesh: Any) -> None:
        pass

    parallelize_fn.__name__ = name
    return parallelize_fn


def test_transformers_plan_checks_the_attention_heads(tp_mesh) -> None:
    transformers = pytest.importorskip("transformers")
    from hf_run import llama_config

    config = llama_config(num_attention_heads=4, num_key_value_heads=1)
    with meta_construction():
        model = transformers.AutoModelForCausalLM.from_config(config)
    with pytest.raises(ValueError, match=r"LlamaForCausalLM.tp_plan \(transformers\).*num_key_value_heads=1"):
        apply_tensor_parallel_plan(model, tp_mesh, "auto")


def test_dict_plan_on_an_embedding_and_a_sequence_parallel_norm(tp_mesh) -> None:
    with torch.device("meta"):
        model = Tied()
        model.head = nn.Linear(4, 8)  # untied
    apply_tensor_parallel_plan(model, tp_mesh, {"embed": "rowwise", "head": "colwise", "norm": "sequence_parallel"})
    assert model.embed.weight.placements == (Shard(0),)  # the vocabulary
    assert model.head.weight.placements == (Shard(0),)
    assert model.norm.weight.placements == (Replicate(),)
