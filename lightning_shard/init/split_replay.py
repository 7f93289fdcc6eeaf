"""The replay split between the ranks: each rank initialises a share of the model's tensors whole and sends every rank
its shards of them, so the work per rank falls as 1 / N while every value stays the eager build's.

Without the split every rank replays the whole construction (:mod:`lightning_shard.init.replay`) and keeps its shards:
each rank draws every random number of the model. With it:

0. A tensor created and then filled whole - a counted draw, a constant, scalar arithmetic: most weights - is drawn by
   every rank in its own chunk, nothing sent (:mod:`lightning_shard.init.chunk_fills`). The others:
1. The tensors to initialise are ordered by the first op they need and cut into N runs of about equal bytes: rank r
   owns the r-th. So a rank's draws are one stretch of rank 0's random stream.
2. Each rank replays what its tensors need, and jumps over every other draw (:mod:`lightning_shard.init.draw_counts`,
   :mod:`lightning_shard.init.stream_jump`): rank r starts drawing where the draws of ranks 0..r-1 end, after one jump.
3. Finished tensors are sent in rounds: an owner's tensors, in their order, in batches of up to :data:`BATCH_BYTES`;
   in round k every rank scatters its k-th batch (each rank gets just its chunk of each tensor, cut on the host as DCP
   cuts it, over a CPU group). A rank enters a round when its batch is done, so the ranks compute at the same time and
   only a batch per rank is held whole.
4. The stream is checked where the shares meet: rank r's state where rank r+1 starts drawing (its own draws, then the
   counted jump) must equal rank r+1's (the counted jumps from the start). A difference - a count that torch's kernel
   does not keep - makes every rank replay the whole construction as before, with a warning.

The split runs when the replay is plain recorded ops on tensors the ranks can cut: no library init or
``reset_parameters()`` (their draws cannot be counted), every draw before the last needed one counted, every DTensor on
a mesh of the whole world with ``Shard`` / ``Replicate`` placements, and the same plan on every rank (compared by a
fingerprint). Otherwise the replay is whole on every rank, as before.

Example:
    >>> split = WorkSplit.of(plan)  # doctest: +SKIP
    >>> split is None or split.run(rng_timeline(logs))  # doctest: +SKIP
    True
"""

from __future__ import annotations

import hashlib
import math
import warnings
from collections.abc import Callable
from functools import partial
from typing import Any

import torch
import torch.distributed as dist
from lightning.fabric.utilities.distributed import _distributed_is_initialized
from torch.distributed.tensor import DTensor, Replicate, Shard

from lightning_shard.checkpoint.ranks import all_gathered
from lightning_shard.init.chunk_fills import chunk_filled, fill_chunks
from lightning_shard.init.construction_log import HolderKey, Op, held_tensor
from lightning_shard.init.draw_counts import draws_elsewhere, outputs_of
from lightning_shard.init.init_skip import restricted_needs
from lightning_shard.init.replay import Overwrite, strided
from lightning_shard.init.rng_watch import state_bytes
from lightning_shard.init.shard_init import local
from lightning_shard.init.stream_jump import advance
from lightning_shard.init.unset import empty_bytes
from lightning_shard.torch_compat.dispatch import holds_values
from lightning_shard.torch_compat.distributed import local_chunk

# The plan split here is an `init_plan.InitPlan`, which drives this module (so not imported: no cycle).
InitPlan = Any

# A rank holds at most about this many bytes of finished tensors whole before it sends them (one round's batch).
BATCH_BYTES = 256 << 20

Chunk = tuple[tuple[int, ...], tuple[int, ...]] | None  # (offsets, sizes) of a rank's chunk; None: the whole tensor


