"""torch.distributed.checkpoint (DCP) and torch's archive format: the nested-dict writer, the paused garbage
collector, a file view and the zip-archive reader, the readers' per-item and per-request hooks a subclass overrides,
a keyed read with no state dict to load into.

Takes checkpoint paths, readers and state dicts; gives what DCP and ``torch.load`` do without a public name.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.checkpoint._traverse import set_element  # noqa: F401  (re-exported)
from torch.distributed.checkpoint.state_dict import _gc_context as gc_paused  # noqa: F401  (re-exported)
from torch.distributed.checkpoint.utils import _create_file_view as file_view  # noqa: F401  (re-exported)

# torch's zip-archive reader (``torch.load`` uses it; ``get_record_offset`` is what ``torch.load(mmap=True)`` uses).
PyTorchFileReader = torch._C.PyTorchFileReader


# Where torch.distributed.checkpoint's ``FileSystemReader.read_data`` reads each stored item from its file: a subclass
# that overrides it sees every item's bytes (lightning_shard.checkpoint.reader verifies their checksums there).
DCP_READER_SLICE_HOOK = "_slice_file"


# The per-request hook of torch.distributed.checkpoint's ``HuggingFaceStorageReader.read_data``: a subclass that
# overrides it reads each request its own way (lightning_shard.hf's slice reader).
HF_READER_REQUEST_HOOK = "_process_read_request"


def load_state_dict_from_keys(keys: set[str] | None, checkpoint_id: str, reader: Any = None) -> dict[str, Any]:
    """Read ``keys`` (all if ``None``) of a DCP checkpoint whole into this process, with no state dict to load into;
    ``reader``: its ``StorageReader`` (default: a ``FileSystemReader``).

    Example:
        >>> load_state_dict_from_keys({"global_step"}, "out/last.ckpt")  # doctest: +SKIP
        {'global_step': 200}
    """
    from torch.distributed.checkpoint.default_planner import _EmptyStateDictLoadPlanner
    from torch.distributed.checkpoint.filesystem import FileSystemReader
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

    # no_dist: the read is this process's alone, also inside a process group (torch's `_load_state_dict_from_keys`
    # would run collectives then, and hang when one rank reads, as `convert` does), as `dcp_to_torch_save` reads.
    state: dict[str, Any] = {}
    _load_state_dict(
        state,
        storage_reader=reader or FileSystemReader(checkpoint_id),
        planner=_EmptyStateDictLoadPlanner(keys=keys),
        no_dist=True,
    )
    return state


def check_hf_reader_hook(reader_class: type) -> None:
    """Fail loudly if ``HuggingFaceStorageReader`` no longer reads through the per-request hook a subclass
    overrides: the subclass would be bypassed silently and every rank would read whole files.

    Example:
        >>> from torch.distributed.checkpoint import HuggingFaceStorageReader
        >>> check_hf_reader_hook(HuggingFaceStorageReader)
    """
    if not callable(getattr(reader_class, HF_READER_REQUEST_HOOK, None)):
        raise RuntimeError(
            f"torch {torch.__version__}'s {reader_class.__name__} has no `{HF_READER_REQUEST_HOOK}`, which "
            "lightning_shard.hf's shard-wise reader overrides; this torch is outside the tested range (see "
            "pyproject.toml). Install a torch in that range."
        )
