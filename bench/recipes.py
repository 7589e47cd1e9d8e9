"""Recipes compared where serving runs the head: one demo build, the same heldout, one run.

    python bench/recipes.py --models runs/demo/models --out runs/recipes [--recipes data,default,...]

Each recipe is the greedy-text recipe's config (`configs/demo-greedy.yaml`, the embedded default until
the default moved to the card's thinking mode) with overrides. It is
trained with `train.py`'s own `train()` and measured with `export.py`'s own `export()`
(`--allow-worse`, so that a losing head is measured too), all in one process and
sharing one store of self-generated windows, so every recipe is measured on the same
heldout windows with the same code. The table lists the headline under each serving
configuration of `eval.serving` (greedy: the reference decoder's acceptance on the base's
own greedy text, decoder replay; temperature 0.7 / top-p 0.8: the decoder's expected
counts on the base's sampled text; K = 1 and 3) for the donor and each recipe, then the
secondary teacher-forced figures. Writes `recipes.json` and `recipes.md` into --out.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from occamy_mtp.config import load_config  # noqa: E402
from occamy_mtp.export.exporter import export  # noqa: E402
from occamy_mtp.run import RunDir  # noqa: E402
from occamy_mtp.train.loop import train  # noqa: E402
from occamy_mtp.settings import plan_of  # noqa: E402

NO_SELECTION = "train.select_every_steps=0"
# The serving configurations these recipes were compared under (bench/results/recipes-compared.md):
# greedy and t0.7-p0.8, set here since the default became greedy and the card's presets.
SERVING = "eval.serving=[{temperature: 0}, {temperature: 0.7, top_p: 0.8}]"
FOR_SAMPLED = "eval.select_serving=t0.7-p0.8"  # select and refuse by the second of SERVING
SAMPLED_TEXT = ["data.train_text={temperature: 0.7, top_p: 0.8}"]
RECIPES = {
    # name: (what it is, overrides on configs/demo-greedy.yaml)
    "data": ("recorded answers, last step (the original recipe)", ["data.answers=data", NO_SELECTION]),
    "data-select": ("recorded answers, best validation step", ["data.answers=data"]),
    "selfgen": ("self-generated answers, last step", [NO_SELECTION]),
    "default": ("self-generated greedy answers, best validation step (configs/demo-greedy.yaml)", []),
    "mixed": ("recorded + self-generated answers, best validation step", ["data.answers=mixed"]),
    "lr5e-4": ("as default, lr 5e-4", ["train.lr=5e-4"]),
    "steps1024": ("as default, 4 epochs (1024 steps)", ["train.epochs=4"]),
    "mtp3": ("as default, 3-step chain loss (0.5/0.25/0.25)", ["train.draft_steps=3", "train.step_loss_weights=[0.5,0.25,0.25]"]),
    "wide": ("as default, also trains mtp.norm and the attention", [
        "train.trainable=[fc,pre_fc_norm_embedding,pre_fc_norm_hidden,norm,layers.0.self_attn]"]),
    "wide-mtp3": ("as wide, 3-step chain loss (0.5/0.25/0.25)", [
        "train.trainable=[fc,pre_fc_norm_embedding,pre_fc_norm_hidden,norm,layers.0.self_attn]",
        "train.draft_steps=3", "train.step_loss_weights=[0.5,0.25,0.25]"]),
    "layer": ("as default, trains the whole layer (its experts too)", [
        "train.trainable=[fc,pre_fc_norm_embedding,pre_fc_norm_hidden,norm,layers.0]"]),
    "layer-mtp3": ("as layer, 3-step chain loss (0.5/0.25/0.25)", [
        "train.trainable=[fc,pre_fc_norm_embedding,pre_fc_norm_hidden,norm,layers.0]",
        "train.draft_steps=3", "train.step_loss_weights=[0.5,0.25,0.25]"]),
    # For sampled serving (temperature 0.7, top-p 0.8): selection and the refusal by it, the
    # distribution losses against the base's processed distribution, the train text sampled.
    "top1-select-t0.7": ("as default, best validation step at t0.7-p0.8", [FOR_SAMPLED]),
    "top1-text-t0.7": ("as default, train text sampled at t0.7-p0.8, selected there", [FOR_SAMPLED, *SAMPLED_TEXT]),
    "kl-t0.7": ("KL to the base's t0.7-p0.8 distribution, greedy train text, selected at t0.7-p0.8",
                [FOR_SAMPLED, "train.loss=kl"]),
    "tv-t0.7": ("total variation to the base's t0.7-p0.8 distribution, greedy train text, selected at t0.7-p0.8",
                [FOR_SAMPLED, "train.loss=tv"]),
    "kl-text-t0.7": ("as kl-t0.7, train text sampled at t0.7-p0.8", [FOR_SAMPLED, "train.loss=kl", *SAMPLED_TEXT]),
    "tv-text-t0.7": ("as tv-t0.7, train text sampled at t0.7-p0.8", [FOR_SAMPLED, "train.loss=tv", *SAMPLED_TEXT]),
}


def measured(config) -> tuple[dict, float]:
    """`config`'s run trained (unless it is already) and exported with `--allow-worse`: (its TRAINING.json
    record, the seconds both took)."""
    started = time.perf_counter()
    if not RunDir.of(config).train_summary.is_file():
        train(plan_of(config))
    record = export(plan_of(config), allow_worse=True, log=lambda message: None)
    return record, time.perf_counter() - started


def study_parser(description: str, kind: str, known: dict) -> argparse.ArgumentParser:
    """The command line a study of named runs on one demo build shares: --models, --out and --<kind>s (`chosen`)."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--models", type=Path, required=True, help="a demo build (python -m occamy_mtp demo-models)")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument(f"--{kind}s", default=",".join(known), help=f"comma-separated, of: {', '.join(known)}")
    return parser


