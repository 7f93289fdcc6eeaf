"""``lightning-shard export-hf``: checkpoints of tiny HF models trained on 2 ranks become directories that plain
``transformers`` (and peft) load, with the trained model's logits.

The reference is the trained HF model's full state dict (gathered to rank 0 by the run) loaded into the model built
from the same config; the export is loaded by ``AutoModelForCausalLM.from_pretrained`` in a process where
lightning_shard cannot be imported. Models: a tiny Llama (attribute ``model``) and a tiny GPT-2 with tied
embeddings (attribute ``lm``), 2 steps of AdamW each (``tests/hf_export_run.py``). The Llama run also trains a LoRA
Llama (attribute ``lora``: peft adapters on q/v and a trained copy of ``lm_head``), exported merged
(``--merge-lora``, loaded by ``from_pretrained``) and as an adapter (``--adapter-only``, loaded by
``PeftModel.from_pretrained`` on the base the run started from); its reference is the peft model with the run's
gathered weights.
"""

from __future__ import annotations

import ast
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import REPO, run_script
from hf_export_run import LORA
from hf_run import VOCAB

from lightning_shard.cli import main as cli_main

pytest.importorskip("transformers", reason="the [hf] extra (transformers) is not installed")

TOL = 1e-5
MERGE_TOL = 1e-5  # the merged weight W + s B A is rounded once in fp32; measured 2.1e-7
KINDS = ("llama", "gpt2")
FORMATS = ("sharded", "full")
PREFIX = {"llama": "model.", "gpt2": "lm."}
SMALL_SHARDS = "40KB"  # the tiny models are ~140 KB: several files and an index


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("hf_runs")
    for kind in KINDS:
        run_script("tests/hf_export_run.py", kind, "--out", str(out / kind), timeout=240)
    return out


@pytest.fixture(scope="module")
def exports(runs: Path) -> dict[str, Path]:
    """Every model x format through the CLI, plus multi-file exports; name -> output directory."""
    made = {}
    for kind in KINDS:
        for fmt in FORMATS:
            made[f"{kind}-{fmt}"] = _export(runs, kind, fmt)
        made[f"{kind}-sharded-small"] = _export(runs, kind, "sharded", "--max-shard-size", SMALL_SHARDS)
    made["gpt2-full-small"] = _export(runs, "gpt2", "full", "--max-shard-size", SMALL_SHARDS)
    # LoRA: the configuration from the checkpoint's hyper-parameters (sharded) or from a file (full)
    lora_config = runs / "lora_config"
    _peft().LoraConfig(**LORA).save_pretrained(lora_config)
    base = runs / "llama" / "lora_base"
    merged = ("--config", str(base), "--merge-lora")
    made["lora-merged-sharded"] = _export(runs, "llama", "sharded", *merged, "--max-shard-size", "20KB", name="merged")
    made["lora-merged-full"] = _export(runs, "llama", "full", *merged, "--lora-config", str(lora_config), name="merged")
    adapter = ("--config", str(base), "--adapter-only")
    made["lora-adapter-sharded"] = _export(runs, "llama", "sharded", *adapter, name="adapter")
    made["lora-adapter-full"] = _export(
        runs, "llama", "full", *adapter, "--lora-config", str(lora_config / "adapter_config.json"), name="adapter"
    )
    return made


def _peft() -> Any:
    return pytest.importorskip("peft", reason="peft is not installed")


def _export(runs: Path, kind: str, fmt: str, *extra: str, name: str = "") -> Path:
    out = runs / "exports" / f"{kind}-{fmt}{'-small' if extra else ''}{name}"
    config = () if "--config" in extra else ("--config", str(runs / kind / "config"))
    assert cli_main(["export-hf", str(runs / kind / f"{fmt}.ckpt"), str(out), *config, *extra]) == 0
    return out


