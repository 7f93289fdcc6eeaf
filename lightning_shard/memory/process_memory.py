"""Process-level memory figures: host RSS on every platform, the CUDA caching allocator's peaks on GPU."""

import resource
import sys

import psutil
import torch

# ru_maxrss is in KiB on Linux and in bytes on macOS.
_MAXRSS_UNIT = 1 if sys.platform == "darwin" else 1024


def host_memory() -> dict[str, int]:
    """Resident set size of this process now and at its peak, in bytes.

    Example:
        >>> sorted(host_memory())
        ['peak_rss_bytes', 'rss_bytes']
    """
    rss = psutil.Process().memory_info().rss
    # The kernel updates the high-water mark lazily, so it can briefly trail the current RSS.
    peak = max(rss, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * _MAXRSS_UNIT)
    return {"rss_bytes": rss, "peak_rss_bytes": peak}


CUDA_KEYS = ("cuda_max_allocated_bytes", "cuda_max_reserved_bytes", "cuda_peak_active_bytes")


def cuda_memory(device: torch.device) -> dict[str, int]:
    """Peak allocated, reserved and active bytes of the CUDA caching allocator on ``device`` since the start.

    Example:
        >>> cuda_memory(torch.device("cuda", 0))  # doctest: +SKIP
        {'cuda_max_allocated_bytes': ..., 'cuda_max_reserved_bytes': ..., 'cuda_peak_active_bytes': ...}
    """
    stats = torch.cuda.memory_stats(device)
    return dict(
        zip(
            CUDA_KEYS,
            (
                torch.cuda.max_memory_allocated(device),
                torch.cuda.max_memory_reserved(device),
                stats.get("active_bytes.all.peak", 0),
            ),
            strict=True,
        )
    )
