"""The evaluation's printed tables: served figures beside the ceiling, chained acceptance, decoder checks."""

from __future__ import annotations

from occamy_mtp.console import plural
from occamy_mtp.evaluation.breakdown import one_line


def share_of_ceiling(donor: float, trained: float, ceiling: float) -> float | None:
    """How much of the way from the donor's accept length to the ceiling's the trained head went
    (1: all of it, 0: none, below 0: it lost ground); None where the donor is at the ceiling."""
    room = ceiling - donor
    return (trained - donor) / room if room > 1e-12 else None


def format_table(results: dict[str, dict]) -> str:
    """A side-by-side table of metrics dicts (`Metrics.to_dict()`), one column per head."""
    names = list(results)
    first = results[names[0]]
    rows = [
        ("target top-1 agreement", [f"{m['agreement']:.2%}" for m in results.values()]),
        ("data-answer NLL", [f"{m['data_nll']:.4f}" for m in results.values()]),
    ]
    for k in range(first["draft_steps"]):
        rows.append((
            f"acceptance step {k + 1}",
            [f"{m['acceptance'][k]:.2%} ({m['accepted'][k]}/{m['proposed'][k]})" for m in results.values()],
        ))
    rows.append(("mean accept length", [f"{m['mean_accept_length']:.3f}" for m in results.values()]))
    rows.append(("accept rate", [f"{m['accept_rate']:.2%}" for m in results.values()]))
    if first["exact"]:
        kind = "exact (the base's own greedy text)"
    else:
        kind = f"approximate (teacher-forced data; data token = greedy target at {first['data_matches_target']:.1%} of positions)"
    width = max(22, *(len(v) for _, values in rows for v in values)) + 2
    lines = [
        f"{first['windows']} windows, {first['scored_positions']} scored positions, {first['draft_steps']} chained steps",
        f"acceptance is {kind}",
        f"{'metric':<24}" + "".join(f"{name:>{width}}" for name in names),
    ]
    lines += [f"{label:<24}" + "".join(f"{v:>{width}}" for v in values) for label, values in rows]
    return "\n".join(lines)


def with_error(figures: dict) -> str:
    """A mean accept length with its standard error, when it has one."""
    se = figures.get("mean_accept_length_se", 0.0)
    return f"{figures['mean_accept_length']:.3f}" + (f" ± {se:.3f}" if se else "")


def _short_group(name: str, limit: int = 18) -> str:
    """A group's name in a table row: a file by its last part, anything longer than `limit` cut."""
    name = name.rsplit("/", 1)[-1]
    return name if len(name) <= limit else name[: limit - 3] + "..."