# Loads every export in one process that cannot import lightning_shard (blocked, and -I: no PYTHONPATH, no cwd): a
# model directory with transformers, an adapter (`name=dir=base_dir`) with peft on the base model.
LOADER = """
import sys, torch
sys.modules["lightning_shard"] = None
from transformers import AutoModelForCausalLM
dirs, ids, result_file = sys.argv[1].split(","), torch.load(sys.argv[2]), sys.argv[3]
results = {}
for name_dir in dirs:
    name, path, *base = name_dir.split("=")
    model, info = AutoModelForCausalLM.from_pretrained(base[0] if base else path, output_loading_info=True)
    if base:
        from peft import PeftModel
        model = PeftModel.from_pretrained(model, path)
    with torch.no_grad():
        logits = model.eval()(input_ids=ids).logits
    tied = model.get_output_embeddings().weight is model.get_input_embeddings().weight
    results[name] = {"logits": logits, "info": {k: sorted(map(str, v)) for k, v in info.items()}, "tied": tied}
imported = sorted(m for m in sys.modules if m.startswith("lightning_shard") and sys.modules[m] is not None)
torch.save({"results": results, "imported": imported}, result_file)
"""


@pytest.fixture(scope="module")
def loaded(runs: Path, exports: dict[str, Path]) -> dict[str, Any]:
    ids = _input_ids()
    torch.save(ids, runs / "ids.pt")
    base = runs / "llama" / "lora_base"
    dirs = ",".join(f"{name}={path}" + (f"={base}" if "adapter" in name else "") for name, path in exports.items())
    run_script("-I", "-c", LOADER, dirs, str(runs / "ids.pt"), str(runs / "loaded.pt"), cwd=runs)
    return torch.load(runs / "loaded.pt", weights_only=False)


def _input_ids() -> torch.Tensor:
    return torch.randint(0, VOCAB, (2, 12), generator=torch.Generator().manual_seed(1))


def _reference_logits(runs: Path, kind: str) -> torch.Tensor:
    with torch.no_grad():
        return _reference_model(runs, kind).eval()(input_ids=_input_ids()).logits


