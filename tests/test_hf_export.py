"""``lightning-shard export-hf``: checkpoints of tiny HF models trained on 2 ranks become directories that plain
``transformers`` loads, with the trained model's logits.

The reference is the trained HF model's full state dict (gathered to rank 0 by the run) loaded into the model built
from the same config; the export is loaded by ``AutoModelForCausalLM.from_pretrained`` in a process where
lightning_shard cannot be imported. Models: a tiny Llama (attribute ``model``) and a tiny GPT-2 with tied
embeddings (attribute ``lm``), 2 steps of AdamW each (``tests/hf_export_run.py``).
"""

from __future__ import annotations

import ast
import json
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import REPO, run_script
from hf_run import VOCAB

from lightning_shard.cli import main as cli_main

pytest.importorskip("transformers", reason="the [hf] extra (transformers) is not installed")

TOL = 1e-5
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
    return made


def _export(runs: Path, kind: str, fmt: str, *extra: str) -> Path:
    out = runs / "exports" / f"{kind}-{fmt}{'-small' if extra else ''}"
    assert (
        cli_main(
            ["export-hf", str(runs / kind / f"{fmt}.ckpt"), str(out), "--config", str(runs / kind / "config"), *extra]
        )
        == 0
    )
    return out


# Loads every export in one process that cannot import lightning_shard (blocked, and -I: no PYTHONPATH, no cwd).
LOADER = """
import sys, torch
sys.modules["lightning_shard"] = None
from transformers import AutoModelForCausalLM
dirs, ids, result_file = sys.argv[1].split(","), torch.load(sys.argv[2]), sys.argv[3]
results = {}
for name_dir in dirs:
    name, path = name_dir.split("=", 1)
    model, info = AutoModelForCausalLM.from_pretrained(path, output_loading_info=True)
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
    dirs = ",".join(f"{name}={path}" for name, path in exports.items())
    run_script("-I", "-c", LOADER, dirs, str(runs / "ids.pt"), str(runs / "loaded.pt"), cwd=runs)
    return torch.load(runs / "loaded.pt", weights_only=False)


def _input_ids() -> torch.Tensor:
    return torch.randint(0, VOCAB, (2, 12), generator=torch.Generator().manual_seed(1))


def _reference_logits(runs: Path, kind: str) -> torch.Tensor:
    from transformers import AutoConfig, AutoModelForCausalLM

    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(runs / kind / "config"))
    model.load_state_dict(torch.load(runs / kind / "weights.pt"), strict=True)
    with torch.no_grad():
        return model.eval()(input_ids=_input_ids()).logits


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