class WorkSplit:
    """Who initialises which tensors, and the rounds that send them (module docstring)."""

    def __init__(
        self, plan: InitPlan, order: list[int], chunked: tuple[set[int], dict[float, int]], group: Any
    ) -> None:
        self.plan, self.order, self.group = plan, order, group
        self.chunked, self.offsets = chunked  # the storages each rank fills in its chunk; each draw's place
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        sizes = [plan.held[plan.keys_by_storage[s][0]].nbytes for s in order]
        total, done = sum(sizes), 0
        self.owner: dict[int, int] = {}
        for storage, size in zip(order, sizes, strict=True):
            self.owner[storage] = min(self.world - 1, done * self.world // max(total, 1))
            done += size
        self.batches = [_batches([s for s in order if self.owner[s] == r], plan) for r in range(self.world)]
        self.lives = {s: _lives(plan, s) for s in order}
        mine = [[_chunk(live) for _, live in self.lives[s]] for s in order]  # by position in `order`: storage keys
        # are addresses, which differ between ranks
        self.chunks: list[dict[int, list[Chunk]]] = [
            dict(zip(order, c, strict=True)) for c in all_gathered(mine, group)
        ]
        self.finished: dict[int, torch.Tensor] = {}
        self.replayed: dict[int, bool] = {}  # owned storage -> every element written
        self.round = 0

    @classmethod
    def of(cls, plan: InitPlan, rng: list[tuple[float, Callable[[], None]]]) -> WorkSplit | None:
        """The split of ``plan``'s replay with the random stream's timeline ``rng``, or ``None`` where it does not
        apply (module docstring). Call on every rank: the ranks agree."""
        if not _distributed_is_initialized() or dist.get_world_size() == 1 or not plan.targets:
            return None
        if not holds_values(local(_lives(plan, next(iter(plan.targets)))[0][1])):
            return None  # the memory simulation's fake tensors (on a fake process group): nothing to replay or send
        splittable = _splittable(plan)
        offsets = _stream_offsets(plan) if splittable else {}
        chunked = chunk_filled(plan, offsets, events=len(rng) - 1) if splittable else set()
        order = [storage for storage in _target_order(plan) if storage not in chunked]
        fingerprint = _fingerprint(plan, order, len(chunked)) if splittable else None
        if len(set(all_gathered(fingerprint, None))) != 1 or fingerprint is None:
            return None
        return cls(plan, order, (chunked, offsets), _cpu_group())

    def run(self, rng: list[tuple[float, Callable[[], None]]]) -> bool:
        """Replay this rank's share and exchange the shards; ``False`` (after a warning) when the stream check failed
        and the whole replay must run instead."""
        try:
            return self._run(rng)
        finally:
            if self.group is not dist.group.WORLD:
                dist.destroy_process_group(self.group)

    def _run(self, rng: list[tuple[float, Callable[[], None]]]) -> bool:
        if self.chunked:
            rng[0][1]()  # the stream's start: rank 0's state where the construction began
            fill_chunks(self.plan, self.chunked, torch.get_rng_state(), self.offsets)
        owned = {s for s in self.order if self.owner[s] == self.rank}
        scope, draws = restricted_needs(self.plan.ops, owned, self.plan._draws)
        replay = self.plan.replay_scope(rng, scope, draws, {s: partial(self._finish, s) for s in owned})
        while self.round < max(len(b) for b in self.batches):
            self._exchange_round()
        position = {s: index for index, s in enumerate(self.order)}
        for flags in all_gathered({position[s]: flag for s, flag in self.replayed.items()}, self.group):
            for index, flag in flags.items():
                for _, live in self.lives[self.order[index]]:
                    self.plan.replayed[id(live)] = flag
        return self._stream_agrees(replay, [position for position, _ in rng])

    def _finish(self, storage: int, buffer: torch.Tensor) -> bool:
        """An owned storage is final: write this rank's shards, keep it for its round (returns True: kept), run every
        round now due."""
        self.plan._write_back(storage, buffer)
        self.replayed[storage] = storage not in self.plan.replay.unwritten
        self.finished[storage] = buffer
        mine = self.batches[self.rank]
        while self.round < len(mine) and all(s in self.finished for s in mine[self.round]):
            self._exchange_round()
        return True

    def _exchange_round(self) -> None:
        for source, batches in enumerate(self.batches):
            for storage in batches[self.round] if self.round < len(batches) else []:
                self._scatter(storage, source)
        self.round += 1

    def _scatter(self, storage: int, source: int) -> None:
        """Every rank gets from ``source`` its chunk of each live tensor holding ``storage``."""
        buffer = self.finished.pop(storage, None)
        for index, (key, live) in enumerate(self.lives[storage]):
            nbytes = [_numel(chunks[storage][index], live) * live.dtype.itemsize for chunks in self.chunks]
            width = max(nbytes)
            pieces = None
            if source == self.rank:
                if buffer is None:  # nothing wrote it: every rank keeps the sentinel, and the check names it
                    buffer = empty_bytes(self.plan.held[key].nbytes, self.plan.held[key].dtype)
                full = strided(buffer, self.plan.held[key]).to(live.dtype)
                pieces = [_piece(full, chunks[storage][index], width) for chunks in self.chunks]
            mine = local(live)
            # straight into this rank's shard where it is host memory of the piece's size, else through a buffer
            direct = source != self.rank and mine.device.type == "cpu" and mine.is_contiguous() and mine.nbytes == width
            received = mine.view(-1).view(torch.uint8) if direct else torch.empty(width, dtype=torch.uint8)
            if width:  # no rank holds an element (gloo's collectives on empty buffers misbehave: pytorch#85234)
                dist.scatter(received, pieces, src=dist.get_global_rank(self.group, source), group=self.group)
            if source != self.rank:
                if not direct:
                    mine.copy_(received[: nbytes[self.rank]].view(live.dtype).view(mine.shape))
                self.plan.swap.initialized(live)
        if buffer is not None:
            self.plan.replay.recycle(buffer)

    def _stream_agrees(self, replay: Any, events: list[float]) -> bool:
        """Where the next rank's draws start, this rank's stream equals that rank's (module docstring, step 4)."""
        first = replay.first_draw
        starts = all_gathered((first[0], _digest(first[1])) if first else None, self.group)
        later = sorted(start for start in starts if start and replay.last_draw and start[0] > replay.last_draw[0])
        mismatch = False
        if later and replay.last_draw:
            position, expected = later[0]
            counted = self._outputs_between(replay.last_draw[0], position)
            if counted is not None and not any(replay.last_draw[0] < event < position for event in events):
                mismatch = _digest(advance(replay.last_draw[1], counted)) != expected
        if not any(all_gathered(mismatch, self.group)):
            return True
        warnings.warn(
            "lightning_shard: the ranks' random streams disagreed where their shares of the initialisation meet (a "
            f"draw took another count of numbers than torch {torch.__version__}'s kernel was checked to take); every "
            "rank replays the whole construction instead, drawing every number. The weights are the eager build's; "
            "numbers drawn after setup may not be. Please report this with the model.",
            stacklevel=2,
        )
        return False

    def _outputs_between(self, after: float, before: float) -> int | None:
        """The outputs the draws after the draw at ``after`` and before the one at ``before`` take, from the stream's
        offsets; ``None``: a draw up to ``before`` is not counted (the offsets stop there)."""
        if before not in self.offsets:
            return None
        return self.offsets[before] - min(offset for seq, offset in self.offsets.items() if seq > after)


def _splittable(plan: InitPlan) -> bool:
    """The replay is recorded ops only, every draw counted, every tensor cut by chunks of a whole-world mesh."""
    if plan.fallback or plan.scope.before or any(isinstance(op, Overwrite) for op in plan.ops):
        return False
    for op in plan.ops:
        if isinstance(op, Op) and op.random and plan.draws(op) and not draws_elsewhere(op) and outputs_of(op) is None:
            return False
    for storage in plan.targets:
        for _, live in _lives(plan, storage):
            if isinstance(live, DTensor) and (
                live.device_mesh.size() != dist.get_world_size()
                or not all(type(p) in (Shard, Replicate) for p in live.placements)
            ):
                return False
    return True


def _stream_offsets(plan: InitPlan) -> dict[float, int]:
    """Each draw's place in the stream (outputs from its start), by ``seq``, up to the first draw not counted."""
    offsets, total = {}, 0
    for op in plan.ops:
        if isinstance(op, Op) and op.random and plan._draws(op) and not draws_elsewhere(op):
            outputs = outputs_of(op)
            if outputs is None:
                break
            offsets[op.seq] = total
            total += outputs
    return offsets


def _target_order(plan: InitPlan) -> list[int]:
    """The storages to initialise, by the first op they need (ties broken by their holders' names)."""
    first: dict[int, int] = {}
    for index, op in enumerate(plan.ops):
        if op.seq in plan.needed:
            for storage in op.written_storages & plan.targets:
                first.setdefault(storage, index)
    return sorted(plan.targets, key=lambda s: (first.get(s, len(plan.ops)), _names(plan, s)))


def _names(plan: InitPlan, storage: int) -> list[tuple[int, str, str]]:
    return sorted((plan.order[key[0]], key[1], key[2]) for key in plan.keys_by_storage[storage])


def _fingerprint(plan: InitPlan, order: list[int], chunked: int) -> str:
    """The same on ranks that built the same model: the targets in order (holders, bytes, dtype), how many are filled
    in chunks, and the ops."""
    digest = hashlib.sha256(str(chunked).encode())
    for storage in order:
        ref = plan.held[plan.keys_by_storage[storage][0]]
        digest.update(repr((_names(plan, storage), ref.nbytes, str(ref.dtype))).encode())
    for op in plan.ops:
        digest.update(repr((getattr(op.func, "__name__", str(op.func)), op.seq in plan.needed)).encode())
    return digest.hexdigest()


def _lives(plan: InitPlan, storage: int) -> list[tuple[HolderKey, torch.Tensor]]:
    """The distinct live tensors holding ``storage`` (a tie holds one), with a key each."""
    seen: dict[int, tuple[HolderKey, torch.Tensor]] = {}
    for key in plan.keys_by_storage[storage]:
        live = held_tensor(plan.modules, key)
        seen.setdefault(id(live), (key, live))
    return list(seen.values())


def _batches(owned: list[int], plan: InitPlan) -> list[list[int]]:
    batches: list[list[int]] = []
    size = BATCH_BYTES
    for storage in owned:
        nbytes = plan.held[plan.keys_by_storage[storage][0]].nbytes
        if size + nbytes > BATCH_BYTES and (not batches or batches[-1]):
            batches.append([])
            size = 0
        batches[-1].append(storage)
        size += nbytes
    return batches


def _chunk(live: torch.Tensor) -> Chunk:
    return local_chunk(live) if isinstance(live, DTensor) else None


def _numel(chunk: Chunk, live: torch.Tensor) -> int:
    return math.prod(chunk[1] if chunk is not None else live.shape)


def _piece(full: torch.Tensor, chunk: Chunk, width: int) -> torch.Tensor:
    """A rank's chunk of ``full`` as bytes, padded to ``width`` (a scatter sends equal sizes)."""
    part = full if chunk is None else full[tuple(slice(o, o + n) for o, n in zip(*chunk, strict=True))]
    data = part.contiguous().view(-1).view(torch.uint8)
    return torch.nn.functional.pad(data, (0, width - data.numel())) if data.numel() < width else data


def _digest(state: torch.Tensor) -> str:
    return hashlib.sha256(state_bytes(state)).hexdigest()


def _cpu_group() -> Any:
    """The world group where it runs CPU collectives (gloo), else a gloo group of the world made for this (on GPUs:
    the shards go from host memory to host memory, never whole through a device)."""
    backend = str(dist.get_backend())
    return dist.group.WORLD if "gloo" in backend else dist.new_group(backend="gloo")
