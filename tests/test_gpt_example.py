"""Tests of the GPT example: model sizes, init, data, resumable sampling, and a 2-rank training run via the CLI."""

from __future__ import annotations

import csv
import itertools
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml
from lightning.pytorch import Callback, Trainer
from lightning.pytorch.callbacks import ModelCheckpoint

from examples.gpt.data import (
    BYTE_VOCAB_SIZE,
    RandomWindowDataset,
    ResumableSampler,
    TokenDataModule,
    decode_bytes,
    encode_bytes,
    prepare,
)
from examples.gpt.model import GPT, count_parameters

REPO = Path(__file__).resolve().parents[1]
CONFIGS = REPO / "configs"

# Parameter counts of our GPT (tied output projection, 2048 learned positions, biases) per config.
EXPECTED_PARAMETERS = {
    "gpt3_small": 125_237_760,
    "gpt3_medium": 355_887_104,
    "gpt3_large": 760_323_072,
    "gpt3_xl": 1_315_753_984,
    "gpt3_2.7b": 2_651_591_680,
    "gpt3_6.7b": 6_658_465_792,
    "gpt3_13b": 12_853_463_040,
    "gpt3_13b_1gpu_offload": 12_853_463_040,
    "gpt3_13b_tp8": 12_853_463_040,
}
# fairseq's log for its 13B dense model. It counts the output projection as its own (vocab x width) matrix and
# has 2050 positions (2048 plus fairseq's padding offset of 2); our model ties the projection to the embedding.
FAIRSEQ_13B_PARAMETERS = 13_110_865_920


def _model_args(config: Path) -> dict:
    return yaml.safe_load(config.read_text())["model"]


def _meta_gpt(**kwargs) -> GPT:
    with torch.device("meta"):
        model = GPT(**kwargs)
        model.configure_model()
    return model


@pytest.mark.parametrize("name", sorted(EXPECTED_PARAMETERS))
def test_gpt3_config_builds_on_meta_device_with_expected_size(name: str) -> None:
    model = _meta_gpt(**_model_args(CONFIGS / f"{name}.yaml"))
    assert all(p.is_meta for p in model.parameters())
    assert count_parameters(model) == EXPECTED_PARAMETERS[name]


def test_13b_count_reconciles_with_fairseq() -> None:
    args = _model_args(CONFIGS / "gpt3_13b.yaml")
    vocab, width = args["vocab_size"], args["n_embd"]
    untied_output_projection, padding_positions = vocab * width, 2 * width
    assert EXPECTED_PARAMETERS["gpt3_13b"] + untied_output_projection + padding_positions == FAIRSEQ_13B_PARAMETERS


def test_every_gpt3_config_is_covered() -> None:
    assert {p.stem for p in CONFIGS.glob("gpt3_*.yaml")} == set(EXPECTED_PARAMETERS)


def test_output_projection_is_tied_to_token_embedding() -> None:
    model = GPT(n_layer=1, n_head=2, n_embd=16, vocab_size=32, block_size=8)
    model.configure_model()
    assert not any(name.startswith("lm_head") for name, _ in model.named_parameters())
    wte = model.transformer.wte.weight
    logits = model(torch.zeros(1, 4, dtype=torch.long))
    logits.sum().backward()
    assert wte.grad is not None and logits.shape == (1, 4, 32)


def test_configure_model_builds_layers_only_once() -> None:
    model = GPT(n_layer=1, n_head=1, n_embd=8, vocab_size=16, block_size=4)
    model.configure_model()
    first = model.transformer
    model.configure_model()
    assert model.transformer is first


def test_meta_model_initialised_by_reset_parameters_equals_eager_init() -> None:
    """All init lives in reset_parameters(): replaying it module by module reproduces the eager model."""
    kwargs = dict(n_layer=2, n_head=2, n_embd=16, vocab_size=32, block_size=8)
    torch.manual_seed(0)
    eager = GPT(**kwargs)
    eager.configure_model()

    lazy = _meta_gpt(**kwargs)
    torch.manual_seed(0)
    for module in lazy.transformer.modules():
        if any(True for _ in itertools.chain(module.parameters(recurse=False), module.buffers(recurse=False))):
            module.to_empty(device="cpu", recurse=False)
            module.reset_parameters()
    for (name, expected), (_, actual) in zip(eager.state_dict().items(), lazy.state_dict().items(), strict=True):
        torch.testing.assert_close(actual, expected, rtol=0, atol=0, msg=name)
    assert all(not t.is_meta for t in lazy.state_dict().values())


