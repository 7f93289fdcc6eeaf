"""Token data for the GPT example: memmapped ``.bin`` files or plain text with a byte-level tokenizer.

Two sources are supported:

* a directory holding nanoGPT-style ``train.bin`` / ``val.bin`` (flat ``uint16`` token ids), and
* plain text (a file or a directory of files) tokenised on the fly into UTF-8 bytes (vocabulary 256).

With no ``data_path`` the module reads the standard library's own ``.py`` files, so the example trains without
downloading anything. To turn a directory of text into ``.bin`` files once::

    python examples/gpt/data.py prepare SRC_DIR OUT_DIR

Training samples are random windows of ``block_size + 1`` tokens whose offsets are drawn once from a seed, so the
dataset is map-style and sample ``i`` is always the same window. :class:`ResumableSampler` shuffles and shards
those indices by rank and remembers how far into the epoch training got, so a run resumed from a mid-epoch
checkpoint sees exactly the batches the uninterrupted run would have seen (see :class:`TokenDataModule`).
"""

from __future__ import annotations

import argparse
import sysconfig
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from lightning.pytorch import LightningDataModule
from torch.utils.data import DataLoader, Dataset, Sampler

BYTE_VOCAB_SIZE = 256


def encode_bytes(text: str) -> list[int]:
    """Tokenise text into its UTF-8 bytes.

    Example:
        >>> encode_bytes("hé")
        [104, 195, 169]
    """
    return list(text.encode("utf-8"))


def decode_bytes(ids: list[int]) -> str:
    """Turn byte ids back into text; a sequence cut inside a multi-byte character decodes to U+FFFD.

    Example:
        >>> decode_bytes([104, 195, 169])
        'hé'
    """
    return bytes(ids).decode("utf-8", errors="replace")


def read_text_bytes(source: str | Path, max_bytes: int | None = None) -> bytes:
    """Concatenate a text file, or every file below a directory in sorted order, up to ``max_bytes``.

    Example:
        >>> len(read_text_bytes(sysconfig.get_paths()["stdlib"] + "/os.py", max_bytes=100))
        100
    """
    source = Path(source)
    files = [source] if source.is_file() else sorted(p for p in source.rglob("*") if p.is_file())
    chunks, total = [], 0
    for path in files:
        chunk = path.read_bytes()
        if max_bytes is not None:
            chunk = chunk[: max_bytes - total]
        chunks.append(chunk)
        total += len(chunk)
        if max_bytes is not None and total >= max_bytes:
            break
    return b"".join(chunks)


def stdlib_text_bytes(max_bytes: int) -> bytes:
    """The default corpus: the top-level ``.py`` files of the running Python's standard library, sorted by name.

    It ships with every Python, so nothing is downloaded; it differs slightly between Python versions.

    Example:
        >>> len(stdlib_text_bytes(1000))
        1000
    """
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    chunks, total = [], 0
    for path in sorted(stdlib.glob("*.py")):
        chunks.append(path.read_bytes()[: max_bytes - total])
        total += len(chunks[-1])
        if total >= max_bytes:
            break
    return b"".join(chunks)


def split_train_val(tokens: np.ndarray, val_fraction: float) -> tuple[np.ndarray, np.ndarray]:
    """Split a token stream into a leading train part and a trailing validation part.

    Example:
        >>> [len(part) for part in split_train_val(np.arange(100), 0.1)]
        [90, 10]
    """
    n_val = int(len(tokens) * val_fraction)
    return tokens[: len(tokens) - n_val], tokens[len(tokens) - n_val :]


def prepare(source: str | Path, out_dir: str | Path, val_fraction: float = 0.05) -> tuple[int, int]:
    """Byte-tokenise ``source`` (file or directory) into ``out_dir/train.bin`` and ``out_dir/val.bin`` (``uint16``).

    Returns the number of train and validation tokens.

    Example:
        >>> prepare("my_text_dir", "data/my_text")  # doctest: +SKIP
        (950000, 50000)
    """
    tokens = np.frombuffer(read_text_bytes(source), dtype=np.uint8).astype(np.uint16)
    train, val = split_train_val(tokens, val_fraction)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    train.tofile(out_dir / "train.bin")
    val.tofile(out_dir / "val.bin")
    return len(train), len(val)


class RandomWindowDataset(Dataset):
    """``num_samples`` windows of ``block_size + 1`` tokens, the offset of window ``i`` drawn from ``(seed, i)``.

    Offsets are computed per item rather than stored, so a dataset of hundreds of millions of samples costs no
    memory. Item ``i`` is ``(x, y)`` with ``y`` the window shifted by one token: ``y[t]`` follows ``x[t]``.

    Example:
        >>> x, y = RandomWindowDataset(np.arange(100, dtype=np.uint16), block_size=8, num_samples=4)[0]
        >>> bool((y[:-1] == x[1:]).all())
        True
    """

    def __init__(self, tokens: np.ndarray, block_size: int, num_samples: int, seed: int = 0) -> None:
        if len(tokens) <= block_size + 1:
            raise ValueError(f"Need more than block_size + 1 = {block_size + 1} tokens, got {len(tokens)}.")
        self.tokens = tokens
        self.block_size = block_size
        self.num_samples = num_samples
        self.seed = seed

    def __len__(self) -> int:
        return self.num_samples

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        offset = np.random.default_rng([self.seed, index]).integers(0, len(self.tokens) - self.block_size - 1)
        window = torch.from_numpy(self.tokens[offset : offset + self.block_size + 1].astype(np.int64))
        return window[:-1], window[1:]


