"""The goodput figure: per workload, one panel per regime and interval, the training-time
overhead of each system (horizontal bars, percent). Needs matplotlib (the ``bench`` extra)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

OURS = ("callback", "plugin", "incremental")


def write_png(summary: dict[str, Any], path: Path) -> None:
    """Write the figure to ``path``. Raises ImportError without matplotlib."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows: dict[str, list[dict[str, Any]]] = {}
    for cell in summary["cells"]:
        rows.setdefault(cell["workload"], []).append(cell)
    if not rows:
        return
    width = max(len(cells) for cells in rows.values())
    fig, axes = plt.subplots(
        len(rows), width, figsize=(3.2 * width + 1, 2.9 * len(rows) + 0.6), squeeze=False
    )
    for r, (workload, cells) in enumerate(rows.items()):
        for c in range(width):
            ax = axes[r][c]
            if c >= len(cells):
                ax.axis("off")
                continue
            cell = cells[c]
            figures = {n: f for n, f in cell["systems"].items() if "overhead" in f}
            figures.pop("none", None)
            names = list(figures)[::-1]
            values = [100 * figures[n]["overhead"] for n in names]
            colors = ["tab:blue" if n.startswith(OURS) else "tab:gray" for n in names]
            ax.barh(names, values, color=colors)
            for y, v in enumerate(values):  # right of the bar, or of zero for a negative one
                ax.annotate(f"{v:+.1f}", (max(v, 0), y), fontsize=7, va="center",
                            xytext=(2, 0), textcoords="offset points")  # fmt: skip
            ax.margins(x=0.18)
            ax.axvline(0, color="black", linewidth=0.6)
            every = "auto" if cell["interval"] is None else f"every {cell['interval']}"
            ax.set_title(f"{workload}: {cell['regime']}, {every}", fontsize=9)
            ax.tick_params(labelsize=7)
            ax.set_xlabel("overhead %", fontsize=8)
            ax.grid(True, axis="x", alpha=0.3)
    fig.suptitle("Training time lost to checkpointing (vs no checkpoints)", fontsize=11)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