def _reference_model(runs: Path, kind: str) -> torch.nn.Module:
    """The trained model: the HF model of ``kind`` (or, for ``"lora"``, the peft model) with the run's weights."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config_dir = runs / "llama" / "lora_base" if kind == "lora" else runs / kind / "config"
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(config_dir))
    if kind == "lora":
        model = _peft().get_peft_model(model, _peft().LoraConfig(**LORA))
    model.load_state_dict(torch.load(runs / ("llama/lora_weights.pt" if kind == "lora" else f"{kind}/weights.pt")))
    return model


@pytest.mark.parametrize(
    "name",
    [
        "llama-sharded",
        "llama-full",
        "gpt2-sharded",
        "gpt2-full",
        "llama-sharded-small",
        "gpt2-sharded-small",
        "gpt2-full-small",
    ],
)
def test_export_loads_in_plain_transformers_with_the_trained_logits(
    runs: Path, loaded: dict[str, Any], name: str
) -> None:
    result = loaded["results"][name]
    assert all(not keys for keys in result["info"].values()), result["info"]  # no missing/unexpected/mismatched
    reference = _reference_logits(runs, name.split("-")[0])
    assert (result["logits"] - reference).abs().max().item() <= TOL
    assert loaded["imported"] == []


@pytest.mark.parametrize(
    "name", ["lora-merged-sharded", "lora-merged-full", "lora-adapter-sharded", "lora-adapter-full"]
)
def test_lora_exports_load_with_the_trained_logits(runs: Path, loaded: dict[str, Any], name: str) -> None:
    # merged: plain transformers; adapter: peft's PeftModel.from_pretrained on the base the run started from
    result = loaded["results"][name]
    assert all(not keys for keys in result["info"].values()), result["info"]
    difference = (result["logits"] - _reference_logits(runs, "lora")).abs().max().item()
    assert difference <= (MERGE_TOL if "merged" in name else 0.0), difference
    assert loaded["imported"] == []


def test_the_lora_run_trained_adapters_on_a_frozen_base(runs: Path) -> None:
    # The base directory the adapters are loaded on is what the run started from and never changed; the adapters
    # and the trained head moved (otherwise equal logits would prove nothing).
    from safetensors.torch import load_file

    trained = torch.load(runs / "llama" / "lora_weights.pt")
    base = load_file(runs / "llama" / "lora_base" / "model.safetensors")
    prefix = "base_model.model."
    frozen = {k: v for k, v in trained.items() if "lora_" not in k and "modules_to_save" not in k}
    for key, value in frozen.items():
        name = key.removeprefix(prefix).replace(".base_layer.", ".").replace(".original_module.", ".")
        assert torch.equal(value, base[name]), key
    assert len(frozen) == len(base)
    assert min(v.abs().max().item() for k, v in trained.items() if "lora_B" in k) > 1e-3  # B starts at zero
    head = trained[prefix + "lm_head.modules_to_save.default.weight"]
    assert (head - base["lm_head.weight"]).abs().max().item() > 1e-3


def test_the_adapter_is_what_peft_saves_of_the_trained_model(
    runs: Path, exports: dict[str, Path], tmp_path: Path
) -> None:
    from safetensors import safe_open
    from safetensors.torch import load_file

    reference = _reference_model(runs, "lora")
    reference.save_pretrained(tmp_path / "peft")
    expected = load_file(tmp_path / "peft" / "adapter_model.safetensors")
    expected_config = _adapter_config(tmp_path / "peft")
    for name in ("lora-adapter-sharded", "lora-adapter-full"):
        out = exports[name]
        assert {p.name for p in out.iterdir()} == {"adapter_config.json", "adapter_model.safetensors", "README.md"}
        written = load_file(out / "adapter_model.safetensors")
        assert sorted(written) == sorted(expected) and len(written) == 2 * 2 * 2 + 1  # A, B of q, v in 2 layers; head
        assert all(torch.equal(written[k], expected[k]) for k in expected)
        with safe_open(out / "adapter_model.safetensors", "pt") as file:
            assert file.metadata() == {"format": "pt"}
        # peft's own, also where the base came from (peft takes the base model's name_or_path)
        config = _adapter_config(out)
        assert config == expected_config and config["base_model_name_or_path"] == str(runs / "llama" / "lora_base")


def _adapter_config(directory: Path) -> dict[str, Any]:
    """A peft ``adapter_config.json``; ``target_modules`` sorted: peft keeps them as a set and writes it in the set's
    order, which depends on how it was built and on the strings' hashes (one run in a few wrote v_proj first)."""
    config = json.loads((directory / "adapter_config.json").read_text())
    return {**config, "target_modules": sorted(config["target_modules"])}


def recording_reads(open_source: Callable[..., Any], reads: list[int]) -> Callable[..., Any]:
    """``open_source`` (one of the export's functions that return its checkpoint ``CheckpointWeights``), whose
    sources add the bytes of each read to ``reads``."""

    def recording(*args: Any) -> Any:
        source = open_source(*args)
        read = source.read

        def read_and_record(keys: dict[str, str]) -> Any:
            reads.append(sum(source.shapes[k].numel() * source.dtypes[k].itemsize for k in keys))
            return read(keys)

        source.read = read_and_record
        return source

    return recording


