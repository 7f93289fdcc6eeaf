"""The side groups (``lightning_shard.side_groups``): one gloo group per purpose, made once and handed out again to
every later run in the process, a new one only after it was forgotten or the default group was made again."""

from __future__ import annotations

import tempfile

import torch
import torch.distributed as dist

from lightning_shard.side_groups import forget_side_group, side_group, side_groups_held


def _init_world() -> None:
    dist.init_process_group("gloo", store=dist.FileStore(tempfile.mktemp(), 1), rank=0, world_size=1)


def test_a_purpose_gets_one_group_until_it_is_forgotten_or_the_world_is_made_again() -> None:
    _init_world()
    try:
        vote = side_group("stop-vote")
        assert side_group("stop-vote") is vote  # reused, not made again per run
        save = side_group("async-save")
        assert save is not vote  # purposes never share a group: a background thread uses one of them
        assert {id(g) for g in side_groups_held()} == {id(vote), id(save)}
        tensor = torch.ones(2)
        dist.all_reduce(tensor, group=vote)  # a working gloo group
        assert tensor.tolist() == [1.0, 1.0]
        forget_side_group("stop-vote")  # a vote left waiting in it: never handed out again
        assert side_group("stop-vote") is not vote
    finally:
        dist.destroy_process_group()
    _init_world()
    try:
        assert side_groups_held() == []  # those were made beside the world destroyed above
        assert side_group("async-save") is not save
    finally:
        dist.destroy_process_group()
