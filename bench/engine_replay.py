"""What the library predicts for the engine's own text, request by request.

`bench/engine_check.sh` leaves, for every MTP-on server, the engine's answers to the heldout
window prompts with its per-request acceptance counts (vLLM's `metrics.speculative_decoding`).
The engine and the library's reference decoder write different texts once a bf16 near tie
goes the other way, so their acceptances are measured on different text. This script takes
the engine's text itself: the library's base scores it (its greedy choice at every position),
the library's head drafts on it (`evaluate.chain_outcomes`), and the decoder's walk is
replayed on it (`metrics.decoder_rounds`) under the engine's budget. Where the library's base
picks the engine's token at every position, the replay is what the engine should have
counted, but for the budget's last step (vLLM drafts and verifies there, the library's
decoder takes a plain base step); the table shows how close it is, per head and draft
step count, and how many positions the two bases disagree on.

    .venv/bin/python bench/engine_replay.py runs/engine-default --dtype float32 bfloat16

Writes WORK/engine-replay.json and prints a markdown table.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from occamy_mtp.model import checkpoint as ckpt_io
from occamy_mtp.data.windows import Window
from occamy_mtp.evaluation.offline import chain_outcomes
from occamy_mtp.model.head import SharedWeights
from occamy_mtp.evaluation.metrics import decoder_rounds
from occamy_mtp.targets.base import base_outputs


def engine_answers(path: Path) -> list[dict]:
    """The window requests of one validate run: prompt ids, output ids, the engine's counts."""
    run = json.loads(path.read_text())
    prompts = {p["name"]: p for p in run["prompts"]}
    answers = []
    for request in run["requests"]:
        if request.get("attempt", "cold") != "cold" or "response" not in request:
            continue
        prompt = prompts[request["prompt"]]
        response = request["response"]
        counts = response.get("speculative") or {}
        if counts.get("accepted_tokens") is None or counts.get("verify_passes") is None:
            raise SystemExit(f"error: {path}: request {request['prompt']!r} carries no per-request acceptance counts "
                             "(serve with --per-request-spec-decode-metrics summary)")
        answers.append({"name": request["prompt"], "prompt_ids": list(prompt["prompt_ids"]),
                        "output_ids": list(response["token_ids"]), "engine": counts})
    if not answers:
        raise SystemExit(f"error: {path}: no window answers with token ids")
    return answers


@torch.no_grad()
def base_disagreements(base, windows: list[Window]) -> list[int]:
    """Generated positions whose token is not the library base's greedy choice there."""
    counts = []
    for window in windows:
        ids = torch.tensor([window.input_ids])
        greedy = base_outputs(base, ids, torch.ones_like(ids)).greedy[0]
        text = ids[0]
        counts.append(int((greedy[window.answer_start - 1 : -1] != text[window.answer_start :]).sum()))
    return counts


def replay(base, head, answers: list[dict], draft_steps: int, max_new_tokens: int) -> dict:
    windows = [Window(a["name"], 0, tuple(a["prompt_ids"] + a["output_ids"]), len(a["prompt_ids"])) for a in answers]
    outcomes = chain_outcomes(base, head, windows, draft_steps, windows_per_batch=4)
    disagreements = base_disagreements(base, windows)
    rows, library, engine = [], {"accepted": 0, "rounds": 0}, {"accepted": 0, "rounds": 0}
    equal_requests = equal_with_agreeing_base = agreeing = 0
    for answer, window, outcome, disagree in zip(answers, windows, outcomes, disagreements):
        rounds, _ = decoder_rounds(outcome.accepted, window.answer_start, max_new_tokens, draft_steps)
        mine = {"accepted": sum(r.accepted for r in rounds), "rounds": len(rounds)}
        theirs = {"accepted": answer["engine"]["accepted_tokens"], "rounds": answer["engine"]["verify_passes"]}
        for key in library:
            library[key] += mine[key]
            engine[key] += theirs[key]
        same = mine["accepted"] == theirs["accepted"] and mine["rounds"] == theirs["rounds"]
        equal_requests += same
        agreeing += disagree == 0
        equal_with_agreeing_base += same and disagree == 0
        rows.append({"name": answer["name"], "library": mine, "engine": theirs, "base_disagreements": disagree})
    return {
        "draft_steps": draft_steps,
        "requests": len(rows),
        "requests_with_equal_counts": equal_requests,
        "requests_where_the_bases_agree": agreeing,
        "equal_counts_where_the_bases_agree": equal_with_agreeing_base,
        "library": library,
        "engine": engine,
        "library_accept_length": 1 + library["accepted"] / library["rounds"],
        "engine_accept_length": 1 + engine["accepted"] / engine["rounds"],
        "rows": rows,
    }


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("work", type=Path, help="bench/engine_check.sh's ENGINE_WORK")
    parser.add_argument("--dtype", nargs="+", default=["float32"], choices=sorted(ckpt_io.DTYPES))
    parser.add_argument("--max-new-tokens", type=int, default=128, help="the engine run's budget (ENGINE_MAX_TOKENS)")
    args = parser.parse_args(argv)
    work = args.work
    heads = {"donor": work / "donor-head.safetensors", "trained": work / "run" / "mtp-trained.safetensors"}
    base_dir = work / "models" / "base"
    results = []
    for dtype_name in args.dtype:
        dtype = ckpt_io.DTYPES[dtype_name]
        base = ckpt_io.load_base(base_dir, dtype=dtype, device=torch.device("cpu"))
        text_config = ckpt_io.read_config(base_dir).text_config
        shared = SharedWeights(base.model.embed_tokens, base.lm_head)
        for name, path in heads.items():
            head = ckpt_io.load_head(path, text_config, shared, dtype=dtype, device=torch.device("cpu"))[0]
            for k in (1, 3):
                answers = engine_answers(work / "validate" / f"{name}-k{k}-windows" / "responses-candidate.json")
                result = replay(base, head, answers, k, args.max_new_tokens)
                results.append({"dtype": dtype_name, "head": name, **result})
                print(f"{dtype_name} {name} K={k}: library {result['library_accept_length']:.3f}, "
                      f"engine {result['engine_accept_length']:.3f}", file=sys.stderr)
    (work / "engine-replay.json").write_text(json.dumps(results, indent=1) + "\n")
    print("| library dtype | head | K | requests | bases agree on every token | equal counts (all / where the bases agree) "
          "| library: accepted / rounds, accept length | engine: accepted / rounds, accept length |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for r in results:
        lib, eng = r["library"], r["engine"]
        print(f"| {r['dtype']} | {r['head']} | {r['draft_steps']} | {r['requests']} | {r['requests_where_the_bases_agree']} "
              f"| {r['requests_with_equal_counts']} / {r['equal_counts_where_the_bases_agree']} "
              f"| {lib['accepted']} / {lib['rounds']}, {r['library_accept_length']:.3f} "
              f"| {eng['accepted']} / {eng['rounds']}, {r['engine_accept_length']:.3f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
