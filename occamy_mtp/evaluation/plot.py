"""The pictures of the evaluation: `plot_served`, what export and evaluate draw, has one panel per
serving configuration with the mean accept length at each served step count, donor beside trained;
`plot_acceptance`, the per-step chained acceptance of one set of figures (the teacher-forced ones).

matplotlib is used with the Agg backend (no display), set on the figure, not globally.
"""

from __future__ import annotations

from pathlib import Path

from occamy_mtp.config import PRESETS
from occamy_mtp.evaluation.report import share_of_ceiling

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


PANEL_INCHES = (3.2, 3.6)  # one panel per serving configuration


def _how_far(metrics: dict, label: str, steps) -> str:
    """Under a panel's title: the last head's share of the way from the donor to the ceiling at the most
    steps, and where it loses most beyond its share (`breakdown.largest_loss`); empty where either is unknown."""
    heads, ceiling = list(metrics["heldout"]), metrics.get("ceiling", {}).get(label)
    if "donor" not in heads or len(heads) < 2 or not ceiling:
        return ""
    k, last = str(max(steps)), metrics["heldout"][heads[-1]]["serving"][label]
    share = share_of_ceiling(metrics["heldout"]["donor"]["serving"][label]["served"][k]["mean_accept_length"],
                             last["served"][k]["mean_accept_length"], ceiling[k]["mean_accept_length"])
    words = f"\n{heads[-1]}: {'-' if share is None else format(share, '.0%')} of donor -> ceiling at {k} drafts"
    largest = (last.get("breakdown") or {}).get("largest_loss")
    if largest:
        words += (f"\nlost most: {largest['axis'].replace('_', ' ')} {largest['bucket']} "
                  f"({largest['share_of_lost']:.0%} of lost, {largest['share_of_drafts']:.0%} of drafts)")
    return words


def serving_words(serving: dict) -> str:
    """A serving configuration in words: "greedy", "temperature 0.7, top-p 0.8", and a preset by its
    name: "instruct-general (temperature 0.7, top-p 0.8, top-k 20, presence penalty 1.5)"."""
    thinking = ", thinking" if serving.get("thinking") and serving.get("label", "") not in PRESETS else ""
    if serving["temperature"] == 0:
        return "greedy" + thinking
    words = [f"temperature {serving['temperature']:g}"]
    if serving.get("top_p", 1) < 1:
        words.append(f"top-p {serving['top_p']:g}")
    if serving.get("top_k", 0):
        words.append(f"top-k {serving['top_k']}")
    for name, default in (("presence_penalty", 0), ("frequency_penalty", 0), ("repetition_penalty", 1)):
        if serving.get(name, default) != default:
            words.append(f"{name.replace('_', ' ')} {serving[name]:g}")
    label = serving.get("label", "")
    return f"{label} ({', '.join(words)})" if label in PRESETS else ", ".join(words) + thinking


def plot_served(metrics: dict, path: Path, image_format: str = "png") -> Path:
    """Write `served_figure(metrics)` to `path`."""
    figure = served_figure(metrics)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, format=image_format)
    return path


LABEL_HEIGHT = 0.65  # a bar's two-line label (7 pt), in accept-length units of the panels' scale


def served_figure(metrics: dict):
    """The served figures of `metrics` (export's metrics.json) as a matplotlib Figure: one panel per serving
    configuration, one bar group per served step count, donor beside trained; each bar is the mean accept
    length (tokens a verify pass emits) with one standard error, labelled with it and the first step's
    acceptance; a dashed line marks the ceiling, a perfect drafter's accept length (`metrics["ceiling"]`),
    its value printed at its end, and a label the line would cross is set above it."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    servings, steps = metrics["serving"], metrics["served_steps"]
    heads = list(metrics["heldout"])
    figure = Figure(figsize=(PANEL_INCHES[0] * len(servings), PANEL_INCHES[1]), dpi=DPI)
    FigureCanvasAgg(figure)
    axes_row = figure.subplots(1, len(servings), sharey=True, squeeze=False)[0]
    width = 0.8 / len(heads)
    top = max(steps) + 1
    for axes, serving in zip(axes_row, servings):
        label = serving["label"]
        ceiling = metrics.get("ceiling", {}).get(label)
        others = iter(COLORS * len(heads))
        for n, head in enumerate(heads):
            served = [metrics["heldout"][head]["serving"][label]["served"][str(k)] for k in steps]
            x = [i + (n - (len(heads) - 1) / 2) * width for i in range(len(steps))]
            errors = [s.get("mean_accept_length_se") or 0.0 for s in served]
            bars = axes.bar(x, [s["mean_accept_length"] for s in served], width=width, label=head, yerr=errors,
                            capsize=2, error_kw={"elinewidth": 0.8}, color=DONOR_COLOR if head == "donor" else next(others))
            for i, (bar, s, error) in enumerate(zip(bars, served, errors)):
                y = bar.get_height() + error
                line = ceiling[str(steps[i])]["mean_accept_length"] if ceiling else None
                if line is not None and y - 0.02 <= line <= y + LABEL_HEIGHT:
                    y = line + 0.02  # above the ceiling's line, not struck through by it
                axes.annotate(f"{s['mean_accept_length']:.2f}\n({s['acceptance'][0]:.0%})",
                              (bar.get_x() + bar.get_width() / 2, y), ha="center", va="bottom", fontsize=7)
        for i, k in enumerate(steps if ceiling else []):  # a perfect drafter's accept length
            value = ceiling[str(k)]["mean_accept_length"]
            axes.hlines(value, i - 0.45, i + 0.45, colors="black", linestyles="dashed",
                        linewidth=0.8, label="ceiling (a perfect drafter)" if i == 0 else None)
            axes.annotate(f"{value:.2f}", (i + 0.45, value), ha="left", va="center", fontsize=6)
        axes.set_xticks(range(len(steps)), [f"{k} draft{'s' * (k != 1)}" for k in steps])
        words = serving_words(serving).replace(" (", "\n(").replace(", top-k", ",\ntop-k")  # a preset: its name above
        axes.set_title(words + (" (selected)" if label == metrics.get("selected_serving") and len(servings) > 1 else "")
                       + _how_far(metrics, label, steps), fontsize=7)
        axes.set_ylim(0, top + 0.6)
    axes_row[0].set_ylabel("mean accept length\n(tokens a verify pass emits)", fontsize=8)
    axes_row[0].legend(fontsize=7, loc="upper left")
    figure.suptitle("Mean accept length, donor head vs trained head, ± one standard error\n"
                    "(higher is faster; first-draft acceptance in brackets)", fontsize=9)
    figure.tight_layout()
    return figure
