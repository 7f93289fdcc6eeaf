"""The Hugging Face fine-tuning example: its data module (bytes or a local tokenizer) and, once
``lightning_shard.hf.from_pretrained`` exists, ``examples/hf/finetune.py`` end to end on 2 ranks, then export-hf.

The end-to-end reference: the first logged training loss (step 0, before any update) equals the loss of the
pretrained model, loaded by plain transformers in this process, on the same two per-rank batches.
"""

from __future__ import annotations

import csv
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml
from conftest import REPO

import lightning_shard.hf
from examples.gpt.data import RandomWindowDataset, ResumableSampler
from examples.hf.data import TextDataModule

pytest.importorskip("transformers", reason="the [hf] extra (transformers) is not installed")

CONFIG = REPO / "configs" / "hf_llama_tiny.yaml"
TOL = 1e-4
SHORT_RUN = """
trainer:
  max_steps: 6
  log_every_n_steps: 1
  val_check_interval: 6
  limit_val_batches: 1
"""


def test_byte_level_data_fits_the_tiny_model() -> None:
    config = yaml.safe_load(CONFIG.read_text())
    dm = TextDataModule(**{**config["data"], "max_bytes": 20_000})
    dm.setup("fit")
    assert dm.vocab_size == 256 == config["model"]["random_init"]["vocab_size"]
    x, y = dm.train_dataloader().dataset[0]
    assert x.shape == (128,) and int(x.max()) < 256 and torch.equal(x[1:], y[:-1])


def test_a_local_tokenizer_replaces_bytes(tmp_path: Path) -> None:
    # A tokenizer built here (byte-level BPE trained on a little stdlib text): nothing is downloaded.
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    text = Path(np.__file__).read_text()
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    bpe.train_from_iterator([text], trainers.BpeTrainer(vocab_size=400, initial_alphabet=alphabet))
    PreTrainedTokenizerFast(tokenizer_object=bpe).save_pretrained(tmp_path / "tok")
    (tmp_path / "corpus.txt").write_text(text * 4)

    dm = TextDataModule(tokenizer_path=str(tmp_path / "tok"), data_path=str(tmp_path / "corpus.txt"), block_size=16)
    dm.setup("fit")
    assert dm.vocab_size == 400
    tokens = np.concatenate([dm.train_tokens, dm.val_tokens])
    assert tokens.max() >= 256 and len(tokens) < len((text * 4).encode()) / 2  # merges, not bytes
    assert dm.tokenizer.decode(tokens[:50].tolist()) == (text * 4)[: len(dm.tokenizer.decode(tokens[:50].tolist()))]


@pytest.mark.skipif(
    not hasattr(lightning_shard.hf, "from_pretrained"),
    reason="lightning_shard.hf.from_pretrained (the sharded pretrained loading of issue 15, helper 15a) is missing",
)
def test_finetune_example_loads_trains_saves_and_exports(tmp_path: Path) -> None:
    (tmp_path / "short.yaml").write_text(SHORT_RUN)
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    # Relative output paths in the config (out/hf_llama_tiny/...) land in tmp_path.
    command = [sys.executable, str(REPO / "examples/hf/finetune.py"), "fit", "--config", str(CONFIG)]
    run = subprocess.run(
        [*command, "--config", "short.yaml"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    out = tmp_path / "out/hf_llama_tiny"
    assert "No model at out/hf_llama_tiny/pretrained: wrote a random llama model" in run.stdout
    assert (out / "pretrained/model.safetensors").is_file()
    assert (out / "checkpoints/last.ckpt/.metadata").is_file()  # a sharded checkpoint

    with open(out / "logs/version_0/metrics.csv") as f:
        losses = {int(row["step"]): float(row["train_loss"]) for row in csv.DictReader(f) if row["train_loss"]}
    assert sorted(losses) == list(range(6)) and losses[5] < losses[0]
    assert abs(losses[0] - _pretrained_loss_on_first_batches(out / "pretrained")) <= TOL

    export = [sys.executable, "-m", "lightning_shard.cli", "export-hf", str(out / "checkpoints/last.ckpt")]
    done = subprocess.run(
        [*export, str(out / "finetuned"), "--config", str(out / "pretrained")],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "under prefix 'model.'" in done.stdout
    from transformers import AutoModelForCausalLM

    tuned = AutoModelForCausalLM.from_pretrained(out / "finetuned").state_dict()
    start = AutoModelForCausalLM.from_pretrained(out / "pretrained").state_dict()
    assert tuned.keys() == start.keys()
    assert 0 < max((tuned[k] - start[k]).abs().max().item() for k in tuned) < 0.1  # fine-tuned, from the start


def _pretrained_loss_on_first_batches(pretrained: Path) -> float:
    """Mean next-token loss of the pretrained model on each rank's first training batch (Lightning's step-0 loss)."""
    from transformers import AutoModelForCausalLM

    data = yaml.safe_load(CONFIG.read_text())["data"]
    dm = TextDataModule(**data)
    dm.setup("fit")
    seed = dm.hparams.seed
    dataset = RandomWindowDataset(dm.train_tokens, data["block_size"], data["samples_per_epoch"], seed=seed)
    model = AutoModelForCausalLM.from_pretrained(pretrained).eval()
    losses = []
    for rank in range(2):
        indices = list(ResumableSampler(len(dataset), shuffle=True, seed=seed, rank=rank, world_size=2))
        x, y = map(torch.stack, zip(*(dataset[i] for i in indices[: data["batch_size"]]), strict=True))
        with torch.no_grad():
            logits = model(input_ids=x).logits
        losses.append(torch.nn.functional.cross_entropy(logits.reshape(-1, logits.size(-1)), y.reshape(-1)).item())
    return sum(losses) / len(losses)
