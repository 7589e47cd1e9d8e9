"""The frontier: one lever at a time from the default recipe, every serving configuration's figures.

    python bench/frontier.py --models runs/demo/models --out runs/frontier [--levers default,epochs4,...]
            [--store runs/reference/run/self-generated] [--table] [--own-model runs/eval-donor-on-donor/evaluation.json]

Each lever is `configs/demo.yaml` (the default recipe on the embedded default) with overrides,
trained with `train.py`'s own `train()` and measured with `export.py`'s own `export()` (`--allow-worse`,
so that a losing head is measured too), in one process, every lever reading one store of the base's
text (`--store`, copied in when given: a run of the default recipe on the same build has written
most of it). For each serving configuration the table gives the 3-step accept length ± one standard
error over prompts, the share of the way from the donor to the ceiling (a perfect drafter), and the
bucket where the head loses most (`evaluation.breakdown`). Writes each lever's figures into its
run directory and the table of every lever measured under --out into `frontier.md` (so that two
processes may run other levers into one --out); a lever already trained there is measured again, not
retrained. `--table` only writes the table. With `--own-model` (`python -m occamy_mtp evaluate` of the donor
head with the donor model as the base) it adds each head's reach, the share of the way from plain decoding to
a perfect drafter, beside the donor's on the model it was trained with: what this head design reaches when
nothing has drifted.
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from occamy_mtp.config import load_config  # noqa: E402
from occamy_mtp.evaluation.breakdown import one_line  # noqa: E402
from occamy_mtp.evaluation.report import share_of_ceiling  # noqa: E402
from occamy_mtp.settings import RunDir  # noqa: E402
from recipes import chosen, measured, study_parser  # noqa: E402  (bench/, beside this script)

ATTENTION = "[fc,pre_fc_norm_embedding,pre_fc_norm_hidden,norm,layers.0.self_attn]"
LAYER = "[fc,pre_fc_norm_embedding,pre_fc_norm_hidden,norm,layers.0]"
CHAIN = ["train.draft_steps=3", "train.step_loss_weights=[0.5,0.25,0.25]"]
LEVERS = {
    # name: (the lever, what is moved, overrides on configs/demo.yaml)
    "default": ("-", "the default recipe (configs/demo.yaml)", []),
    "epochs4": ("amount", "4 epochs instead of 2 (992 steps)", ["train.epochs=4"]),
    "cont4": ("amount", "4 continuations of each train context (seeds 0-3), 2 epochs of them (1,984 steps)",
              ["data.train_continuations=4"]),
    "greedy-text": ("text", "the train text written greedily (thinking on), not sampled as thinking-general serves",
                    ["data.train_text=greedy"]),
    "mixed": ("text", "the recorded answers beside the base's own text, each window twice", ["data.answers=mixed"]),
    "chain3": ("chain", "the 3-step chain trained (loss weights 0.5/0.25/0.25), not step 1 alone", CHAIN),
    "attention": ("what trains", "mtp.norm and the layer's attention trained too", [f"train.trainable={ATTENTION}"]),
    "layer": ("what trains", "the whole MTP layer trained", [f"train.trainable={LAYER}"]),
    "layer-chain3": ("what trains + chain", "the whole layer on the 3-step chain", [f"train.trainable={LAYER}", *CHAIN]),
    "lr1e-3": ("optimizer", "learning rate 1e-3 instead of 2e-3", ["train.lr=1e-3"]),
    "certainty": ("loss", "top-1 weighted by the base's processed top probability (train.loss=top1-certainty)",
                  ["train.loss=top1-certainty"]),
    "margin": ("loss", "top-1 weighted by p(the base's choice) - p(the head's) (train.loss=top1-margin)",
               ["train.loss=top1-margin"]),
    "kl": ("loss", "KL from the base's processed distribution at thinking-general to the head's (train.loss=kl)", ["train.loss=kl"]),
    "tv": ("loss", "the total variation to it, one minus a sampled draft's acceptance (train.loss=tv)", ["train.loss=tv"]),
}


RESULT = "frontier-result.json"  # in each lever's output.dir: processes running other levers share --out


def run(models: Path, out: Path, names: list[str]) -> dict:
    common = [f"model.base={models / 'base'}", f"model.donor_head={models / 'donor'}",
              f"model.tokenizer={models / 'tokenizer'}", f"data.self_generated_dir={out / 'self-generated'}"]
    for name in names:
        lever, what, overrides = LEVERS[name]
        config = load_config(ROOT / "configs" / "demo.yaml", [*common, *overrides, f"output.dir={out / name}"])
        record, seconds = measured(config)
        result = {"lever": lever, "what": what, "overrides": overrides, "seconds": seconds,
                  "selected_step": record["training"]["selection"]["written_step"],
                  "metrics": json.loads(RunDir.of(config).metrics.read_text())}
        (out / name / RESULT).write_text(json.dumps(result, indent=1))
        print(f"{name}: done in {result['seconds']:.0f} s", flush=True)
    return collected(out)


def collected(out: Path) -> dict:
    """Every lever measured under `out`, in LEVERS' order."""
    return {name: json.loads((out / name / RESULT).read_text()) for name in LEVERS if (out / name / RESULT).is_file()}