def test_byte_tokenizer_round_trips() -> None:
    text = "def f(x):\n    return 'héllo → ✓'\n"
    ids = encode_bytes(text)
    assert max(ids) < BYTE_VOCAB_SIZE
    assert decode_bytes(ids) == text


def test_memmap_bin_files_feed_the_data_module(tmp_path: Path) -> None:
    source = tmp_path / "text"
    source.mkdir()
    (source / "a.txt").write_text("hello world " * 200)
    (source / "b.txt").write_text("lorem ipsum " * 200)
    n_train, n_val = prepare(source, tmp_path / "bin", val_fraction=0.1)
    assert n_train + n_val == 4800
    assert np.fromfile(tmp_path / "bin" / "train.bin", dtype=np.uint16)[:5].tolist() == encode_bytes("hello")

    dm = TokenDataModule(data_path=str(tmp_path / "bin"), block_size=16, batch_size=4, samples_per_epoch=32)
    dm.setup("fit")
    assert isinstance(dm.train_tokens, np.memmap) and dm.vocab_size is None
    x, y = next(iter(dm.train_dataloader()))
    assert x.shape == y.shape == (4, 16) and x.dtype == torch.long
    assert torch.equal(x[:, 1:], y[:, :-1])


def test_prepare_cli_writes_bin_files(tmp_path: Path) -> None:
    (tmp_path / "t.txt").write_text("some text to tokenise " * 50)
    result = subprocess.run(
        [sys.executable, str(REPO / "examples/gpt/data.py"), "prepare", str(tmp_path / "t.txt"), str(tmp_path / "o")],
        capture_output=True,
        text=True,
        check=True,
    )
    assert "train" in result.stdout and (tmp_path / "o" / "val.bin").exists()


def test_windows_are_deterministic_per_index() -> None:
    tokens = np.arange(1000, dtype=np.uint16)
    first, again = RandomWindowDataset(tokens, 8, 10, seed=3), RandomWindowDataset(tokens, 8, 10, seed=3)
    assert all(torch.equal(first[i][0], again[i][0]) for i in range(10))
    assert not torch.equal(first[0][0], RandomWindowDataset(tokens, 8, 10, seed=4)[0][0])


@pytest.mark.parametrize("shuffle", [True, False])
def test_sampler_shards_are_disjoint_and_equal_sized(shuffle: bool) -> None:
    shards = [list(ResumableSampler(103, shuffle=shuffle, seed=1, rank=r, world_size=4)) for r in range(4)]
    assert all(len(shard) == 25 for shard in shards)
    flat = [i for shard in shards for i in shard]
    assert len(set(flat)) == 100 and set(flat) <= set(range(103))


def test_sampler_resumes_the_remaining_sequence_and_reshuffles_per_epoch() -> None:
    sampler = ResumableSampler(50, seed=7, rank=1, world_size=2)
    sampler.set_epoch(3)
    full_epoch = list(sampler)
    sampler.consume(10)

    resumed = ResumableSampler(50, seed=7, rank=1, world_size=2)
    resumed.load_state_dict(sampler.state_dict())
    resumed.set_epoch(3)  # Lightning calls this again after restoring; the same epoch must keep the position
    assert list(resumed) == full_epoch[10:]

    resumed.set_epoch(4)
    next_epoch = list(resumed)
    assert len(next_epoch) == 25 and next_epoch != full_epoch

    with pytest.raises(ValueError, match="ranks"):
        ResumableSampler(50, rank=0, world_size=4).load_state_dict(sampler.state_dict())


class _RecordBatches(Callback):
    def __init__(self) -> None:
        self.batches: list[list[int]] = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self.batches.append(batch[0][:, 0].tolist())