class ResumableSampler(Sampler[int]):
    """Per-epoch shuffled (or ordered) indices, split across data-parallel ranks, resumable mid-epoch.

    Each rank takes every ``world_size``-th index of the epoch's order (a fresh permutation per epoch, or
    ``0, 1, 2, ...`` without ``shuffle``, which suits datasets too large to permute and whose items are already
    random); the tail that does not divide evenly is dropped so every rank runs the same number of steps.
    Rank and world size default to those of ``torch.distributed`` when it is initialised.

    The owner reports how many samples training actually consumed with :meth:`consume` (the data loader runs ahead
    of training, so counting what ``__iter__`` yielded would skip the prefetched batches on resume).
    ``state_dict()`` holds only rank-independent values (epoch, samples consumed per rank), so the copy saved by
    rank 0 restores every rank.

    Example:
        >>> sampler = ResumableSampler(10, seed=0, rank=0, world_size=2)
        >>> full_epoch = list(sampler)
        >>> sampler.consume(2)  # training used the first two samples, then saved a checkpoint
        >>> resumed = ResumableSampler(10, seed=0, rank=0, world_size=2)
        >>> resumed.load_state_dict(sampler.state_dict())
        >>> list(resumed) == full_epoch[2:]
        True
    """

    def __init__(
        self,
        num_samples: int,
        shuffle: bool = True,
        seed: int = 0,
        rank: int | None = None,
        world_size: int | None = None,
    ) -> None:
        distributed = dist.is_available() and dist.is_initialized()
        self.rank = rank if rank is not None else (dist.get_rank() if distributed else 0)
        self.world_size = world_size if world_size is not None else (dist.get_world_size() if distributed else 1)
        self.num_samples = num_samples
        self.shuffle = shuffle
        self.seed = seed
        self.epoch = 0
        self.consumed = 0

    def __len__(self) -> int:
        return self.num_samples // self.world_size

    def set_epoch(self, epoch: int) -> None:
        """Called by Lightning at every epoch start, also right after a resume with the restored epoch."""
        if epoch != self.epoch:
            self.epoch = epoch
            self.consumed = 0

    def consume(self, num_samples: int) -> None:
        """Record that training has used ``num_samples`` more samples of this rank's share."""
        self.consumed += num_samples

    def __iter__(self) -> Iterator[int]:
        # A finished epoch that is iterated again without set_epoch() starts over rather than yielding nothing.
        start = self.consumed if self.consumed < len(self) else 0
        # This rank's positions in the epoch's order: rank, rank + world_size, ... (a lazy range, no list).
        positions = range(self.rank + start * self.world_size, len(self) * self.world_size, self.world_size)
        if not self.shuffle:
            return iter(positions)
        order = torch.randperm(self.num_samples, generator=torch.Generator().manual_seed(self.seed + self.epoch))
        return (int(order[position]) for position in positions)

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "consumed": self.consumed, "world_size": self.world_size}

    def load_state_dict(self, state_dict: dict[str, int]) -> None:
        if state_dict["world_size"] != self.world_size:
            raise ValueError(
                f"Cannot resume the data order of a {state_dict['world_size']}-rank run on {self.world_size} ranks."
            )
        self.epoch = state_dict["epoch"]
        self.consumed = state_dict["consumed"]


class ResumableDataLoader(DataLoader):
    """A ``DataLoader`` whose sampler state Lightning saves into and restores from checkpoints.

    Lightning checkpoints the state of every *data loader* that has ``state_dict``/``load_state_dict`` (see
    ``CombinedLoader._state_dicts`` in ``lightning.pytorch.utilities.combined_loader``); this forwards to the sampler.
    """

    sampler: ResumableSampler

    def state_dict(self) -> dict[str, Any]:
        return self.sampler.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.sampler.load_state_dict(state_dict)


