"""A serving engine's acceptance under sampling beside the library's exact expectation, on the engine's own text.

`bench/engine_check.sh` (ENGINE_STAGE=sampled) serves a head with MTP at a temperature; this
script sends it every heldout window's context (token ids to /v1/completions, seeded per
context as the library's engine writer seeds it, `TextSampling.request_seed`) and reads each
answer's tokens and its per-request acceptance counts (vLLM's `metrics.speculative_decoding`,
SGLang's `sglext.spec_tokens_details`, or the library's reference server's, which are SGLang's).
Given the text an engine wrote, its counts are random with an expectation the library computes
exactly (`evaluate.sampled_decoder_check`: the decoder's walk over that text with each draft's
acceptance odds given the text). Over the requests the differences engine - expected have mean
0 if the engine does what the library says it does; the report gives their z-scores, the
engine's totals and the library's expected totals on the same texts.

    .venv/bin/python bench/engine_sampled.py --url http://127.0.0.1:8431 --config configs/demo.yaml \
        --head runs/demo/mtp-trained.safetensors --draft-steps 3 --temperature 0.7 --top-p 0.8 --draft greedy \
        --out runs/engine/sampled/trained-k3-greedy.json [section.key=value ...]

`--head donor` measures the donor head (`model.donor_head`); `--draft-steps 0` asks a server
without MTP and checks its text alone. Every report also says whether the engine's text is a
sample of what was asked (`sampling_fidelity`: tokens outside the processed distribution's
support). Writes the JSON report to --out and prints one line.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from occamy_mtp.config import ConfigError, Serving, load_config, serving_preset, window_settings  # noqa: E402
from occamy_mtp.data.windows import load_tokenizer  # noqa: E402
from occamy_mtp.evaluation.decoder_check import sampled_decoder_check# noqa: E402
from occamy_mtp.engines.http import server_identity  # noqa: E402
from occamy_mtp.serve.sampled import (  # noqa: E402
    ask, expectation_models, fidelity, measured_texts, sampled_request, text_statistics,
)
from occamy_mtp.serve.validate import heldout_window_contexts  # noqa: E402

TIMEOUT_SECONDS = 1800.0


def engine_identity(engine_python: str) -> tuple[list[str], str]:
    """([vllm, torch, transformers] versions of the engine's venv, this checkout's short commit): the
    heading of every section bench/engine_check.sh writes."""
    versions = subprocess.run([engine_python, "-c", "import vllm, torch, transformers; "
                               "print(vllm.__version__, torch.__version__, transformers.__version__)"],
                              capture_output=True, text=True).stdout.split() or ["?", "?", "?"]
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    return versions, commit


def write_section(path: Path, text: str, append_to_results: bool) -> None:
    """A section of bench/engine_check.sh: into `path`, printed, and appended to bench/NOTEBOOK.md when asked."""
    path.write_text(text)
    print(text)
    if append_to_results:
        results = ROOT / "bench" / "NOTEBOOK.md"
        results.write_text(results.read_text().rstrip("\n") + "\n\n" + text)
        print(f"appended to {results}", file=sys.stderr)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--url", required=True)
    parser.add_argument("--config", required=True, type=Path, help="the run's config (its split gives the heldout windows)")
    parser.add_argument("--head", required=True, help="the served head's file, or 'donor' (model.donor_head)")
    parser.add_argument("--draft-steps", type=int, required=True, help="the server's K; 0: a server without MTP (the text alone is checked)")
    parser.add_argument("--serving", default="", help="a preset by name (thinking-general, instruct-general, ...): its "
                        "sampling, penalties and thinking mode, in place of --temperature, --top-p, --top-k")
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--top-k", type=int, default=0)
    parser.add_argument("--draft", default="greedy", help="greedy or sampled: the engine's draft rule (vLLM's draft_sample_method)")
    parser.add_argument("--seed", type=int, default=0, help="the requests' seeds derive from it and each context")
    parser.add_argument("--windows", type=int, default=1000, help="the first N heldout windows")
    parser.add_argument("--max-tokens", type=int, default=0, help="new tokens a request (default: data.answer_tokens)")
    parser.add_argument("--dtype", default="float32", help="the library's dtype for the expectation")
    parser.add_argument("--out", required=True, type=Path)
    args, overrides = parser.parse_known_args(argv)
    config = load_config(args.config, overrides)
    if args.serving:
        try:
            serving = dataclasses.replace(serving_preset(args.serving, "--serving"), draft=args.draft)
        except ConfigError as err:
            print(f"error: {err}", file=sys.stderr)
            return 2
    else:
        serving = Serving(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, draft=args.draft)
    if serving.greedy:
        print("error: --temperature must be above 0, or --serving a preset (greedy serving is engine_check.sh's main stage)",
              file=sys.stderr)
        return 2
    tokenizer = load_tokenizer(config.model)
    max_tokens = args.max_tokens or config.data.answer_tokens
    contexts = heldout_window_contexts(list(config.data.files), tokenizer, serving.thinking,
                                       **window_settings(config.data))[: args.windows]
    request = sampled_request(config.model.base, tokenizer, serving, args.seed, max_tokens, TIMEOUT_SECONDS)
    model = server_identity(args.url, 30.0)["model"]
    started = time.perf_counter()
    raw = ask(args.url, model, contexts, request, tokenizer)
    asked_seconds = time.perf_counter() - started
    failed = [answer for answer in raw if "error" in answer]
    if failed:
        print(f"error: {args.url}: {failed[0]['prompt']}: {failed[0]['error']['message']} ({len(failed)} requests failed)", file=sys.stderr)
        return 1
    try:
        measured = measured_texts(raw, args.draft_steps, args.url) if args.draft_steps else []
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        return 1

    head_path = (config.model.donor_head if args.head == "donor" else args.head) if args.draft_steps else None
    base, head = expectation_models(dataclasses.replace(config.model, dtype=args.dtype), head_path, torch.device("cpu"))
    text_fidelity = fidelity(text_statistics(base, raw, serving))
    check = None
    if head is not None:
        check = sampled_decoder_check(base, head, measured, args.draft_steps, max_tokens, serving, config.eval.windows_per_batch,
                                      engine_counts=True, names=[answer["prompt"] for answer in raw])
    report = {"url": args.url, "model": model, "head": str(head_path), "serving": {"label": serving.label(), **vars(args), **dataclasses.asdict(serving),
              "out": str(args.out), "config": str(args.config)}, "requests": len(raw), "max_tokens": max_tokens,
              "finished": sum(r["finished"] for r in raw), "asked_seconds": asked_seconds, "fidelity": text_fidelity,
              "check": check, "answers": raw}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1) + "\n")
    line = (f"{args.head} K={args.draft_steps} {serving.label()}: {text_fidelity['outside_the_processed_support']} of "
            f"{text_fidelity['tokens']} tokens outside the processed support")
    if check is not None:
        engine, expected = check["measured"], check["expected"]
        line += (f"; engine accept length {1 + sum(engine['accepted']) / engine['verify_passes']:.3f} (per step "
                 f"{', '.join(f'{a:.1%}' for a in engine['acceptance'])}), library expected "
                 f"{1 + sum(expected['accepted']) / expected['verify_passes']:.3f} (per step "
                 f"{', '.join(f'{a:.1%}' for a in expected['acceptance'])}); z accepted {check['z']['accepted']:+.2f}, "
                 f"z verify passes {check['z']['verify_passes']:+.2f}")
    print(line + f"; {len(raw)} requests")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