def _fit(max_steps: int, root: Path, ckpt_path: str | None = None) -> list[list[int]]:
    recorder = _RecordBatches()
    trainer = Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=max_steps,
        limit_val_batches=0,
        use_distributed_sampler=False,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[recorder, ModelCheckpoint(root, every_n_train_steps=5, save_top_k=-1)],
        default_root_dir=root,
    )
    model = GPT(n_layer=1, n_head=1, n_embd=8, vocab_size=256, block_size=16, warmup_steps=2, max_steps=20)
    # 10 batches per epoch, so the runs cross epoch boundaries.
    data = TokenDataModule(block_size=16, batch_size=4, samples_per_epoch=40, max_bytes=20_000)
    trainer.fit(model, data, ckpt_path=ckpt_path)
    return recorder.batches


def test_resumed_training_sees_the_batches_of_the_uninterrupted_run(tmp_path: Path) -> None:
    uninterrupted = _fit(20, tmp_path / "full")
    _fit(15, tmp_path / "interrupted")
    for step in (5, 15):  # mid-epoch 0 and mid-epoch 1
        resumed = _fit(
            20,
            tmp_path / f"resume{step}",
            ckpt_path=str(tmp_path / "interrupted" / f"epoch={step // 10}-step={step}.ckpt"),
        )
        assert resumed == uninterrupted[step:]


# Shortens the tiny config for a test: 30 steps, loss logged every step, a sharded checkpoint every 10 steps.
_SHORT_RUN = """
trainer:
  max_steps: 30
  log_every_n_steps: 1
  val_check_interval: 30
  limit_val_batches: 2
  enable_progress_bar: false
  callbacks:
    - class_path: lightning.pytorch.callbacks.ModelCheckpoint
      init_args:
        dirpath: out/gpt_tiny/checkpoints
        every_n_train_steps: 10
        save_top_k: -1
"""


def _run_example(script: str, *args: str, cwd: Path) -> str:
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    run = subprocess.run(
        [sys.executable, str(REPO / "examples/gpt" / script), *args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    return run.stdout


def _logged(metrics_csv: Path, column: str) -> dict[int, float]:
    with open(metrics_csv) as f:
        return {int(row["step"]): float(row[column]) for row in csv.DictReader(f) if row[column]}


def test_tiny_config_trains_resumes_exactly_and_samples_on_two_sharded_ranks(tmp_path: Path) -> None:
    (tmp_path / "short.yaml").write_text(_SHORT_RUN)
    # Relative output paths in the configs (out/gpt_tiny/...) land in tmp_path.
    fit = ["fit", "--config", str(CONFIGS / "gpt_tiny.yaml"), "--config", "short.yaml"]
    stdout = _run_example("train.py", *fit, cwd=tmp_path)
    assert "--- sample ---" in stdout

    logs = tmp_path / "out/gpt_tiny/logs"
    train_loss = _logged(logs / "version_0/metrics.csv", "train_loss")
    assert sorted(train_loss) == list(range(30))
    assert train_loss[0] > 5.0  # about ln(256) = 5.55 at init
    assert np.mean([train_loss[step] for step in range(25, 30)]) < 3.5
    assert 0.0 < _logged(logs / "version_0/metrics.csv", "val_loss")[29] < 3.5

    # Resuming from the step-20 checkpoint repeats steps 20..29 exactly: same batches, weights, optimizer, schedule.
    checkpoints = tmp_path / "out/gpt_tiny/checkpoints"
    _run_example("train.py", *fit, "--ckpt_path", str(checkpoints / "epoch=0-step=20.ckpt"), cwd=tmp_path)
    resumed_loss = _logged(logs / "version_1/metrics.csv", "train_loss")
    assert resumed_loss == {step: train_loss[step] for step in range(20, 30)}

    last = str(checkpoints / "epoch=0-step=30.ckpt")  # a torch.distributed.checkpoint directory
    sample = _run_example("generate.py", last, "--max-new-tokens", "20", cwd=tmp_path)
    assert sample.startswith("def ")