def format_served(reports: dict[str, dict], servings, served_steps, max_new_tokens: int, selected: str | None = None,
                  ceiling: dict | None = None) -> str:
    """The headline of `heldout_report`s side by side, one column per head: per serving
    configuration and served step count, each step's acceptance, the mean accept length and
    the tokens per verify pass; `selected` (a configuration's label) is marked. With `ceiling`
    (`ceiling_report`) a last column gives a perfect drafter's figures, and a row each head's
    share of the way from the donor to them."""
    names = list(reports)
    columns = names + (["ceiling"] if ceiling else [])
    first = reports[names[0]]["serving"][servings[0].label()]["served"][str(served_steps[0])]
    width = 18
    lines = [
        "served acceptance (exact): the reference speculative decoder on the base's own continuation of "
        f"{prompts_of(first)} (<= {max_new_tokens} new tokens each), per serving configuration: greedy "
        "(decoder replay), sampled (the decoder's expected counts given each of the base's sampled continuations); "
        "± one standard error over contexts",
        f"  {'':<48}" + "".join(f"{name:>{width}}" for name in columns),
    ]
    for serving in servings:
        label = serving.label()
        mark = " (selected)" if label == selected and len(servings) > 1 else ""
        penalties = "".join(f", {name.replace('_', ' ')} {getattr(serving, name):g}" for name, none in (
            ("presence_penalty", 0.0), ("frequency_penalty", 0.0), ("repetition_penalty", 1.0)) if getattr(serving, name) != none)
        shown = reports[names[0]]["serving"][label]["served"][str(served_steps[0])]
        continuations = (f", {shown['texts'] // max(1, shown['contexts'])} continuations a context"
                         if shown.get("contexts") and shown["texts"] > shown["contexts"] else "")
        lines.append(f"  {label}{mark}: temperature {serving.temperature:g}, top_p {serving.top_p:g}, top_k {serving.top_k}"
                     f"{penalties}, thinking {'on' if serving.thinking else 'off'}, {serving.draft} drafts{continuations}"
                     + (f", SGLang's penalties" if serving.round_start_penalties else "")
                     + (f"; LOSSY: reasoning drafts accepted among the top {serving.relaxed_top_k} at {serving.relaxed_ratio:g} "
                        "of the top probability (relaxed acceptance; the text is no longer the base's)" if serving.relaxed else ""))
        for k in served_steps:
            figures = [reports[name]["serving"][label]["served"][str(k)] for name in names]
            figures += [ceiling[label][str(k)]] if ceiling else []
            for j in range(k):
                lines.append(f"    {f'{k}-step drafts: step {j + 1} acceptance':<46}"
                             + "".join(f"{f['acceptance'][j]:>{width}.2%}" for f in figures))
            lines.append(f"    {f'{k}-step drafts: mean accept length':<46}" + "".join(f"{with_error(f):>{width}}" for f in figures))
            lines.append(f"    {f'{k}-step drafts: tokens per verify pass':<46}"
                         + "".join(f"{f['tokens_per_verify_pass']:>{width}.3f}" for f in figures))
            if ceiling and "donor" in reports:
                top, base = ceiling[label][str(k)]["mean_accept_length"], figures[names.index("donor")]["mean_accept_length"]
                shares = [share_of_ceiling(base, f["mean_accept_length"], top) for f in figures[: len(names)]]
                lines.append(f"    {f'{k}-step drafts: share of donor -> ceiling':<46}"
                             + "".join(f"{'-' if v is None or name == 'donor' else format(v, '.1%'):>{width}}"
                                       for name, v in zip(names, shares)))
        k = max(served_steps)
        lines += _breakdown_rows(reports, names, label, width, ceiling is not None)
        for key, what in (("by_context", "context"), ("by_file", "file"), ("by_category", "category")):
            groups = reports[names[0]]["serving"][label].get(key) or {}
            if len(groups) < 2 and key != "by_category" or not groups:
                continue  # one group is the whole
            for group in groups:
                cells = [reports[name]["serving"][label][key].get(group, {}).get(str(k)) for name in names]
                count = next((c["contexts"] for c in cells if c), 0)
                title = f"{k}-step accept length, {what} {_short_group(group)} ({count})"
                lines.append(f"    {title:<46}" + "".join(f"{with_error(c) if c else '-':>{width}}" for c in cells))
    def recorded(field: str, form: str):
        return lambda r: "absent" if r["teacher_forced"] is None else format(r["teacher_forced"][field], form)

    rows = [
        ("target top-1 agreement (recorded answers)", recorded("agreement", ".2%")),
        ("data-answer NLL (recorded answers)", recorded("data_nll", ".4f")),
        ("accept length, teacher-forced (approx.)", recorded("mean_accept_length", ".3f")),
    ]
    rows += [(f"accept length, every anchor ({serving.label()})",
              lambda r, label=serving.label(): f"{r['serving'][label]['every_anchor']['mean_accept_length']:.3f}")
             for serving in servings]
    lines.append("secondary: the recorded answers, teacher forced (acceptance approximate), and every anchor of the self-generated text")
    lines += [f"  {label:<46}" + "".join(f"{cell(reports[name]):>{width}}" for name in names) for label, cell in rows]
    return "\n".join(lines)


