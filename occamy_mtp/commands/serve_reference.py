"""python -m occamy_mtp serve-reference --base DIR [--head FILE] [--mode speculative] [--draft-steps K]

A small OpenAI-compatible server over the reference decoder (`occamy_mtp.serve.reference_server`).
"""

from __future__ import annotations

import argparse
from pathlib import Path

from occamy_mtp.cli import command
from occamy_mtp.config import (ATTN_IMPLEMENTATIONS, DRAFT_RULES, FP8_ACTIVATIONS_CHOICES, FP8_WEIGHTS_CHOICES,
                                ModelSettings)
from occamy_mtp.serve.reference_server import (ReferenceHTTPServer, Faults, GREEDY, load_model, make_handler, PER_REQUEST_FIELDS,
                                               SPECULATIVE)


def _parse_faults(args) -> Faults:
    def ints(text: str, count: int, flag: str) -> list[str]:
        parts = text.split(":")
        if len(parts) != count:
            raise SystemExit(f"error: {flag} {text!r}: expected {count} ':'-separated values")
        return parts

    flips = {}
    for text in args.flip_token:
        request, position = ints(text, 2, "--flip-token")
        flips[int(request)] = int(position)
    shifts = {}
    for text in args.shift_logprob:
        request, position, delta = ints(text, 3, "--shift-logprob")
        shifts[int(request)] = (int(position), float(delta))
    return Faults(flips, shifts, frozenset(args.malformed), args.crash_after)


@command
def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m occamy_mtp serve-reference", description=__doc__.split("\n\n")[0])
    parser.add_argument("--base", required=True, type=Path, help="base checkpoint directory")
    parser.add_argument("--head", type=Path, help="MTP head (file or directory; default: the base's own mtp.* tensors)")
    parser.add_argument("--tokenizer", type=Path, help="tokenizer directory (default: --base)")
    parser.add_argument("--mode", choices=(GREEDY, SPECULATIVE), default=GREEDY, help="MTP off (greedy) or on (speculative)")
    parser.add_argument("--draft-steps", type=int, default=1, help="head steps drafted per verify pass (speculative mode)")
    parser.add_argument("--draft", choices=DRAFT_RULES, default="greedy",
                        help="how a sampled request's drafts are drawn: the head's argmax, or from its softmax (speculative mode)")
    parser.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default="float32", help="model.dtype (default: float32)")
    parser.add_argument("--attn-implementation", choices=ATTN_IMPLEMENTATIONS, default=ModelSettings.attn_implementation,
                        help="model.attn_implementation")
    parser.add_argument("--fp8-weights", choices=FP8_WEIGHTS_CHOICES, default=ModelSettings.fp8_weights,
                        help="model.fp8_weights: how an FP8 base holds its weights")
    parser.add_argument("--fp8-activations", choices=FP8_ACTIVATIONS_CHOICES, default=ModelSettings.fp8_activations,
                        help="model.fp8_activations: fp8 rounds an FP8 base's linear inputs as an engine's W8A8 path does")
    parser.add_argument("--per-request", choices=PER_REQUEST_FIELDS, default="sglang",
                        help="whose per-request speculative counts a response carries: SGLang's (sglext.spec_tokens_details, "
                             "asked with return_spec_tokens_details), vLLM's (metrics.speculative_decoding), or none "
                             "(the /metrics counters alone); default sglang")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=0, help="0 picks a free port (printed on startup)")
    parser.add_argument("--verbose", action="store_true", help="log every request to stderr")
    parser.add_argument("--flip-token", action="append", default=[], metavar="R:P")
    parser.add_argument("--shift-logprob", action="append", default=[], metavar="R:P:D")
    parser.add_argument("--malformed", action="append", type=int, default=[], metavar="R")
    parser.add_argument("--crash-after", type=int, metavar="N")
    args = parser.parse_args(argv)
    faults = _parse_faults(args)
    if args.draft_steps < 1:
        parser.error("--draft-steps must be >= 1")

    import torch

    torch.set_num_threads(args.threads)
    settings = ModelSettings(base=str(args.base), tokenizer=str(args.tokenizer or ""), dtype=args.dtype,
                             attn_implementation=args.attn_implementation, fp8_weights=args.fp8_weights,
                             fp8_activations=args.fp8_activations)
    model = load_model(settings, args.head, args.mode, args.draft_steps, args.device, args.draft)
    handler = make_handler(model, faults, quiet=not args.verbose, per_request=args.per_request)
    server = ReferenceHTTPServer((args.host, args.port), handler)
    host, port = server.server_address[:2]
    print(f"serving http://{host}:{port} ({args.mode}{', %d draft steps' % args.draft_steps if args.mode == SPECULATIVE else ''})", flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()
    return 0