def test_a_merged_export_reads_one_shard_and_its_adapters_at_a_time(
    runs: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Memory as for any export: each read holds one output shard's weights plus the adapters of the modules in it.
    import lightning_shard.hf.export as export

    reads: list[int] = []
    monkeypatch.setattr(export, "open_checkpoint", recording_reads(export.open_checkpoint, reads))
    done = export.export_hf(
        runs / "llama" / "sharded.ckpt",
        tmp_path / "out",
        runs / "llama" / "lora_base",
        merge_lora=True,
        max_shard_size="20KB",
    )
    adapters = sum(v.numel() * 4 for k, v in torch.load(runs / "llama" / "lora_weights.pt").items() if "lora_" in k)
    head = 128 * 64 * 4  # lm_head and its trained copy: the largest tensor, 32 KiB, alone in its shard
    assert len(done.files) == len(reads) > 4
    assert max(reads) <= 2 * head + adapters < done.total_bytes


def test_lora_configuration_errors(runs: Path, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    ckpt, base = runs / "llama" / "full.ckpt", runs / "llama" / "lora_base"
    # a checkpoint of the LoRA model alone, without the hyper-parameters that name its configuration
    checkpoint = torch.load(ckpt, weights_only=False)
    lora_only = {k: v for k, v in checkpoint["state_dict"].items() if k.startswith("lora.")}
    torch.save({"state_dict": lora_only}, tmp_path / "lora.ckpt")
    args = ["export-hf", str(tmp_path / "lora.ckpt"), str(tmp_path / "out"), "--config", str(base)]
    assert cli_main(args) == 2
    assert "It holds LoRA adapters (lora.base_model.model.model.layers.0.self_attn.q_proj.lora_A" in (
        capsys.readouterr().err
    )
    assert cli_main([*args, "--merge-lora"]) == 2
    assert "Its hyper-parameters hold none. Pass `--lora-config`" in capsys.readouterr().err
    # a configuration other than the run's: other shapes, or other modules
    for fields, message in (
        (
            {**LORA, "r": 8},
            "base_model.model.model.layers.0.self_attn.q_proj.lora_A.default.weight: checkpoint "
            "(4, 64) vs model (8, 64)",
        ),
        ({**LORA, "target_modules": ["k_proj"]}, "It holds LoRA adapters"),
    ):
        (tmp_path / "lora.json").write_text(json.dumps(fields))
        assert cli_main([*args, "--adapter-only", "--lora-config", str(tmp_path / "lora.json")]) == 2
        assert message in capsys.readouterr().err
    assert cli_main([*args[:3], "--config", str(runs / "llama" / "config"), "--lora-config", "x.json"]) == 2
    assert "goes with `--merge-lora` or `--adapter-only`" in capsys.readouterr().err
    assert cli_main([*args, "--adapter-only", "--dtype", "bfloat16"]) == 2
    assert "--dtype: the adapter is written in one file, in the checkpoint's dtype" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_a_merge_that_would_untie_tied_weights_is_refused() -> None:
    # GPT-2's lm_head is saved as transformer.wte.weight; a trained copy of lm_head alone cannot be written so.
    from hf_run import gpt2_config
    from transformers import AutoModelForCausalLM

    from lightning_shard.hf.peft_export import PeftLayout
    from lightning_shard.hf.weight_names import saved_names

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(gpt2_config())
    config = _peft().LoraConfig(r=4, target_modules=["c_attn"], modules_to_save=["lm_head"])
    with pytest.raises(ValueError, match="change transformer.wte.weight and its tied copy lm_head.weight differently"):
        PeftLayout.build(model, saved_names(model), config)


def test_the_dtype_written_is_the_one_config_json_names(runs: Path, tmp_path: Path) -> None:
    # A bf16 model (config.json: "dtype": "bfloat16") fine-tuned with fp32 weights in the checkpoint, as under
    # "bf16-mixed": the export is bf16, as the original's save_pretrained writes it, unless asked to keep fp32.
    from safetensors.torch import load_file
    from transformers import AutoConfig, AutoModelForCausalLM

    from lightning_shard.hf import export_hf

    config = json.loads((runs / "llama" / "config" / "config.json").read_text())
    (tmp_path / "bf16").mkdir()
    (tmp_path / "bf16" / "config.json").write_text(json.dumps({**config, "dtype": "bfloat16"}))
    ckpt = runs / "llama" / "sharded.ckpt"
    trained = torch.load(runs / "llama" / "weights.pt")
    default = export_hf(ckpt, tmp_path / "default", tmp_path / "bf16")
    kept = export_hf(ckpt, tmp_path / "kept", tmp_path / "bf16", dtype="checkpoint")
    for out, dtype in ((default.out_dir, torch.bfloat16), (kept.out_dir, torch.float32)):
        written = load_file(out / "model.safetensors")
        assert {t.dtype for t in written.values()} == {dtype}
        assert all(torch.equal(written[k], trained[k].to(dtype)) for k in written)
        assert AutoConfig.from_pretrained(out).dtype == dtype
        assert AutoModelForCausalLM.from_pretrained(out).dtype == dtype
    assert default.total_bytes == kept.total_bytes // 2
    # config.json is copied as it is when it names the dtype written, rewritten by transformers when not
    assert (default.out_dir / "config.json").read_text() == (tmp_path / "bf16" / "config.json").read_text()
    assert json.loads((kept.out_dir / "config.json").read_text())["dtype"] == "float32"
    # merged LoRA weights are merged in the checkpoint's fp32, then cast
    merged = export_hf(ckpt, tmp_path / "merged", runs / "llama" / "lora_base", merge_lora=True, dtype="bfloat16")
    merged32 = export_hf(ckpt, tmp_path / "merged32", runs / "llama" / "lora_base", merge_lora=True)
    bf16, fp32 = load_file(merged.out_dir / "model.safetensors"), load_file(merged32.out_dir / "model.safetensors")
    assert all(torch.equal(bf16[k], fp32[k].to(torch.bfloat16)) for k in fp32)
    with pytest.raises(ValueError, match="dtype='int8'"):
        export_hf(ckpt, tmp_path / "int8", tmp_path / "bf16", dtype="int8")


def test_the_trained_weights_differ_from_initialisation(runs: Path) -> None:
    # Otherwise "the trained logits" would prove nothing about which weights were exported.
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    fresh = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(runs / "llama" / "config")).state_dict()
    trained = torch.load(runs / "llama" / "weights.pt")
    assert max((fresh[k] - trained[k]).abs().max().item() for k in trained) > 1e-3


def test_tied_embeddings_are_saved_once_and_tied_on_load(exports: dict[str, Path], loaded: dict[str, Any]) -> None:
    from safetensors import safe_open

    for name in ("gpt2-sharded", "gpt2-full"):
        with safe_open(exports[name] / "model.safetensors", "pt") as weights:
            keys = set(weights.keys())
            assert weights.metadata() == {"format": "pt"}
        assert "transformer.wte.weight" in keys and "lm_head.weight" not in keys
        assert loaded["results"][name]["tied"]
    assert not loaded["results"]["llama-sharded"]["tied"]  # Llama's embeddings are not tied by default


def test_small_shards_come_with_an_index_like_save_pretrained(exports: dict[str, Path]) -> None:
    from safetensors import safe_open

    out = exports["llama-sharded-small"]
    index = json.loads((out / "model.safetensors.index.json").read_text())
    files = sorted(p.name for p in out.glob("*.safetensors"))
    assert len(files) > 1 and files[0] == f"model-00001-of-{len(files):05d}.safetensors"
    assert sorted(set(index["weight_map"].values())) == files
    total = 0
    for file in files:
        with safe_open(out / file, "pt") as weights:
            sizes = [weights.get_slice(k).get_shape() for k in weights.keys()]
            assert {k for k, f in index["weight_map"].items() if f == file} == set(weights.keys())
        total += sum(4 * torch.Size(shape).numel() for shape in sizes)
    assert index["metadata"]["total_size"] == total
    assert {p.name for p in out.iterdir()} == {*files, "model.safetensors.index.json", "config.json"}
    single = exports["llama-sharded"]
    assert {p.name for p in single.iterdir()} == {"model.safetensors", "config.json"}


def test_the_prefix_is_found_from_the_model_names(runs: Path, tmp_path: Path) -> None:
    from lightning_shard.hf import export_hf

    for kind in KINDS:
        done = export_hf(runs / kind / "sharded.ckpt", tmp_path / kind, runs / kind / "config")
        assert done.prefix == PREFIX[kind]
        assert done.num_tensors == len(torch.load(runs / kind / "weights.pt")) - (kind == "gpt2")


def test_a_wrong_prefix_is_an_error_naming_the_right_one(
    runs: Path, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    args = [
        "export-hf",
        str(runs / "llama" / "full.ckpt"),
        str(tmp_path / "out"),
        "--config",
        str(runs / "llama" / "config"),
    ]
    assert cli_main([*args, "--prefix", "lm."]) == 2
    error = capsys.readouterr().err
    assert "prefix='lm.'" in error and "'model.'" in error and "model.embed_tokens.weight" in error
    assert not (tmp_path / "out").exists()
    assert cli_main([*args, "--prefix", "model"]) == 0  # the trailing dot is optional


def test_two_copies_of_the_model_are_ambiguous(runs: Path, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    weights = torch.load(runs / "llama" / "weights.pt")
    both = {"state_dict": {f"{who}.{k}": v for who in ("student", "teacher") for k, v in weights.items()}}
    torch.save(both, tmp_path / "two.ckpt")
    args = ["export-hf", str(tmp_path / "two.ckpt"), str(tmp_path / "out"), "--config", str(runs / "llama" / "config")]
    assert cli_main(args) == 2
    error = capsys.readouterr().err
    assert "'student.', 'teacher.'" in error and "--prefix" in error
    assert cli_main([*args, "--prefix", "teacher."]) == 0


def test_a_config_that_does_not_fit_is_an_error(runs: Path, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    config = json.loads((runs / "llama" / "config" / "config.json").read_text())
    (tmp_path / "config").mkdir()
    (tmp_path / "config" / "config.json").write_text(json.dumps({**config, "intermediate_size": 48}))
    ckpt = runs / "llama" / "sharded.ckpt"
    assert cli_main(["export-hf", str(ckpt), str(tmp_path / "out"), "--config", str(tmp_path / "config")]) == 2
    assert "model.layers.0.mlp.down_proj.weight: checkpoint (64, 128) vs model (64, 48)" in capsys.readouterr().err
    (tmp_path / "config" / "config.json").write_text(json.dumps({**config, "num_hidden_layers": 3}))
    assert cli_main(["export-hf", str(ckpt), str(tmp_path / "out"), "--config", str(tmp_path / "config")]) == 2
    assert "'model.' holds 21 of 30" in capsys.readouterr().err


def test_a_non_empty_output_directory_is_refused(runs: Path, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    out = tmp_path / "taken"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    args = ["export-hf", str(runs / "gpt2" / "sharded.ckpt"), str(out), "--config", str(runs / "gpt2" / "config")]
    assert cli_main(args) == 2
    assert f"The output directory {out} exists and is not empty" in capsys.readouterr().err
    assert [p.name for p in out.iterdir()] == ["notes.txt"]
    (out / "notes.txt").unlink()  # an empty directory is fine
    assert cli_main(args) == 0 and (out / "model.safetensors").is_file()
    assert [p.name for p in tmp_path.iterdir()] == ["taken"]  # no staging directory left behind


def test_an_output_directory_filled_during_the_export_is_kept(
    runs: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    # Checked again when the export is renamed into place: on main it was exchanged with the export and deleted.
    import lightning_shard.hf.export as export

    out = tmp_path / "out"
    copy = export.copy_config_files

    def copy_then_someone_fills_the_output(*args: Any) -> None:
        copy(*args)
        out.mkdir()
        (out / "notes.txt").write_text("mine")

    monkeypatch.setattr(export, "copy_config_files", copy_then_someone_fills_the_output)
    args = ["export-hf", str(runs / "gpt2" / "sharded.ckpt"), str(out), "--config", str(runs / "gpt2" / "config")]
    assert cli_main(args) == 2
    assert f"{out} is a directory that is not a checkpoint written by lightning-shard (it holds notes.txt)" in (
        capsys.readouterr().err
    )
    assert [p.name for p in out.iterdir()] == ["notes.txt"] and [p.name for p in tmp_path.iterdir()] == ["out"]


def test_the_package_imports_without_the_hf_extra() -> None:
    # transformers, huggingface_hub and safetensors are imported inside functions only. (The import itself cannot be
    # tried here: torchmetrics imports transformers whenever it is installed.)
    optional = {"transformers", "huggingface_hub", "safetensors", "accelerate", "tokenizers"}
    for path in (REPO / "lightning_shard").rglob("*.py"):
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, ast.Import):
                roots = {alias.name.split(".")[0] for alias in node.names}
            elif isinstance(node, ast.ImportFrom):
                roots = {(node.module or "").split(".")[0]}
            else:
                continue
            assert not roots & optional, f"{path.relative_to(REPO)} imports {roots & optional} at module level"