class TokenDataModule(LightningDataModule):
    """Random token windows from ``.bin`` files, a text file/directory, or (default) the Python standard library.

    Needs ``Trainer(use_distributed_sampler=False)``: :class:`ResumableSampler` already splits the data by rank,
    and Lightning would otherwise wrap it in a second, non-resumable distributed sampler.

    Example:
        >>> dm = TokenDataModule(block_size=32, batch_size=4, samples_per_epoch=64, max_bytes=10_000)
        >>> dm.setup("fit")
        >>> x, y = next(iter(dm.train_dataloader()))
        >>> tuple(x.shape), dm.vocab_size
        ((4, 32), 256)
    """

    def __init__(
        self,
        data_path: str | None = None,
        block_size: int = 128,
        batch_size: int = 16,
        samples_per_epoch: int = 100_000,
        shuffle: bool = True,
        val_samples: int = 512,
        val_fraction: float = 0.05,
        max_bytes: int = 4_000_000,
        seed: int = 1234,
        num_workers: int = 0,
    ) -> None:
        """
        Args:
            data_path: directory with ``train.bin``/``val.bin``, or a text file/directory; ``None`` = stdlib text.
            block_size: tokens per sample (the model's context length).
            batch_size: samples per batch and rank.
            samples_per_epoch: training windows per epoch, across all ranks.
            shuffle: permute the windows anew each epoch (off for runs of one huge epoch; windows are random anyway).
            val_samples: validation windows, across all ranks.
            val_fraction: share of text held out for validation (text sources only).
            max_bytes: cap on text read from text sources.
            seed: seeds the window offsets and the per-epoch shuffle.
            num_workers: data loader worker processes.
        """
        super().__init__()
        self.save_hyperparameters()
        self.train_tokens: np.ndarray | None = None
        self.val_tokens: np.ndarray | None = None
        self._train_sampler: ResumableSampler | None = None

    @property
    def vocab_size(self) -> int | None:
        """256 for byte-tokenised text; unknown (``None``) for ``.bin`` files."""
        return None if self._bin_dir() is not None else BYTE_VOCAB_SIZE

    def _bin_dir(self) -> Path | None:
        path = self.hparams.data_path
        return Path(path) if path is not None and (Path(path) / "train.bin").exists() else None

    def setup(self, stage: str) -> None:
        # Trainer has no public accessor for the flag; failing here beats silently sharding the data twice.
        if self.trainer is not None and self.trainer._accelerator_connector.use_distributed_sampler:
            raise ValueError("TokenDataModule shards data by rank itself: use Trainer(use_distributed_sampler=False).")
        if self.train_tokens is not None:
            return
        bin_dir = self._bin_dir()
        if bin_dir is not None:
            self.train_tokens = np.memmap(bin_dir / "train.bin", dtype=np.uint16, mode="r")
            self.val_tokens = np.memmap(bin_dir / "val.bin", dtype=np.uint16, mode="r")
            return
        if self.hparams.data_path is None:
            text = stdlib_text_bytes(self.hparams.max_bytes)
        elif not Path(self.hparams.data_path).exists():
            raise FileNotFoundError(f"data_path {self.hparams.data_path!r} does not exist.")
        else:
            text = read_text_bytes(self.hparams.data_path, self.hparams.max_bytes)
        self.train_tokens, self.val_tokens = split_train_val(self.tokenize(text), self.hparams.val_fraction)

    def tokenize(self, text: bytes) -> np.ndarray:
        """Text sources -> token ids: their UTF-8 bytes (vocabulary 256); a subclass may plug in another tokenizer."""
        return np.frombuffer(text, dtype=np.uint8)

    def train_dataloader(self) -> ResumableDataLoader:
        hp = self.hparams
        dataset = RandomWindowDataset(self.train_tokens, hp.block_size, hp.samples_per_epoch, seed=hp.seed)
        self._train_sampler = ResumableSampler(len(dataset), shuffle=hp.shuffle, seed=hp.seed, **self._data_ranks())
        return ResumableDataLoader(
            dataset, batch_size=hp.batch_size, sampler=self._train_sampler, num_workers=hp.num_workers
        )

    def val_dataloader(self) -> DataLoader:
        hp = self.hparams
        dataset = RandomWindowDataset(self.val_tokens, hp.block_size, hp.val_samples, seed=hp.seed)
        sampler = ResumableSampler(len(dataset), shuffle=False, **self._data_ranks())
        return DataLoader(dataset, batch_size=hp.batch_size, sampler=sampler, num_workers=hp.num_workers)

    def _data_ranks(self) -> dict[str, int]:
        """This rank's place among the ranks that read different data: the strategy's data-parallel ranks (under
        tensor parallelism the ranks of one tensor-parallel group read the same batches), else every rank."""
        kwargs = self.trainer.distributed_sampler_kwargs if self.trainer is not None else None
        return {"rank": kwargs["rank"], "world_size": kwargs["num_replicas"]} if kwargs else {}

    def on_before_batch_transfer(self, batch: Any, dataloader_idx: int) -> Any:
        # Lightning calls this once per batch the training step really receives, after the loader's read-ahead,
        # which makes it the exact place to count consumed samples for a mid-epoch resume.
        if self.trainer is not None and self.trainer.training and self._train_sampler is not None:
            self._train_sampler.consume(len(batch[0]))
        return batch


def main(argv: list[str] | None = None) -> None:
    """``python examples/gpt/data.py prepare SRC OUT [--val-fraction F]``."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)
    prepare_parser = commands.add_parser("prepare", help="byte-tokenise text into train.bin / val.bin")
    prepare_parser.add_argument("source", help="text file or directory (all files, sorted by path)")
    prepare_parser.add_argument("out_dir")
    prepare_parser.add_argument("--val-fraction", type=float, default=0.05)
    args = parser.parse_args(argv)
    n_train, n_val = prepare(args.source, args.out_dir, args.val_fraction)
    print(f"wrote {n_train:,} train and {n_val:,} val tokens to {args.out_dir}")


if __name__ == "__main__":
    main()
