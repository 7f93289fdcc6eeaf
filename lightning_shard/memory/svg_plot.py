"""The per-rank memory plot as an SVG file, drawn with the standard library: one panel per metric, one line per rank,
MiB over steps. Any browser or image viewer opens it; nothing beyond the package is installed for it.

Example:
    >>> history = [{"step": s, "ranks": [{"params_bytes": 2**20 * s}, {"params_bytes": 2**21}]} for s in (1, 2)]
    >>> svg = memory_svg(history)
    >>> svg.startswith("<svg") and svg.count("<polyline") == 2
    True
"""

from __future__ import annotations

from pathlib import Path
from typing import Any
from xml.sax.saxutils import escape

MIB = 2**20
WIDTH, PANEL_HEIGHT = 640, 150
LEFT, RIGHT, TOP, BOTTOM = 72, 16, 40, 34  # margins of a panel's plotting area
# Colour-blind-safe (Okabe-Ito); ranks beyond them reuse the list.
COLOURS = ("#0072B2", "#E69F00", "#009E73", "#D55E00", "#CC79A7", "#56B4E9", "#F0E442", "#000000")


def _title(metric: str) -> str:
    return metric.removesuffix("_bytes").replace("_", " ") + " (MiB)"


def _dashes(rank: int) -> str:
    """Rank 0 solid, the others dashed: ranks that hold the same bytes stay visible on top of each other."""
    return f' stroke-dasharray="{3 + 3 * rank} 3"' if rank else ""


def _span(low: float, high: float) -> tuple[float, float]:
    """A non-empty range around ``[low, high]`` (a flat series is drawn in the middle)."""
    if high - low < 1e-9 * max(abs(high), 1.0):
        pad = max(abs(high) * 0.05, 0.5)
        return low - pad, high + pad
    return low, high


def _panel(top: int, metric: str, steps: list[int], series: list[list[float]]) -> list[str]:
    x0, x1 = LEFT, WIDTH - RIGHT
    y0, y1 = top + PANEL_HEIGHT - BOTTOM, top + TOP
    first, last = _span(min(steps), max(steps))
    low, high = _span(min(min(values) for values in series), max(max(values) for values in series))

    def x(step: float) -> float:
        return x0 + (step - first) / (last - first) * (x1 - x0)

    def y(value: float) -> float:
        return y0 - (value - low) / (high - low) * (y0 - y1)

    parts = [
        f'<text x="{x0}" y="{top + 24}" font-weight="bold">{escape(_title(metric))}</text>',
        f'<rect x="{x0}" y="{y1}" width="{x1 - x0}" height="{y0 - y1}" fill="none" stroke="#999"/>',
    ]
    for value in (low, (low + high) / 2, high):
        parts.append(f'<line x1="{x0}" x2="{x1}" y1="{y(value):.1f}" y2="{y(value):.1f}" stroke="#eee"/>')
        parts.append(f'<text x="{x0 - 6}" y="{y(value) + 4:.1f}" text-anchor="end">{value:.2f}</text>')
    for step in sorted({min(steps), max(steps)}):
        parts.append(f'<text x="{x(step):.1f}" y="{y0 + 16}" text-anchor="middle">{step}</text>')
    for rank, values in enumerate(series):
        colour = COLOURS[rank % len(COLOURS)]
        points = " ".join(f"{x(step):.1f},{y(value):.1f}" for step, value in zip(steps, values, strict=True))
        parts.append(f'<polyline points="{points}" fill="none" stroke="{colour}" stroke-width="2"{_dashes(rank)}/>')
        parts += [
            f'<circle cx="{p.split(",")[0]}" cy="{p.split(",")[1]}" r="2.5" fill="{colour}"/>' for p in points.split()
        ]
    return parts


def memory_svg(history: list[dict[str, Any]]) -> str:
    """The SVG text for a history of samples (``{"step": s, "ranks": [{metric: bytes, ...}, ...]}``)."""
    metrics = list(history[0]["ranks"][0])
    steps = [sample["step"] for sample in history]
    world_size = len(history[0]["ranks"])
    height = PANEL_HEIGHT * len(metrics) + 30
    parts = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{height}" font-family="sans-serif" '
        f'font-size="11"><rect width="100%" height="100%" fill="white"/>'
    ]
    for rank in range(world_size):  # the legend
        colour, left = COLOURS[rank % len(COLOURS)], LEFT + 70 * rank
        parts.append(
            f'<line x1="{left}" x2="{left + 18}" y1="14" y2="14" stroke="{colour}" stroke-width="3"{_dashes(rank)}/>'
        )
        parts.append(f'<text x="{left + 22}" y="18">rank {rank}</text>')
    for index, metric in enumerate(metrics):
        series = [[sample["ranks"][rank][metric] / MIB for sample in history] for rank in range(world_size)]
        parts += _panel(20 + index * PANEL_HEIGHT, metric, steps, series)
    parts.append(f'<text x="{(LEFT + WIDTH - RIGHT) // 2}" y="{height - 4}" text-anchor="middle">step</text>')
    return "\n".join([*parts, "</svg>\n"])


def write_svg_plot(history: list[dict[str, Any]], path: Path) -> str:
    """Write :func:`memory_svg` to ``path``; return a line saying where.

    Example:
        >>> write_svg_plot(history, Path("memory.svg"))  # doctest: +SKIP
        'memory plot written to memory.svg (open it in a browser)'
    """
    path.write_text(memory_svg(history))
    return f"memory plot written to {path} (open it in a browser)"
