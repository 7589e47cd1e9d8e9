"""The head's model card: README.md beside the exported head, in the Hugging Face layout.

Written by export from the run's TRAINING.json alone, so that the card says nothing the record
does not: YAML metadata (base_model, library_name, tags), a one-paragraph summary (what was
trained, from which donor, on how many windows, what stayed frozen), the training facts, the
served acceptance per serving configuration (donor beside trained, accepted / proposed, and the
ceiling where it is known), what was not validated, the commands that serve the head, its hash
and the files. Export writes it into `upload/` beside links to the files it lists, so that publishing
is `hf upload ORG/NAME OUTPUT_DIR/upload` (no uploader of our own) and nothing else of the run (the
base's text of the user's prompts, checkpoints) goes with it; and at the run's root as README.md,
unless a README.md that this library did not write is there (`writes_root_card`).
"""

from __future__ import annotations

import shlex
from pathlib import Path

import yaml

from occamy_mtp.console import plural
from occamy_mtp.evaluation.breakdown import one_line
from occamy_mtp.evaluation.report import prompts_of, share_of_ceiling, with_error
from occamy_mtp.evaluation.plot import serving_words
from occamy_mtp.model import checkpoint as ckpt_io

LIBRARY_NAME = "occamy-mtp"
TAGS = ("speculative-decoding", "mtp", "multi-token-prediction", "draft-model")


def hub_id(path: str) -> str | None:
    """org/name of a Hub snapshot directory (`.../models--org--name/snapshots/<commit>`), else None."""
    for part in Path(path).parts:
        if part.startswith("models--"):
            return part.removeprefix("models--").replace("--", "/", 1)
    return None


def _model_name(identity: dict) -> str:
    return hub_id(identity["path"]) or Path(identity["path"]).name


def front_matter(path: Path) -> dict:
    """The YAML metadata block a model card opens with (`---` lines), {} for a file without one or that
    cannot be read as one."""
    try:
        text = path.read_text(encoding="utf-8", errors="replace")[:65536]
    except OSError:
        return {}
    if not text.startswith("---"):
        return {}
    try:
        meta = yaml.safe_load(text.split("---", 2)[1])
    except (yaml.YAMLError, IndexError):
        return {}
    return meta if isinstance(meta, dict) else {}


def writes_root_card(path: Path) -> bool:
    """Whether export may write the card at `path` (the run's README.md): nothing is there, or a card this
    library wrote (`library_name: occamy-mtp`). A user's own file there is never replaced."""
    return not path.exists() or (path.is_file() and front_matter(path).get("library_name") == LIBRARY_NAME)


def base_card_license(base_path: str) -> str | None:
    """The `license` of the base's own card (its README.md's metadata), where it has one: a head derived
    from the base is published under the base's terms."""
    value = front_matter(Path(base_path) / "README.md").get("license")
    return str(value) if value else None


def _count(accepted: float, proposed: float) -> str:
    """accepted / proposed: whole counts under greedy serving, expected (fractional) ones under sampling."""
    if float(accepted).is_integer() and float(proposed).is_integer():
        return f"{int(accepted):,} / {int(proposed):,}"
    return f"{accepted:,.1f} / {proposed:,.1f} (expected)"


def acceptance_table(metrics: dict) -> list[str]:
    """One row per serving configuration and served step count: first-step acceptance and the mean
    accept length, donor beside trained, and the ceiling a perfect drafter reaches where it is known."""
    heldout, ceilings = metrics["heldout"], metrics.get("ceiling", {})
    rows = [
        "| serving | drafts | donor: accepted / proposed (step 1) | trained: accepted / proposed (step 1) "
        "| accept length, donor → trained | ceiling | share of donor → ceiling |",
        "|---|---|---|---|---|---|---|",
    ]
    for serving in metrics["serving"]:
        label = serving["label"]
        for k in metrics["served_steps"]:
            donor = heldout["donor"]["serving"][label]["served"][str(k)]
            trained = heldout["trained"]["serving"][label]["served"][str(k)]
            # A perfect drafter drafts the base's own choice (metrics["ceiling"], `served.ceiling_report`).
            top = ceilings.get(label, {}).get(str(k))
            ceiling = f"{top['mean_accept_length']:.3f}" if top else "not measured"
            share = share_of_ceiling(donor["mean_accept_length"], trained["mean_accept_length"],
                                     top["mean_accept_length"]) if top else None
            rows.append(
                f"| {serving_words(serving)} | {k}-step | {_count(donor['accepted'][0], donor['proposed'][0])} ({donor['acceptance'][0]:.2%}) "
                f"| {_count(trained['accepted'][0], trained['proposed'][0])} ({trained['acceptance'][0]:.2%}) "
                f"| {with_error(donor)} → **{with_error(trained)}** | {ceiling} "
                f"| {'-' if share is None else format(share, '.1%')} |")
    return rows