def table(results: dict, steps: str = "3") -> str:
    """One row a lever (the donor and the ceiling first): per configuration the accept length at `steps`
    drafts ± its standard error and the share of donor -> ceiling; the default's largest loss per configuration."""
    first = next(iter(results.values()))["metrics"]
    labels = [s["label"] for s in first["serving"]]
    donor, ceiling = first["heldout"]["donor"]["serving"], first["ceiling"]
    lines = ["| lever | recipe | step kept | " + " | ".join(f"{label}: {steps}-step length (share)" for label in labels) + " |",
             "|---|---|---|" + "---|" * len(labels)]
    lines.append("| - | donor | - | " + " | ".join(
        f"{donor[label]['served'][steps]['mean_accept_length']:.3f} ± {donor[label]['served'][steps]['mean_accept_length_se']:.3f}"
        for label in labels) + " |")
    lines.append("| - | ceiling | - | " + " | ".join(f"{ceiling[label][steps]['mean_accept_length']:.3f}" for label in labels) + " |")
    for name, result in results.items():
        served = result["metrics"]["heldout"]["trained"]["serving"]
        cells = []
        for label in labels:
            figure = served[label]["served"][steps]
            share = share_of_ceiling(donor[label]["served"][steps]["mean_accept_length"], figure["mean_accept_length"],
                                     ceiling[label][steps]["mean_accept_length"])
            cells.append(f"{figure['mean_accept_length']:.3f} ± {figure['mean_accept_length_se']:.3f} "
                         f"({'-' if share is None else format(share, '.0%')})")
        lines.append(f"| {result['lever']} | {name}: {result['what']} | {result['selected_step']} | " + " | ".join(cells) + " |")
    default = results.get("default") or next(iter(results.values()))
    lines.append("")
    lines += [f"- {label}: {one_line(default['metrics']['heldout']['trained']['serving'][label].get('breakdown') or {})}"
              for label in labels]
    return "\n".join(lines + ["", breakdown_table(default["metrics"])])


BREAKDOWN_AXES = ("certainty", "step", "span", "answer_position")


def breakdown_table(metrics: dict) -> str:
    """Where the donor's and the trained head's drafts are accepted, beside a perfect drafter at the trained
    head's drafts, per configuration and bucket of BREAKDOWN_AXES (axes of one bucket left out)."""
    lines = ["| configuration | bucket | share of drafts | donor | trained | perfect drafter | share of the drafts lost |",
             "|---|---|---|---|---|---|---|"]
    for serving in metrics["serving"]:
        label = serving["label"]
        donor = metrics["heldout"]["donor"]["serving"][label].get("breakdown")
        trained = metrics["heldout"]["trained"]["serving"][label].get("breakdown")
        if not (donor and trained):
            continue
        total = trained["total"]["proposed"]
        for axis in BREAKDOWN_AXES:
            if len(trained[axis]) < 2:
                continue
            for key, tally in trained[axis].items():
                before = donor[axis].get(key, {}).get("acceptance")
                lines.append(f"| {label} | {axis.replace('_', ' ')} {key} | {tally['proposed'] / total:.0%} | "
                             f"{'-' if before is None else format(before, '.1%')} | {tally['acceptance']:.1%} | "
                             f"{tally['ceiling_acceptance']:.1%} | {tally['share_of_lost']:.0%} |")
    return "\n".join(lines)


def reach(length: float, ceiling: float) -> float:
    """How far an accept length goes from plain decoding (1 token a pass) to a perfect drafter's."""
    return (length - 1) / (ceiling - 1) if ceiling > 1 else 0.0


def reach_table(results: dict, own: dict, steps: str = "3") -> str:
    """Each head's reach (`reach`) per configuration beside the donor's on the model it was trained with
    (`own`: `evaluate`'s evaluation.json with the donor model as the base): what this head design reaches
    when nothing has drifted, the yardstick a head adapted to the fine-tuned base can be held to."""
    first = next(iter(results.values()))["metrics"]
    labels = [s["label"] for s in first["serving"]]
    rows = [("the donor on its own model", {label: reach(own["heads"]["donor"]["serving"][label]["served"][steps]["mean_accept_length"],
                                                         own["ceiling"][label][steps]["mean_accept_length"]) for label in labels})]
    ceiling = first["ceiling"]
    rows.append(("the donor on the fine-tuned base", {label: reach(
        first["heldout"]["donor"]["serving"][label]["served"][steps]["mean_accept_length"], ceiling[label][steps]["mean_accept_length"])
        for label in labels}))
    for name, result in results.items():
        served = result["metrics"]["heldout"]["trained"]["serving"]
        rows.append((f"{name} on the fine-tuned base", {label: reach(served[label]["served"][steps]["mean_accept_length"],
                                                                     ceiling[label][steps]["mean_accept_length"]) for label in labels}))
    lines = ["| head | " + " | ".join(f"{label}: {steps}-step reach" for label in labels) + " |", "|---|" + "---|" * len(labels)]
    lines += [f"| {name} | " + " | ".join(f"{values[label]:.0%}" for label in labels) + " |" for name, values in rows]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = study_parser(__doc__.split("\n\n")[0], "lever", LEVERS)
    parser.add_argument("--store", type=Path, help="a store of the base's text on the same build to start from (copied)")
    parser.add_argument("--table", action="store_true", help="only write the table of the levers measured under --out")
    parser.add_argument("--own-model", type=Path, help="evaluate's evaluation.json of the donor head on the donor model: "
                        "adds each head's reach beside the donor's there (`reach_table`)")
    args = parser.parse_args(argv)
    names = chosen(args, "lever", LEVERS)
    if names is None:
        return 2
    if args.store is not None and not (args.out / "self-generated").exists():
        shutil.copytree(args.store, args.out / "self-generated")
    results = collected(args.out) if args.table else run(args.models, args.out, names)
    text = table(results)
    if args.own_model is not None:
        text += "\n\n" + reach_table(results, json.loads(args.own_model.read_text()))
    (args.out / "frontier.md").write_text(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