BREAKDOWN_ROWS = ("certainty", "span")
"""The breakdown's axes the console shows (`metrics.json` holds them all: `breakdown.AXES`)."""


def _breakdown_rows(reports: dict[str, dict], names: list[str], label: str, width: int, ceiling: bool) -> list[str]:
    """Where each head's drafts are lost under one configuration (`heldout_report`'s `breakdown`): per bucket of
    BREAKDOWN_ROWS, each head's acceptance there and, in the ceiling's column, a perfect drafter's at the last
    head's drafts; then each head's largest remaining bucket in one line."""
    figures = {name: reports[name]["serving"][label].get("breakdown") for name in names}
    if not all(figures.values()):
        return []
    last = figures[names[-1]]
    k = last["draft_steps"]
    lines = [f"    {k}-step acceptance by where the draft falls (its share of the {names[-1]} head's drafts, and of those lost):"]
    for axis in BREAKDOWN_ROWS:
        if len(last[axis]) < 2:
            continue  # one bucket is the whole
        for bucket, tally in last[axis].items():
            drafts = tally["proposed"] / last["total"]["proposed"] if last["total"]["proposed"] else 0.0
            title = f"  {axis} {bucket} ({drafts:.0%} drafts, {tally['share_of_lost']:.0%} lost)"
            cells = [figures[name][axis].get(bucket, {}).get("acceptance") for name in names]
            cells += [tally["ceiling_acceptance"]] if ceiling else []
            lines.append(f"    {title:<46}" + "".join(f"{'-' if c is None else format(c, '.2%'):>{width}}" for c in cells))
    for name in names:
        lines.append(f"    {f'{k}-step drafts lost most ({name})':<46}  {one_line(figures[name])}")
    errors = {name: figures[name]["calibration"]["expected_calibration_error"] for name in names
              if "calibration" in figures[name]}
    if errors:
        lines.append(f"    {f'{k}-step calibration error (ECE)':<46}" + "".join(
            f"{'-' if errors.get(name) is None else format(errors[name], '.3f'):>{width}}" for name in names))
        if "donor" in errors and len(errors) > 1 and errors[names[-1]] > errors["donor"]:
            lines.append(f"    the {names[-1]} head's confidence tracks its acceptance worse than the donor's "
                         f"({errors[names[-1]]:.3f} against {errors['donor']:.3f}): an adaptive verifier reads it less well")
    return lines


def format_decoder_checks(checks_by_head: dict) -> str:
    lines = []
    for name, by_serving in checks_by_head.items():
        for label, checks in by_serving.items():
            for k, check in checks.items():
                measured = check["measured"]
                head = (f"\nreference decoder ({name}, {label}, {k}-step): accept length {measured['mean_accept_length']:.3f}, "
                        f"{measured['tokens_per_verify_pass']:.3f} tokens per verify pass; ")
                if "replayed" in check:
                    equal = all(measured[f] == check["replayed"][f] for f in ("proposed", "accepted", "drafted", "verify_passes"))
                    lines.append(head + f"replayed counts {'equal' if equal else 'DIFFER'}; {check['decisions_equal']}/"
                                 f"{check['decisions']} decisions equal; {check['texts_equal']}/{check['windows']} texts equal")
                else:
                    lines.append(head + f"expected {check['expected']['mean_accept_length']:.3f} over its {check['decodes']} "
                                 f"decodes; z of accepted drafts {check['z']['accepted']:+.2f}, of verify passes "
                                 f"{check['z']['verify_passes']:+.2f}")
    return "".join(lines)


def prompts_of(figure: dict) -> str:
    """How many heldout prompts a served figure covers, and how many texts of each: "32 heldout prompts",
    or "32 heldout prompts x 4 continuations" where the base sampled several of each."""
    texts, contexts = figure["texts"], figure.get("contexts") or figure["texts"]
    words = f"{contexts} heldout {plural(contexts, 'prompt')}"
    return words + (f" x {texts // contexts} continuations" if texts > contexts else "")
