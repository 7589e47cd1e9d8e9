"""One small picture of the evaluation: per-step chained acceptance, one bar group per step,
one bar per head (donor vs trained), with each head's mean accept length in the legend.

matplotlib is used with the Agg backend (no display), set on the figure, not globally.
"""

from __future__ import annotations

from pathlib import Path

FIGURE_INCHES = (6.0, 3.6)
DPI = 120
DONOR_COLOR = "#8c8c8c"  # the donor in grey, every other head in colour
COLORS = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728")


def plot_acceptance(results: dict[str, dict], path: Path, title: str = "chained acceptance", image_format: str = "png") -> Path:
    """Write a bar chart of acc_k for k = 1..K for each named figures dict (`Metrics.to_dict()`,
    `Acceptance.to_dict()`) to `path`, as `image_format` whatever the file's suffix."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    names = list(results)
    steps = max(r["draft_steps"] for r in results.values())
    figure = Figure(figsize=FIGURE_INCHES, dpi=DPI)
    FigureCanvasAgg(figure)
    axes = figure.add_subplot(1, 1, 1)
    width = 0.8 / len(names)
    others = iter(COLORS * len(names))
    for n, name in enumerate(names):
        metrics = results[name]
        x = [k + (n - (len(names) - 1) / 2) * width for k in range(metrics["draft_steps"])]
        heights = [100.0 * a for a in metrics["acceptance"]]
        label = f"{name} (accept length {metrics['mean_accept_length']:.2f})"
        bars = axes.bar(x, heights, width=width, label=label, color=DONOR_COLOR if name == "donor" else next(others))
        for bar, count, proposed in zip(bars, metrics["accepted"], metrics["proposed"]):
            axes.annotate(f"{count}/{proposed}", (bar.get_x() + bar.get_width() / 2, bar.get_height()),
                          ha="center", va="bottom", fontsize=7)
    axes.set_xticks(range(steps), [f"step {k + 1}" for k in range(steps)])
    axes.set_ylim(0, 110)
    axes.set_ylabel("accepted / proposed (%)")
    axes.set_title(title, fontsize=10)
    axes.legend(fontsize=8, loc="upper right")
    figure.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, format=image_format)
    return path