def where_lost(metrics: dict) -> list[str]:
    """One line per serving configuration: where the trained head's drafts fall short of a perfect drafter's
    most (`breakdown.largest_loss`), at the largest served step count; nothing for a record without it."""
    lines = []
    for serving in metrics["serving"]:
        figures = metrics["heldout"]["trained"]["serving"][serving["label"]].get("breakdown")
        if figures:
            total = figures["total"]
            lines.append(f"- {serving['label']}, {figures['draft_steps']}-step: the trained head's drafts are accepted "
                         f"{total['acceptance']:.1%} of the time where a perfect drafter's would be {total['ceiling_acceptance']:.1%}; "
                         f"{one_line(figures)}.")
    if not lines:
        return []
    return ["Where the trained head still loses drafts (by the base's certainty at the position, the thinking or "
            "answer span, the position in the answer and the context's length; metrics.json has each bucket):", "",
            *lines, ""]


def model_card(record: dict, head_dir: str = "OUTPUT_DIR", license: str | None = None) -> str:
    """README.md for the exported head described by `record` (a TRAINING.json); `license` the base card's."""
    settings, derived, metrics = record["settings"], record["derived"], record["metrics"]
    base_model_id = settings.get("output", {}).get("base_model_id") or hub_id(record["base"]["path"])
    data, train = settings["data"], settings["train"]
    base, donor = _model_name(record["base"]), _model_name(record["donor"])
    selection = record["training"]["selection"]
    # how the base wrote the train text, in the words the reports give a serving configuration
    text = serving_words({**data["train_text"], "thinking": False})  # its thinking mode is data.thinking's, below
    text = text if text == "greedy" else f"sampled ({text})"
    text += {"on": ", thinking-mode", "auto": ""}.get(data.get("thinking", "auto"), ", non-thinking")
    answers = {"self_generated": f"the base's own {text} continuations of",
               "data": "the recorded answers of", "mixed": f"the recorded answers and the base's own {text} continuations of"}
    trained_tensors = ", ".join(f"`{name}`" for name in derived["trainable_tensors"])
    fitted = "distilling the base's top-1 choices" if train["loss"] == "top1" else \
        f"fitting the base's distribution ({train['loss']})"
    written = selection.get("written_step")
    head_sha = record["outputs"][ckpt_io.HEAD_FILE]
    arithmetic = (record.get("reproducibility") or {}).get("trained_with") or {}
    where = arithmetic.get("device", "unknown")
    if where == "cpu":
        threads = arithmetic.get("threads") or 0
        where = f"CPU ({arithmetic.get('cpu')}, {threads} {plural(threads, 'thread')})"
    steps = metrics["served_steps"]
    largest = max(steps)
    front = [
        "---",
        *([f"base_model: {base_model_id}"] if base_model_id else []),
        *([f"license: {license}"] if license else []),
        f"library_name: {LIBRARY_NAME}",
        "tags:",
        *[f"- {tag}" for tag in TAGS],
        "---",
        "",
        f"# MTP draft head for {base}",
        "",
        (f"This is the Multi-Token-Prediction (MTP) draft head of {donor}, adapted to {base} by "
         f"occamy-mtp so that speculative decoding of {base} accepts more of its drafts. "
         f"Only {trained_tensors} were trained ({derived['trainable_parameters']:,} of the head's "
         f"{derived['head_parameters']:,} parameters); the rest of the head, the base and its shared embedding and "
         f"lm_head stayed frozen. It learned from {answers[data['answers']]} {derived['train_windows']:,} train windows "
         f"({data['context_tokens']} context + up to {data['answer_tokens']} answer tokens each, from "
         f"{record['dataset']['conversations_kept']:,} conversations), {fitted}."),
        "",
        (f"This card describes the head file alone (`{ckpt_io.HEAD_FILE}`, every `mtp.*` tensor), not a whole model: "
         f"it is served with the base's own weights, assembled into a servable directory as under Use."
         + ("" if base_model_id else " The base's Hub id is not known to the run (set `output.base_model_id` at export "
            "to name it in the metadata).")),
        "",
        "## Training",
        "",
        f"- Steps: {derived['total_steps']} ({train['epochs']} {plural(train['epochs'], 'epoch')} of "
        f"{derived['steps_per_epoch']}), {train['windows_per_step']} {plural(train['windows_per_step'], 'window')} a step, "
        f"lr {train['lr']:g} (warmup {train['lr_warmup_steps']}, cosine to {train['lr_min_ratio']:g}x), loss "
        f"`{train['loss']}` over {train['draft_steps']} draft {plural(train['draft_steps'], 'step')}.",
        (f"- Kept: step {written}, the best of every {selection['every_steps']} steps by served acceptance on "
         f"{selection['validation_windows']} validation windows ({selection['serving']})." if selection.get("enabled")
         else f"- Kept: the last step ({written})."),
        f"- Trained on: {where}; {record['timings']['train_seconds']:.0f} s of training.",
        f"- Model dtype: {settings['model']['dtype']}; the head is stored in bf16, its trained tensors rounded once.",
        "",
        "## Validation",
        "",
        (f"Served acceptance on {prompts_of(metrics['heldout']['trained']['serving'][metrics['serving'][0]['label']]['served'][str(steps[0])])}"
         ": the library's reference speculative decoder (draft K tokens with the head's argmax, "
         "verify with the base, keep the accepted prefix and the base's token) on the base's own continuation of "
         "each prompt, per serving configuration. Greedy counts are the decoder's; sampled ones are its expected "
         "counts given the text the base sampled there (a draft is accepted with the base's processed probability "
         "of it, as SGLang and vLLM accept their default argmax drafts). Accept length counts the base's own token "
         "too, as SGLang reports it. A thinking configuration renders the prompts with thinking on, so the base "
         "writes its reasoning first. Sampled figures average several continuations of each prompt; ± is one "
         "standard error over prompts. The ceiling is what a perfect drafter would reach on the same text, one that "
         "drafts the base's own choice at every step (under greedy serving every draft is then accepted; under "
         "sampling each with the base's probability of its top token), and the share is how much of the way from "
         "the donor to it the trained head went."),
        "",
        f"Base: {base}. Selected configuration: {metrics['selected_serving']}.",
        "",
        *acceptance_table(metrics),
        "",
        *where_lost(metrics),
        "![served acceptance](acceptance.png)",
        "",
        "## Not validated",
        "",
        "- Sampled serving in a real engine: the sampled figures above are the reference decoder's expectation, "
        "not an engine's counts. Penalties are applied as vLLM applies them in verification; SGLang applies a "
        "round's starting penalties to the whole round (occamy-mtp's docs/reference/CONTRACT.md section 4c).",
        "- Concurrency and batching in an engine, and engines or versions other than those in the library's docs "
        "(docs/reference/ENGINES.md).",
        f"- Contexts longer than {data['context_tokens']} tokens: every window keeps at most that many tokens "
        "of its conversation.",
        "- Quantized bases (FP8, NVFP4): the head was trained and measured on the unquantized base.",
        "",
        "## Use",
        "",
        "Assemble a servable directory first: the base's files linked, the head's tensors mapped into its index "
        "(the base directory is never modified):",
        "",
        "```bash",
        f"python assemble_head.py --base {shlex.quote(f'/path/to/{base}')} --head {shlex.quote(f'{head_dir}/{ckpt_io.HEAD_FILE}')} "
        f"--out {shlex.quote(f'/path/to/{base}-mtp')}",
        "```",
        "",
        *_serve_commands(shlex.quote(f"/path/to/{base}-mtp"), sorted(set(steps))),

        "## Files",
        "",
        "| file | what |",
        "|---|---|",
        f"| `{ckpt_io.HEAD_FILE}` | every `mtp.*` tensor (bf16, {derived['export_layout']} expert layout); sha256 `{head_sha}` |",
        f"| `{ckpt_io.HEAD_CONFIG_FILE}` | what the head needs to be rebuilt |",
        "| `metrics.json` | every figure above, and the teacher-forced ones |",
        "| `TRAINING.json` | provenance: library commit, base, donor and data hashes, every setting, versions, hardware |",
        "| `acceptance.png` | the table above as a picture |",
        "",
        "## Provenance",
        "",
        f"- occamy-mtp {record['library']['version']}, commit {record['library'].get('commit') or 'unknown'}"
        + (" (with uncommitted changes)" if record["library"].get("dirty") else "") + ".",
        f"- Base config sha256 `{record['base'].get('config_sha256')}`; donor config sha256 "
        f"`{record['donor'].get('config_sha256')}`; data "
        + ", ".join(f"`{Path(f['path']).name}` sha256 `{f['sha256'][:16]}...`" for f in record["dataset"]["files"]) + ".",
        f"- torch {record['packages']['torch']}, transformers {record['packages']['transformers']}.",
        "- The head's bytes depend on the machine that trained it: " + (record.get("reproducibility") or {}).get(
            "depends_on", "see TRAINING.json."),
        "",
        f"To publish: `hf upload ORG/NAME {shlex.quote(head_dir + '/upload')}`: export's `upload/` folder holds this card "
        "and links to the files above, and nothing else of the run (not the base's text of the training prompts, "
        "not the checkpoints).",
        "",
    ]
    return "\n".join(front)


def _serve_commands(model: str, steps: list[int]) -> list[str]:
    """The SGLang and vLLM commands that serve the assembled `model` (a quoted path) with each draft step count."""
    lines = ["SGLang (0.5.12 or later for drafts of more than one step: earlier versions ran steps 2 and up one "
             "position late; occamy-mtp's docs/reference/ENGINES.md):", "", "```bash"]
    for k in steps:
        lines += [f"python -m sglang.launch_server --model-path {model} --speculative-algorithm NEXTN \\",
                  f"    --speculative-num-steps {k} --speculative-eagle-topk 1 --speculative-num-draft-tokens {k + 1}"]
    lines += ["```", "", "vLLM:", "", "```bash"]
    lines += [f"vllm serve {model} --speculative-config '{{\"method\": \"mtp\", \"num_speculative_tokens\": {k}}}'"
              for k in steps]
    return lines + ["```", ""]