def chosen(args, kind: str, known: dict) -> list[str] | None:
    """The names `--<kind>s` gives (None, said on stderr, when one is not in `known`); seeds torch and
    makes --out, as every study starts."""
    names = [n for n in getattr(args, f"{kind}s").split(",") if n]
    missing = [n for n in names if n not in known]
    if missing:
        print(f"error: unknown {kind} {missing[0]!r}; known: {', '.join(known)}", file=sys.stderr)
        return None
    torch.manual_seed(0)
    args.out.mkdir(parents=True, exist_ok=True)
    return names


def run(models: Path, out: Path, names: list[str], decoder_check_windows: int) -> dict:
    common = [
        f"model.base={models / 'base'}",
        f"model.donor_head={models / 'donor'}",
        f"data.self_generated_dir={out / 'self-generated'}",
        f"eval.decoder_check_windows={decoder_check_windows}",
        SERVING,
    ]
    results = {}
    for name in names:
        what, overrides = RECIPES[name]
        config = load_config(ROOT / "configs" / "demo-greedy.yaml", [*common, *overrides, f"output.dir={out / name}"])
        record, seconds = measured(config)
        results[name] = {
            "what": what,
            "overrides": overrides,
            "seconds": seconds,
            "selected_step": record["training"]["selection"]["written_step"],
            "metrics": json.loads(RunDir.of(config).metrics.read_text()),
        }
        print(f"{name}: done in {results[name]['seconds']:.0f} s", flush=True)
        (out / "recipes.json").write_text(json.dumps(results, indent=1))
    return results


def table(results: dict) -> str:
    """One row a recipe (the donor first): the served figures under each serving configuration, then
    the secondary ones."""
    first = next(iter(results.values()))["metrics"]
    labels = [s["label"] for s in first["serving"]]
    donor = first["heldout"]["donor"]
    rows = [("donor", "the donor's head, unchanged", "-", donor)]
    rows += [(name, r["what"], str(r["selected_step"]), r["metrics"]["heldout"]["trained"]) for name, r in results.items()]
    served = "".join(f" {label}: K=1 acc | {label}: K=1 length | {label}: K=3 acc (1/2/3) | {label}: K=3 length |"
                     for label in labels)
    lines = [
        f"| recipe | what | step |{served} teacher-forced agreement | teacher-forced K=3 length (approx.) |",
        "|---|---|---|" + "---|" * (4 * len(labels) + 2),
    ]
    for name, what, step, report in rows:
        cells = []
        for label in labels:
            k1, k3 = (report["serving"][label]["served"][k] for k in ("1", "3"))
            cells += [f"{k1['acceptance'][0]:.1%}", f"{k1['mean_accept_length']:.3f}",
                      "/".join(f"{a:.1%}" for a in k3["acceptance"]), f"{k3['mean_accept_length']:.3f}"]
        teacher = report["teacher_forced"]
        cells += [f"{teacher['agreement']:.1%}", f"{teacher['mean_accept_length']:.3f}"] if teacher else ["absent", "absent"]
        lines.append(f"| {name} | {what} | {step} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = study_parser(__doc__.split("\n\n")[0], "recipe", RECIPES)
    parser.add_argument("--decoder-check-windows", type=int, default=0, help="eval.decoder_check_windows for every recipe")
    args = parser.parse_args(argv)
    names = chosen(args, "recipe", RECIPES)
    if names is None:
        return 2
    results = run(args.models, args.out, names, args.decoder_check_windows)
    text = table(results)
    (args.out / "recipes.md").write_text(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
