"""LoRA (peft) and frozen parameters under the sharded strategy.

One 2-rank run (``tests/lora_run.py``, gloo) against one process (Lightning's single-device strategy, the same global
batches, every model built eagerly by transformers and peft), AdamW over all parameters: a tiny Llama and a tied
GPT-2, from a config and from pretrained files, built on the meta device in ``configure_model()`` and eagerly in
``__init__``. Measured: per-step losses within 9.6e-7 of one process, final weights within 1.4e-6; the meta build
equal to the eager build tensor by tensor (max difference 0.0; LoRA B zero); the frozen base equal to the files and
untouched by training; gradients and AdamW states for the LoRA tensors only (per rank: Llama 7 KiB of gradients, 14
KiB of AdamW states, for 177 KiB of frozen shards); small checkpoints (``save_frozen_pretrained_weights=False``:
adapters, optimizer and loops, the files recorded) resumed to Lightning's own one-process resume (losses within
4.8e-7), and refused when the files are missing or changed. Then what needs no processes: adapters computed from the
base (PiSSA, OLoRA, DoRA) and a user's module holding a transformers model with its own adapters and inits, each built
equal to the eager build; a tensor of the base held outside the model refused.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import run_script
from torch import nn
from torch.distributed.fsdp import MixedPrecisionPolicy, OffloadPolicy
from torch.distributed.tensor import DTensor

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")
from hf_run import llama_config  # noqa: E402
from lora_run import EPOCH_STEPS, FAMILIES, MAX_STEPS, SMALL_CHECKPOINT, lora_fields, write_checkpoints  # noqa: E402
from peft import LoraConfig, get_peft_model  # noqa: E402
from transformers import AutoModel, AutoModelForCausalLM  # noqa: E402

import lightning_shard.hf  # noqa: E402
from lightning_shard import ShardingConfig  # noqa: E402
from lightning_shard.cli import main as cli_main  # noqa: E402
from lightning_shard.hf.frozen_weights import RECORD_KEY  # noqa: E402
from lightning_shard.init.materialize import meta_construction  # noqa: E402
from lightning_shard.plan.parallelize import parallelize_module  # noqa: E402

TOL = 1e-5
SOURCES = ("config", "pretrained")
SCENARIOS = [f"{family}-{source}-{build}" for family in FAMILIES for source in SOURCES for build in ("meta", "eager")]
LORA = ("lora_A", "lora_B")


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("pretrained")
    write_checkpoints(root)
    return root


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory, checkpoints: Path) -> dict[str, Path]:
    out = tmp_path_factory.mktemp("lora")
    common = ["--checkpoints", str(checkpoints)]
    run_script("tests/lora_run.py", "--devices", "2", "--out", str(out / "two"), *common)
    run_script(
        "tests/lora_run.py", "--devices", "1", "--reference", "--out", str(out / "ref"), "--refuse", str(out / "two"),
        *common,
    )  # fmt: skip
    return {"two": out / "two", "ref": out / "ref"}


def load(results: dict[str, Path], scenario: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """The 2-rank result of ``scenario`` and the one-process reference (built eagerly) of its family and source."""
    family, source, _ = scenario.split("-")
    two = torch.load(results["two"] / f"{scenario}.pt", weights_only=False)
    ref = torch.load(results["ref"] / f"{family}-{source}-eager.pt", weights_only=False)
    return two, ref


def max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys(), f"names differ: {sorted(a.keys() ^ b.keys())}"
    return max((a[k].float() - b[k].float()).abs().max().item() for k in a)


def is_lora(name: str) -> bool:
    return any(part in name.split(".") for part in LORA)


# ---------------------------------------------------------------------------------------------- 2 ranks vs 1


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_two_ranks_match_one_process(results: dict[str, Path], scenario: str) -> None:
    two, ref = load(results, scenario)
    assert len(two["losses"]) == len(ref["losses"]) == MAX_STEPS
    assert two["losses"] == pytest.approx(ref["losses"], abs=TOL)
    assert max_diff(two["end"], ref["end"]) < TOL
    assert two["losses"][EPOCH_STEPS] < two["losses"][0], "the adapters should learn (the same batch, an epoch later)"


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_built_weights_equal_the_eager_build_with_lora_b_zero(results: dict[str, Path], scenario: str) -> None:
    # meta: built in configure_model() on the meta device, sharded, initialised by the construction's replay
    # (transformers' init for the base as it built it, peft's init for the adapters); reference: built eagerly
    two, ref = load(results, scenario)
    assert two["start"].keys() == ref["start"].keys()
    for key in ref["start"]:
        assert torch.equal(two["start"][key], ref["start"][key]), key
    lora_b = [key for key in two["start"] if ".lora_B." in key]
    assert lora_b and all(two["start"][key].eq(0).all() for key in lora_b)
    assert all(two["start"][key].abs().sum() > 0 for key in two["start"] if ".lora_A." in key)


@pytest.mark.parametrize("family", FAMILIES)
def test_frozen_base_equals_the_files_and_stays_frozen(
    results: dict[str, Path], checkpoints: Path, family: str
) -> None:
    from safetensors.torch import load_file

    on_disk = load_file(checkpoints / family / "model.safetensors")
    two, _ = load(results, f"{family}-pretrained-meta")
    compared = set()
    for key, value in two["start"].items():
        name = key.removeprefix("model.base_model.model.").replace(".base_layer.", ".")
        if name in on_disk:
            assert torch.equal(value, on_disk[name]), key
            compared.add(name)
    assert compared == on_disk.keys()  # every file tensor (GPT-2's head is its tied embedding)
    for key, value in two["end"].items():
        assert is_lora(key) or torch.equal(value, two["start"][key]), f"{key} changed: it is frozen"


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_frozen_parameters_get_no_gradient_and_no_optimizer_state(results: dict[str, Path], scenario: str) -> None:
    two, _ = load(results, scenario)
    adapters = sorted(key for key in two["start"] if is_lora(key))
    for rank in two["costs"]:
        # AdamW was given every parameter; FSDP2 reduce-scatters only the adapters' gradients
        assert rank["with_grad"] == rank["with_state"] == adapters
        assert rank["grad_bytes"] == rank["trainable_bytes"] > 0  # each rank its shard of the adapters' gradients
        assert rank["state_bytes"] == 2 * rank["trainable_bytes"]  # exp_avg and exp_avg_sq, nothing for the base
        assert rank["frozen_bytes"] > 10 * rank["trainable_bytes"]
    trainable = sum(value.numel() * value.element_size() for key, value in two["start"].items() if is_lora(key))
    assert sum(rank["trainable_bytes"] for rank in two["costs"]) == trainable  # sharded, not replicated


def test_tied_gpt2_embeddings_stay_tied(results: dict[str, Path]) -> None:
    for build in ("meta", "eager"):
        for source in SOURCES:
            assert load(results, f"gpt2-{source}-{build}")[0]["tied"] is True


# ---------------------------------------------------------------------------------------------- small checkpoints


@pytest.mark.parametrize("family", FAMILIES)
def test_small_checkpoint_holds_the_adapters_and_names_the_files(
    results: dict[str, Path], checkpoints: Path, family: str
) -> None:
    two, _ = load(results, f"{family}-pretrained-meta")
    path = Path(two["checkpoint"])
    base = checkpoints / family / "model.safetensors"
    if SMALL_CHECKPOINT[family] == "sharded":
        from lightning_shard.checkpoint.read import read_sharded_keys

        assert path.is_dir()
        checkpoint = read_sharded_keys(path)
    else:
        assert path.is_file()
        checkpoint = torch.load(path, weights_only=False)
    adapters = sorted(key for key in two["start"] if is_lora(key))
    assert sorted(checkpoint["state_dict"]) == adapters
    assert sorted(checkpoint["optimizer_states"][0]["state"]) == adapters
    record = checkpoint[RECORD_KEY]
    assert record["parameters"] == sorted(key for key in two["start"] if not is_lora(key))
    assert [(file["path"], file["size"]) for file in record["files"]] == [(str(base.resolve()), base.stat().st_size)]
    assert len(record["files"][0]["header_sha256"]) == len(record["files"][0]["content_sha256"]) == 64


@pytest.mark.parametrize("family", FAMILIES)
def test_resuming_a_small_checkpoint_equals_lightnings_own_resume(results: dict[str, Path], family: str) -> None:
    # reference: one process, Lightning's own checkpoint (every weight) and resume from the same epoch end
    two, ref = load(results, f"{family}-pretrained-meta")
    resumed = two["resumed"]
    assert len(resumed["losses"]) == MAX_STEPS - EPOCH_STEPS
    assert resumed["losses"] == pytest.approx(ref["resumed"]["losses"], abs=TOL)
    assert max_diff(resumed["start"], ref["resumed"]["start"]) < TOL
    for key in resumed["start"]:  # the base read from the files again, the adapters from the checkpoint
        assert is_lora(key) or torch.equal(resumed["start"][key], two["start"][key]), key


def test_resuming_refuses_missing_or_changed_files(results: dict[str, Path], checkpoints: Path) -> None:
    errors = torch.load(results["ref"] / "refusals.pt", weights_only=False)
    recorded = str((checkpoints / "llama" / "model.safetensors").resolve())
    # the base re-saved in bf16 under the same file name: another size and header
    assert "CheckpointIntegrityError" in errors["changed"]
    assert "changed since the checkpoint was saved: [" in errors["changed"]
    assert "llama-changed/model.safetensors (183016 bytes; the checkpoint's was 363872 bytes)" in errors["changed"]
    # another fine-tune of the same model: the same name, size and header (on main it resumed silently on it)
    finetuned = str((checkpoints / "llama-finetuned" / "model.safetensors").resolve())
    assert (
        f"{finetuned} (the same tensors with other values: another fine-tune of the same model?)"
        in (errors["finetuned"])
    )
    # the base re-saved in three files: the recorded one was not read
    assert f"missing (not read by this run): ['{recorded}']" in errors["missing"]
    # a model whose base came from a config
    assert "did not read 21 of them from pretrained files" in errors["not_pretrained"]


# ---------------------------------------------------------------------------------------------- export-hf of them

# The 2-rank run's last small checkpoints (step 10: the weights recorded at the end of training).
LAST = f"small-step={MAX_STEPS}.ckpt"
EXPORTS = [f"{family}-{how}" for family in FAMILIES for how in ("merged", "adapter")]


def _lora_config_file(results: dict[str, Path], family: str) -> Path:
    """The run's LoRA configuration for ``--lora-config`` (lora_run's module saves no hyper-parameters)."""
    path = results["two"] / f"{family}-lora.json"
    path.write_text(json.dumps(lora_fields(family)))
    return path


@pytest.fixture(scope="module")
def small_exports(results: dict[str, Path], checkpoints: Path) -> dict[str, Path]:
    """Each family's last small checkpoint (Llama sharded, GPT-2 full) exported by the CLI, merged and as an adapter,
    the base read from the pretrained directory given as ``--config``; name -> directory."""
    made = {}
    for family in FAMILIES:
        lora = _lora_config_file(results, family)
        for how, flag in (("merged", "--merge-lora"), ("adapter", "--adapter-only")):
            out = results["two"] / "exports" / f"{family}-{how}"
            args = [str(results["two"] / f"{family}-{LAST}"), str(out), "--config", str(checkpoints / family)]
            assert cli_main(["export-hf", *args, flag, "--lora-config", str(lora)]) == 0
            made[f"{family}-{how}"] = out
    return made


@pytest.fixture(scope="module")
def small_loaded(results: dict[str, Path], checkpoints: Path, small_exports: dict[str, Path]) -> dict[str, Any]:
    """Every export loaded in one process without lightning_shard (test_hf_export's loader): a merged one by plain
    transformers, an adapter by ``PeftModel.from_pretrained`` on the pretrained base."""
    from test_hf_export import LOADER

    torch.save(_input_ids(), results["two"] / "ids.pt")
    dirs = ",".join(
        f"{name}={path}" + (f"={checkpoints / name.split('-')[0]}" if name.endswith("adapter") else "")
        for name, path in small_exports.items()
    )
    run_script("-I", "-c", LOADER, dirs, str(results["two"] / "ids.pt"), str(results["two"] / "loaded.pt"))
    return torch.load(results["two"] / "loaded.pt", weights_only=False)


def _input_ids() -> torch.Tensor:
    return torch.randint(0, llama_config().vocab_size, (2, 12), generator=torch.Generator().manual_seed(1))


def _trained_logits(results: dict[str, Path], checkpoints: Path, family: str) -> torch.Tensor:
    """The logits of the model the 2-rank run trained: peft's model with the weights gathered at its end."""
    two, _ = load(results, f"{family}-pretrained-meta")
    base = AutoModelForCausalLM.from_pretrained(checkpoints / family)
    model = get_peft_model(base, LoraConfig(**lora_fields(family)))
    model.load_state_dict({key.removeprefix("model."): value for key, value in two["end"].items()})
    with torch.no_grad():
        return model.eval()(input_ids=_input_ids()).logits


@pytest.mark.parametrize("name", EXPORTS)
def test_small_checkpoint_exports_load_with_the_trained_logits(
    results: dict[str, Path], checkpoints: Path, small_loaded: dict[str, Any], name: str
) -> None:
    result = small_loaded["results"][name]
    assert small_loaded["imported"] == []
    assert all(not keys for keys in result["info"].values()), result["info"]  # no missing/unexpected/mismatched
    trained = _trained_logits(results, checkpoints, name.split("-")[0])
    difference = (result["logits"] - trained).abs().max().item()
    print(f"{name}: max |logits - trained| = {difference:.2e}")
    assert difference <= TOL
    assert result["tied"] is name.startswith("gpt2")


def test_a_merged_small_checkpoint_is_read_one_shard_at_a_time(
    results: dict[str, Path], checkpoints: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Memory as for any export: each read holds one output shard's tensors (the base ones from the files) plus the
    # adapters of the modules in it.
    from safetensors.torch import load_file
    from test_hf_export import recording_reads

    import lightning_shard.hf.export as export

    reads: list[int] = []
    monkeypatch.setattr(export, "with_base", recording_reads(export.with_base, reads))
    done = export.export_hf(
        results["two"] / f"llama-{LAST}", tmp_path / "out", checkpoints / "llama", merge_lora=True,
        lora_config=lora_fields("llama"), max_shard_size="20KB",
    )  # fmt: skip
    base = load_file(checkpoints / "llama" / "model.safetensors")
    largest = max(tensor.numel() * tensor.element_size() for tensor in base.values())  # the 32 KiB embedding
    two, _ = load(results, "llama-pretrained-meta")
    adapters = sum(value.numel() * value.element_size() for key, value in two["end"].items() if is_lora(key))
    assert len(done.files) == len(reads) > 4
    assert max(reads) <= max(20_000, largest) + adapters < done.total_bytes


def test_exporting_a_small_checkpoint_refuses_missing_or_changed_files(
    results: dict[str, Path], checkpoints: Path, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    checkpoint = results["two"] / f"llama-{LAST}"
    lora = ["--lora-config", str(_lora_config_file(results, "llama"))]
    args = ["export-hf", str(checkpoint), str(tmp_path / "out"), *lora]
    recorded = str((checkpoints / "llama" / "model.safetensors").resolve())
    # the base re-saved in bf16 under the same file name: another size and header
    assert cli_main([*args, "--config", str(checkpoints / "llama-changed"), "--merge-lora"]) == 2
    error = capsys.readouterr().err
    assert "changed since the checkpoint was saved: [" in error
    assert "llama-changed/model.safetensors (183016 bytes; the checkpoint's was 363872 bytes)" in error
    # another fine-tune of the same model: the same name, size and header
    assert cli_main([*args, "--config", str(checkpoints / "llama-finetuned"), "--merge-lora"]) == 2
    assert "llama-finetuned/model.safetensors (the same tensors with other values" in capsys.readouterr().err
    # the base re-saved in three files: the recorded one is not there
    resharded = checkpoints / "llama-resharded"
    assert cli_main([*args, "--config", str(resharded), "--merge-lora"]) == 2
    assert f"missing (not in {resharded}): ['{recorded}']" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()
    # the adapter alone needs no base
    assert cli_main([*args, "--config", str(resharded), "--adapter-only"]) == 0


# ---------------------------------------------------------------------------------------------- no processes


def _build_and_shard(make: Any, mesh: Any) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """``make()`` built eagerly and on the meta device (then sharded and materialised), from the same seed."""
    torch.manual_seed(0)
    eager = make().state_dict()
    torch.manual_seed(0)  # the construction draws from the stream as it was where the construction ran
    with meta_construction():
        lazy = make()
    parallelize_module(
        lazy, mesh, ShardingConfig(auto_wrap_policy=None), mp_policy=MixedPrecisionPolicy(),
        offload_policy=OffloadPolicy(), device=torch.device("cpu"),
    )  # fmt: skip
    built = {k: v.full_tensor() if isinstance(v, DTensor) else v for k, v in lazy.state_dict().items()}
    return eager, built


class _Adapter(nn.Module):
    """A user's own low-rank adapter around a Linear of a transformers model (B zero, as LoRA)."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.inner = linear
        self.down = nn.Linear(linear.in_features, 4, bias=False)
        self.up = nn.Linear(4, linear.out_features, bias=False)
        nn.init.zeros_(self.up.weight)


class _Classifier(nn.Module):
    """A user's module holding a transformers model: heads before and after it, initialised after their
    construction (``trunc_normal_``, which does nothing to a meta tensor on torch 2.13), and adapters put into it."""

    def __init__(self) -> None:
        super().__init__()
        self.pre = nn.Linear(64, 5)
        self.backbone = AutoModel.from_config(llama_config())
        self.head = nn.Linear(64, 3)
        nn.init.trunc_normal_(self.pre.weight, std=0.02)
        nn.init.zeros_(self.head.weight)
        attention = self.backbone.layers[0].self_attn
        attention.q_proj = _Adapter(attention.q_proj)


def test_users_module_holding_a_transformers_model_is_built_as_eagerly(mesh) -> None:
    eager, built = _build_and_shard(_Classifier, mesh)
    assert eager.keys() == built.keys()
    for key in eager:
        assert torch.equal(built[key], eager[key]), key
    assert built["head.weight"].eq(0).all() and built["backbone.layers.0.self_attn.q_proj.up.weight"].eq(0).all()


@pytest.mark.parametrize(
    "adapters", [{"init_lora_weights": "pissa"}, {"init_lora_weights": "olora"}, {"use_dora": True}], ids=str
)
def test_adapters_computed_from_the_base_are_built_as_eagerly(mesh, adapters: dict[str, Any]) -> None:
    # PiSSA (SVD) and OLoRA (QR) compute A and B from the base weight and replace it by the residual; DoRA's magnitude
    # is its norm: replayed on the base weight as transformers' init left it
    def make() -> nn.Module:
        config = LoraConfig(r=4, target_modules=["q_proj", "v_proj"], **adapters)
        return get_peft_model(AutoModelForCausalLM.from_config(llama_config()), config)

    eager, built = _build_and_shard(make, mesh)
    assert eager.keys() == built.keys()
    for key in eager:
        assert torch.equal(built[key], eager[key]), key


def test_a_base_tensor_not_in_the_files_is_refused_through_peft(checkpoints: Path, tmp_path: Path) -> None:
    from safetensors.torch import load_file, save_file

    (tmp_path / "config.json").write_text((checkpoints / "llama" / "config.json").read_text())
    tensors = load_file(checkpoints / "llama" / "model.safetensors")
    save_file(
        {k: v for k, v in tensors.items() if "layers.1.self_attn.q_proj" not in k}, tmp_path / "model.safetensors"
    )
    with pytest.raises(ValueError, match=r"does not fill 1 tensors.*layers.1.self_attn.q_proj.weight"):
        with meta_construction():
            base = lightning_shard.hf.from_pretrained(AutoModelForCausalLM, tmp_path)
            get_peft_model(base, LoraConfig(r=4, target_modules=["q_proj"]))


def test_a_base_tensor_held_outside_the_model_is_refused(checkpoints: Path, mesh) -> None:
    # a head sharing the pretrained head's storage but not its parameter: sharded, they would part ways
    class Wrapper(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lm = lightning_shard.hf.from_pretrained(AutoModelForCausalLM, checkpoints / "llama")
            self.head = nn.Linear(64, 128, bias=False)
            self.head.weight = nn.Parameter(self.lm.lm_head.weight.data)

    with meta_construction():
        model = Wrapper()
    with pytest.raises(TypeError, match=r"\['Linear.weight'\] hold tensors that a library's model built"):
        parallelize_module(
            model, mesh, ShardingConfig(auto_wrap_policy=None), mp_policy=MixedPrecisionPolicy(),
            offload_policy=OffloadPolicy(), device=torch.device("cpu"),
        )  # fmt: skip


def test_pretrained_files_are_recognised_by_content_and_older_records_still_load(tmp_path: Path) -> None:
    from safetensors.torch import save_file

    from lightning_shard.checkpoint.integrity import CheckpointIntegrityError
    from lightning_shard.hf.frozen_weights import PretrainedFile, check_recorded_files, checkpoint_record

    def written(name: str, last: float) -> PretrainedFile:
        weights = {"embed": torch.zeros(8192), "norm": torch.ones(8)}
        weights["embed"][-1] = last  # the end of a 32 KiB tensor: one of the sampled blocks
        (tmp_path / name).mkdir()
        save_file(weights, tmp_path / name / "model.safetensors", {"format": "pt"})
        return PretrainedFile.of(tmp_path / name / "model.safetensors")

    base, other = written("base", 0.0), written("other", 1.0)
    assert (other.size, other.header_sha256) == (base.size, base.header_sha256) != ("", "")
    record = checkpoint_record({"model.embed": (base,), "model.norm": (base,)})
    check = {"missing_means": "not read by this run", "fix": "Read the original files."}
    check_recorded_files("last.ckpt", record, [written("same", 0.0)], **check)
    with pytest.raises(CheckpointIntegrityError, match=r"other/model.safetensors \(the same tensors with other values"):
        check_recorded_files("last.ckpt", record, [other], **check)
    # A record written before the content hash: checked by name, size and header, with a warning.
    older = {**record, "files": [{k: v for k, v in f.items() if k != "content_sha256"} for f in record["files"]]}
    with pytest.warns(UserWarning, match="saved by an older lightning-shard, which recorded the pretrained files by"):
        check_recorded_files("last.ckpt", older, [other], **check)


def _small_checkpoint(model: nn.Module, files: Path, path: Path) -> None:
    """A full checkpoint of ``self.model = model`` as ``save_frozen_pretrained_weights=False`` writes it: the
    trainable parameters, and the record of the frozen ones left out, read from the safetensors files in ``files``."""
    from lightning_shard.hf.frozen_weights import PretrainedFile, checkpoint_record

    read = tuple(PretrainedFile.of(file) for file in sorted(files.glob("*.safetensors")))
    named = dict(model.named_parameters(remove_duplicate=False))
    state = {f"model.{name}": param.detach() for name, param in named.items() if param.requires_grad}
    left_out = {f"model.{name}": read for name, param in named.items() if not param.requires_grad}
    torch.save({"state_dict": state, RECORD_KEY: checkpoint_record(left_out)}, path)


def test_a_small_checkpoint_of_a_converted_layout_exports_merged_and_plain(tmp_path: Path) -> None:
    # Mixtral's files hold per-expert tensors that transformers fuses on load (mlp.experts.gate_up_proj): the small
    # checkpoint leaves the fused experts out, and the export reads them through the same conversion. References:
    # the models as built and changed here, in this process.
    from hf_run import mixtral_config
    from safetensors import safe_open

    from lightning_shard.hf import export_hf

    torch.manual_seed(0)
    pretrained = tmp_path / "mixtral"
    AutoModelForCausalLM.from_config(mixtral_config()).save_pretrained(pretrained)
    lora = {"r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj"]}
    peft_model = get_peft_model(AutoModelForCausalLM.from_pretrained(pretrained), LoraConfig(**lora))
    plain = AutoModelForCausalLM.from_pretrained(pretrained)  # only the q projections trained
    with torch.no_grad():
        for model, trained in ((peft_model, "lora_"), (plain, "q_proj")):
            for name, param in model.named_parameters():
                param.requires_grad_(trained in name)
                if param.requires_grad:
                    param.add_(torch.randn_like(param) * 0.1)  # as training changes them
    with safe_open(pretrained / "model.safetensors", "pt") as file:
        assert "model.layers.0.block_sparse_moe.experts.0.w1.weight" in file.keys()  # converted on load
    assert "model.layers.0.mlp.experts.gate_up_proj" in plain.state_dict()
    ids = _input_ids()
    for name, model, extra in (("merged", peft_model, {"merge_lora": True, "lora_config": lora}), ("plain", plain, {})):
        _small_checkpoint(model, pretrained, tmp_path / f"{name}.ckpt")
        export_hf(tmp_path / f"{name}.ckpt", tmp_path / name, pretrained, **extra)
        with torch.no_grad():
            exported = AutoModelForCausalLM.from_pretrained(tmp_path / name).eval()(input_ids=ids).logits
            trained = model.eval()(input_ids=ids).logits
        difference = (exported - trained).abs().max().item()
        print(f"mixtral {name}: max |logits - trained| = {difference:.2e}")
        assert difference <= TOL


# ---------------------------------------------------------------------------------------------- the example


def test_lora_example_trains_the_adapters_and_saves_small_checkpoints(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import csv
    import os
    import shlex
    import subprocess
    import sys

    from conftest import REPO
    from test_hf_example import SHORT_RUN, _pretrained_loss_on_first_batches

    (tmp_path / "short.yaml").write_text(SHORT_RUN)
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    config = REPO / "configs" / "hf_llama_tiny_lora.yaml"
    command = [sys.executable, str(REPO / "examples/hf/finetune.py"), "fit", "--config", str(config)]
    run = subprocess.run(
        [*command, "--config", "short.yaml"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert "--merge-lora" in run.stdout and "--adapter-only" in run.stdout
    pretrained, out = tmp_path / "out/hf_llama_tiny/pretrained", tmp_path / "out/hf_llama_tiny_lora"
    with open(out / "logs/version_0/metrics.csv") as f:
        losses = {int(row["step"]): float(row["train_loss"]) for row in csv.DictReader(f) if row["train_loss"]}
    # LoRA B starts at zero: the first loss is the pretrained model's own
    assert abs(losses[0] - _pretrained_loss_on_first_batches(pretrained)) <= 1e-4
    assert sorted(losses) == list(range(6)) and losses[5] < losses[0]
    from lightning_shard.checkpoint.read import read_sharded_keys

    checkpoint = read_sharded_keys(out / "checkpoints/last.ckpt", {"state_dict", RECORD_KEY})
    assert checkpoint["state_dict"] and all(is_lora(key) for key in checkpoint["state_dict"])
    assert [file["path"] for file in checkpoint[RECORD_KEY]["files"]] == [str(pretrained / "model.safetensors")]
    # the export commands it prints, as printed (the LoRA configuration from the run's hyper-parameters, the base
    # from --config): the merged model and the base with the adapter compute the same logits
    monkeypatch.chdir(tmp_path)
    exports = [shlex.split(line)[1:] for line in run.stdout.splitlines() if line.strip().startswith("lightning-shard")]
    assert len(exports) == 2 and all(cli_main(command) == 0 for command in exports)
    ids = _input_ids()
    with torch.no_grad():
        merged = AutoModelForCausalLM.from_pretrained(out / "merged").eval()(input_ids=ids).logits
        base = AutoModelForCausalLM.from_pretrained(pretrained)
        adapter = peft.PeftModel.from_pretrained(base, out / "adapter").eval()(input_ids=ids).logits
    assert (merged - adapter).abs().max().item() <= TOL
