"""The PNG figure: per scenario, bytes written per checkpoint and the training stall per
checkpoint, one line per system (log scales; lower is better in every panel, which the
figure's title says). Needs matplotlib (the ``bench`` extra)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

OURS = "incremental"


def _by_scenario(records: list[dict[str, Any]]) -> dict[str, dict[str, list[dict[str, Any]]]]:
    out: dict[str, dict[str, list[dict[str, Any]]]] = {}
    for r in records:
        out.setdefault(r["scenario"], {}).setdefault(r["system"], []).append(r)
    for systems in out.values():
        for recs in systems.values():
            recs.sort(key=lambda r: r["checkpoint"])
    return out


def write_png(records: list[dict[str, Any]], path: Path, title: str) -> None:
    """Write the figure to ``path``. Raises ImportError without matplotlib."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FuncFormatter, LogLocator

    scenarios = _by_scenario(records)
    systems = list(dict.fromkeys(r["system"] for r in records))
    colors = {name: plt.get_cmap("tab10")(i % 10) for i, name in enumerate(systems)}
    fig, axes = plt.subplots(
        len(scenarios), 2, figsize=(12, 2.6 * len(scenarios) + 1.2), squeeze=False
    )
    for row, (scenario, by_system) in enumerate(scenarios.items()):
        bytes_ax, stall_ax = axes[row]
        for name in systems:
            recs = by_system.get(name)
            if not recs:
                continue
            x = [r["checkpoint"] for r in recs]
            ours = name.startswith(OURS)  # the engine, and the engine through Lightning
            style = {
                "color": colors[name],
                "marker": "o",
                "markersize": 4,
                "linewidth": 2.6 if name == OURS else 1.6 if ours else 1.2,
                # dashed and above: identical byte counts leave the engine's line visible
                "linestyle": "--" if ours and name != OURS else "-",
                "zorder": 4 if ours else 2,
                "label": name,
            }
            bytes_ax.plot(x, [max(r["bytes_written"], 1) / 1e6 for r in recs], **style)
            stall_ax.plot(x, [max(r["stall_s"], 1e-4) * 1e3 for r in recs], **style)
        steps = [r["step"] for r in next(iter(by_system.values()))]
        # a scenario that saves without training between saves ("unchanged") saves the same
        # step again and again: its checkpoints are numbered, the step said once
        repeated = len(set(steps)) < len(steps)
        ticks = [f"#{i + 1}" for i in range(len(steps))] if repeated else [str(s) for s in steps]
        at = f" (each at step {steps[0]})" if repeated and len(set(steps)) == 1 else ""
        for ax, label in ((bytes_ax, "MB written"), (stall_ax, "stall ms")):
            ax.set_yscale("log")
            ax.yaxis.set_major_locator(LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
            ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
            ax.yaxis.set_minor_formatter(FuncFormatter(lambda v, _: ""))
            ax.set_ylabel(label)
            ax.set_xticks(range(len(steps)), ticks)
            ax.grid(True, which="major", alpha=0.3)
        bytes_ax.set_title(f"{scenario}: bytes written per checkpoint{at}", fontsize=10)
        stall_ax.set_title(f"{scenario}: training stall per checkpoint{at}", fontsize=10)
    for ax in axes[-1]:
        ax.set_xlabel("checkpoint at training step (#n: the n-th checkpoint of one step)")
    handles, labels = axes[0][0].get_legend_handles_labels()
    top = 1 - 0.75 / fig.get_figheight()  # room for the legend (and its title) above the axes
    fig.tight_layout(rect=(0, 0, 1, top))
    fig.legend(
        handles,
        labels,
        loc="lower center",
        bbox_to_anchor=(0.5, top),
        ncol=min(len(labels), 8),
        fontsize=9,
        title=title,
        title_fontsize=10,
        frameon=False,
    )
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
