"""A tiny OpenAI-compatible HTTP server over the reference decoders (stdlib `http.server`).

docs/reference/REFERENCE_SERVER.md sets out the details.
"""

from __future__ import annotations

import json
import os
import sys
import time
import uuid
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, HTTPServer
from pathlib import Path

from occamy_mtp.config import ModelSettings, Serving

GREEDY = "greedy"
SPECULATIVE = "speculative"
DEFAULT_MAX_TOKENS = 16  # OpenAI's legacy completions default
MAX_TOKENS_LIMIT = 1024  # a request asking for more is refused (this is a CPU reference)
MAX_BODY_BYTES = 1 << 20
CRASH_EXIT_CODE = 3
TOKEN_ID_PREFIX = "token_id:"


@dataclass(frozen=True)
class Faults:
    flip_token: dict[int, int] = field(default_factory=dict)  # request -> output position
    shift_logprob: dict[int, tuple[int, float]] = field(default_factory=dict)  # request -> (position, delta)
    malformed: frozenset[int] = frozenset()
    crash_after: int | None = None


@dataclass
class Generation:
    prompt_ids: list[int]
    output_ids: list[int]
    logprobs: list[float]
    finish_reason: str
    rounds: list[tuple[int, int]] | None
    """Speculative mode: (drafted, accepted) of each verify pass; None in greedy mode."""


@dataclass
class SpecCounters:
    """vLLM's speculative-decoding counters, summed over the requests served (GET /metrics)."""

    draft_steps: int
    drafts: int = 0
    draft_tokens: int = 0
    accepted_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)

    def add(self, rounds: list[tuple[int, int]]) -> None:
        if not self.accepted_per_position:
            self.accepted_per_position = [0] * self.draft_steps
        for drafted, accepted in rounds:
            self.drafts += 1
            self.draft_tokens += drafted
            self.accepted_tokens += accepted
            for position in range(accepted):
                self.accepted_per_position[position] += 1

    def exposition(self, model_name: str) -> str:
        """Prometheus text as vLLM 0.32 writes these counters (prometheus_client's `_total` names)."""
        labels = f'engine="0",model_name="{model_name}"'
        lines = []
        for name, doc, value in (("vllm:spec_decode_num_drafts", "Number of spec decoding drafts.", self.drafts),
                                 ("vllm:spec_decode_num_draft_tokens", "Number of draft tokens.", self.draft_tokens),
                                 ("vllm:spec_decode_num_accepted_tokens", "Number of accepted tokens.", self.accepted_tokens)):
            lines += [f"# HELP {name}_total {doc}", f"# TYPE {name}_total counter", f"{name}_total{{{labels}}} {float(value)}"]
        name = "vllm:spec_decode_num_accepted_tokens_per_pos"
        lines += [f"# HELP {name}_total Accepted tokens per draft position.", f"# TYPE {name}_total counter"]
        per_position = self.accepted_per_position or [0] * self.draft_steps
        lines += [f'{name}_total{{{labels},position="{k}"}} {float(v)}' for k, v in enumerate(per_position)]
        return "\n".join(lines) + "\n"


def accepted_histogram(rounds: list[tuple[int, int]], draft_steps: int) -> list[int]:
    """Index j: the verify passes among `rounds` ((drafted, accepted) each) that accepted exactly j drafts."""
    histogram = [0] * (draft_steps + 1)
    for _, accepted in rounds:
        histogram[accepted] += 1
    return histogram


def sglang_spec_fields(generation: Generation, draft_steps: int) -> dict:
    """SGLang 0.5.23's per-request `spec_*` fields (set only once a verify pass ran, as SGLang does)."""
    rounds = generation.rounds or []
    if not rounds:
        return {}
    drafted = sum(d for d, _ in rounds)
    accepted = sum(a for _, a in rounds)
    histogram = accepted_histogram(rounds, draft_steps)
    return {
        "spec_accept_rate": accepted / drafted if drafted else 0.0,
        "spec_accept_length": len(generation.output_ids) / len(rounds),  # completion tokens / verify passes
        "spec_num_correct_drafts": accepted,
        "spec_num_proposed_drafts": drafted,
        "spec_verify_ct": len(rounds),
        "spec_correct_drafts_histogram": histogram,
    }


def vllm_spec_fields(generation: Generation, draft_steps: int) -> dict:
    """vLLM's per-request `metrics.speculative_decoding` (--per-request-spec-decode-metrics summary, vLLM 0.32)."""
    rounds = generation.rounds or []
    return {"num_spec_steps": len(rounds), "num_draft_tokens": sum(d for d, _ in rounds),
            "num_accepted_draft_tokens": sum(a for _, a in rounds), "num_spec_tokens": draft_steps,
            "acceptance_histogram": accepted_histogram(rounds, draft_steps)}


PER_REQUEST_FIELDS = ("sglang", "vllm", "none")
"""Whose per-request speculative fields the server answers with (`--per-request`); none: only /metrics."""


class ReferenceModel:
    """Base (+ head), tokenizer and decoding mode; `generate` runs one request."""

    def __init__(self, base, head, tokenizer, mode: str, draft_steps: int, stop_token_ids: set[int], name: str,
                 draft: str = "greedy"):
        self.base, self.head, self.tokenizer = base, head, tokenizer
        self.mode, self.draft_steps, self.draft = mode, draft_steps, draft
        self.stop_token_ids = frozenset(stop_token_ids)
        self.name = name
        self.vocab_size = base.lm_head.weight.shape[0]
        self._runners = None

    def _runners_for(self, prompt_length: int, max_tokens: int):
        """The base's and the head's runners, one pair for every request (the server answers one at a
        time; on a GPU their graphs are captured once), made anew for a request that needs more positions."""
        from occamy_mtp.evaluation.decode import decodes_runners

        if self._runners is None or self._runners.positions < prompt_length + max_tokens + self.draft_steps:
            self._runners = decodes_runners(self.base, self.head, [prompt_length], max_tokens, self.draft_steps)
        return self._runners

    def generate(self, prompt_ids: list[int], max_tokens: int, sampling: dict | None = None) -> Generation:
        """One request: greedy, or sampled with `sampling` (temperature, top_p, top_k, seed; `_sampling`)."""
        from occamy_mtp.evaluation.decode import greedy_decode, speculative_decode

        sampling = sampling or {}
        seed = sampling.get("seed", 0)
        serving = Serving(**{k: v for k, v in sampling.items() if k != "seed"}, draft=self.draft) if sampling else None
        if self.mode == SPECULATIVE:
            result = speculative_decode(self.base, self.head, prompt_ids, max_tokens, self.draft_steps, self.stop_token_ids,
                                        serving=serving, seed=seed, runners=self._runners_for(len(prompt_ids), max_tokens))
        else:
            result = greedy_decode(self.base, prompt_ids, max_tokens, self.stop_token_ids, serving=serving, seed=seed)
        rounds = [(len(r.drafted), r.accepted) for r in result.rounds]
        return Generation(list(prompt_ids), list(result.output_ids), list(result.logprobs), result.finish_reason,
                          rounds if self.mode == SPECULATIVE else None)

    def token_text(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id])


class RequestError(ValueError):
    """A request this server refuses (HTTP 400)."""


def _max_tokens(body: dict) -> int:
    value = body.get("max_completion_tokens", body.get("max_tokens", DEFAULT_MAX_TOKENS))
    if not isinstance(value, int) or isinstance(value, bool) or not 1 <= value <= MAX_TOKENS_LIMIT:
        raise RequestError(f"max_tokens must be an integer in 1..{MAX_TOKENS_LIMIT}, got {value!r}")
    return value


def _sampling(body: dict) -> dict:
    """The request's sampling ({} for temperature 0): temperature (1 when absent, as OpenAI's), top_p,
    top_k (0 or -1: every token) and seed (0 when absent), each checked; a penalty is refused."""
    if body.get("n", 1) != 1 or body.get("stream", False):
        raise RequestError("n > 1 and stream are not supported")
    temperature = body.get("temperature", 1.0)
    if not isinstance(temperature, (int, float)) or isinstance(temperature, bool) or not 0 <= temperature < float("inf"):
        raise RequestError(f"temperature must be a finite number >= 0, got {temperature!r}")
    if temperature == 0:
        return {}
    for name, default in (("presence_penalty", 0.0), ("frequency_penalty", 0.0), ("repetition_penalty", 1.0)):
        if body.get(name, default) != default:  # refused, not ignored: the text would not be what was asked
            raise RequestError(f"{name} is not supported by the reference server's sampled decoder (got {body[name]!r})")
    top_p, top_k, seed = body.get("top_p", 1.0), body.get("top_k", 0), body.get("seed", 0)
    if not isinstance(top_p, (int, float)) or isinstance(top_p, bool) or not 0 < top_p <= 1:
        raise RequestError(f"top_p must be in (0, 1], got {top_p!r}")
    if not isinstance(top_k, int) or isinstance(top_k, bool) or top_k < -1:
        raise RequestError(f"top_k must be -1, 0 or more, got {top_k!r}")
    if not isinstance(seed, int) or isinstance(seed, bool):
        raise RequestError(f"seed must be an integer, got {seed!r}")
    return {"temperature": float(temperature), "top_p": float(top_p), "top_k": max(0, top_k), "seed": seed}


def _prompt_ids(model: ReferenceModel, body: dict, chat: bool) -> list[int]:
    tokenizer = model.tokenizer
    if chat:
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise RequestError("messages must be a non-empty list")
        kwargs = body.get("chat_template_kwargs") or {}
        if not isinstance(kwargs, dict):
            raise RequestError("chat_template_kwargs must be an object")
        try:
            text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False, **kwargs)
        except Exception as err:  # jinja raises its own types for a bad conversation
            raise RequestError(f"chat template refused the messages: {err}") from None
        return tokenizer(text, add_special_tokens=False)["input_ids"]
    prompt = body.get("prompt")
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        if max(prompt) >= model.vocab_size or min(prompt) < 0:
            raise RequestError("prompt token id out of range")
        return list(prompt)
    if isinstance(prompt, str) and prompt:
        return tokenizer(prompt, add_special_tokens=False)["input_ids"]
    raise RequestError("prompt must be a non-empty string or a list of token ids")


def _apply_faults(faults: Faults, request_number: int, generation: Generation, vocab_size: int) -> None:
    position = faults.flip_token.get(request_number)
    if position is not None and position < len(generation.output_ids):
        generation.output_ids[position] = (generation.output_ids[position] + 1) % vocab_size
    if request_number in faults.shift_logprob:
        position, delta = faults.shift_logprob[request_number]
        if position < len(generation.logprobs):
            generation.logprobs[position] += delta


def completion_response(model: ReferenceModel, body: dict, generation: Generation, chat: bool, request_id: str,
                        per_request: str = "sglang") -> dict:
    """The OpenAI response object for one generation, with an engine's per-request speculative counts:
    SGLang's where asked for (`per_request` sglang), vLLM's always (vllm, as its server with
    --per-request-spec-decode-metrics), none (none: its /metrics counters alone)."""
    ids = generation.output_ids
    as_ids = bool(body.get("return_tokens_as_token_ids"))
    tokens = [f"{TOKEN_ID_PREFIX}{t}" if as_ids else model.token_text(t) for t in ids]
    text = model.tokenizer.decode([t for t in ids if t not in model.stop_token_ids])
    wants_logprobs = bool(body.get("logprobs")) or body.get("logprobs") == 0
    spec = sglang_spec_fields(generation, model.draft_steps) if per_request == "sglang" else {}
    usage = {"prompt_tokens": len(generation.prompt_ids), "completion_tokens": len(ids),
             "total_tokens": len(generation.prompt_ids) + len(ids)}
    if chat:
        choice = {"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": generation.finish_reason}
        if wants_logprobs:
            choice["logprobs"] = {"content": [
                {"token": token, "logprob": logprob, "bytes": list(token.encode("utf-8")), "top_logprobs": []}
                for token, logprob in zip(tokens, generation.logprobs)
            ]}
        if body.get("return_token_ids"):
            choice["response_token_ids"] = list(ids)
        if body.get("return_meta_info"):  # SGLang: the request's meta_info, chat only
            choice["meta_info"] = {"id": request_id, "finish_reason": {"type": generation.finish_reason},
                                   "prompt_tokens": len(generation.prompt_ids), "completion_tokens": len(ids),
                                   "cached_tokens": 0, **spec}
        kind = "chat.completion"
    else:
        choice = {"index": 0, "text": text, "finish_reason": generation.finish_reason, "logprobs": None}
        if wants_logprobs:
            offsets, offset = [], 0
            for token in tokens:
                offsets.append(offset)
                offset += len(token)
            choice["logprobs"] = {"tokens": tokens, "token_logprobs": generation.logprobs,
                                  "top_logprobs": [{} for _ in tokens], "text_offset": offsets}
        if body.get("return_token_ids"):
            choice["token_ids"] = list(ids)
        kind = "text_completion"
    response = {"id": request_id, "object": kind, "created": int(time.time()), "model": model.name,
                "choices": [choice], "usage": usage}
    if body.get("return_spec_tokens_details") and spec:  # SGLang: sglext.spec_tokens_details (n = 1: an object)
        response["sglext"] = {"spec_tokens_details": {k: v for k, v in spec.items()}}
    if per_request == "vllm" and generation.rounds is not None:
        response["metrics"] = {"speculative_decoding": vllm_spec_fields(generation, model.draft_steps)}
    return response


def make_handler(model: ReferenceModel, faults: Faults, quiet: bool, per_request: str = "sglang"):
    state = {"requests": 0}
    counters = SpecCounters(model.draft_steps) if model.mode == SPECULATIVE else None

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, format, *args):  # noqa: A002 (the stdlib's name)
            if not quiet:
                super().log_message(format, *args)

        def _send(self, status: int, payload: bytes, content_type: str = "application/json") -> None:
            self.send_response(status)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(payload)))
            self.end_headers()
            self.wfile.write(payload)

        def _json(self, status: int, obj: dict) -> None:
            self._send(status, json.dumps(obj).encode("utf-8"))

        def _error(self, status: int, message: str) -> None:
            self._json(status, {"error": {"message": message, "type": "invalid_request_error", "code": status}})

        def do_GET(self):  # noqa: N802 (the stdlib's name)
            if self.path == "/health":
                self._send(200, b"ok", "text/plain")
            elif self.path == "/metrics":
                text = counters.exposition(model.name) if counters is not None else ""
                self._send(200, text.encode("utf-8"), "text/plain; version=0.0.4; charset=utf-8")
            elif self.path == "/v1/models":
                self._json(200, {"object": "list", "data": [{"id": model.name, "object": "model", "owned_by": "occamy-mtp"}]})
            else:
                self._error(404, f"no route {self.path}")

        def do_POST(self):  # noqa: N802
            chat = self.path == "/v1/chat/completions"
            if not chat and self.path != "/v1/completions":
                self._error(404, f"no route {self.path}")
                return
            state["requests"] += 1
            number = state["requests"]
            if faults.crash_after is not None and number > faults.crash_after:
                sys.stderr.write(f"serve_reference: crashing on request {number} as asked (--crash-after)\n")
                sys.stderr.flush()
                os._exit(CRASH_EXIT_CODE)  # no response: the client sees the connection drop
            length = int(self.headers.get("Content-Length") or 0)
            if not 0 < length <= MAX_BODY_BYTES:
                self._error(400, "a JSON body with Content-Length is required")
                return
            try:
                body = json.loads(self.rfile.read(length))
                if not isinstance(body, dict):
                    raise RequestError("the body must be a JSON object")
                sampling = _sampling(body)
                max_tokens = _max_tokens(body)
                prompt_ids = _prompt_ids(model, body, chat)
            except (json.JSONDecodeError, RequestError) as err:
                self._error(400, str(err))
                return
            generation = model.generate(prompt_ids, max_tokens, sampling)
            if counters is not None:
                counters.add(generation.rounds)
            _apply_faults(faults, number, generation, model.vocab_size)
            request_id = uuid.uuid4().hex
            payload = json.dumps(completion_response(model, body, generation, chat, request_id, per_request)).encode("utf-8")
            if number in faults.malformed:
                payload = payload[: len(payload) // 2]  # truncated JSON, still HTTP 200
            self._send(200, payload)

    return Handler


def load_model(model: ModelSettings, head_path: Path | None, mode: str, draft_steps: int, device: str,
               draft: str = "greedy") -> "ReferenceModel":
    """The served model: the base of `model` (the model settings, every one honoured:
    `base.frozen.FrozenBase.open`), its tokenizer (`model.tokenizer`, else the base's) and, in
    speculative mode, the head at `head_path` (None: the base's own `mtp.*` tensors)."""
    import torch
    from transformers import AutoTokenizer

    from occamy_mtp.base.frozen import FrozenBase
    from occamy_mtp.model import checkpoint as ckpt_io
    from occamy_mtp.data.windows import stop_token_ids
    from occamy_mtp.model.head import SharedWeights

    base_dir = Path(model.base)
    text_config = ckpt_io.read_config(base_dir).text_config  # a missing or unreadable base is one error line, before anything loads
    tokenizer_dir = Path(model.tokenizer) if model.tokenizer else None
    for flag, directory in (("--tokenizer", tokenizer_dir), ("--base", base_dir)):
        if directory is not None:
            if not Path(directory).is_dir():
                raise ckpt_io.CheckpointError(f"{flag} {directory}: not a directory (tokenizer files with a chat template expected)")
            break
    tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_dir or base_dir), local_files_only=True)
    base = FrozenBase.open(model, torch.device(device))
    head = None
    if mode == SPECULATIVE:
        shared = SharedWeights(base.model.embed_tokens, base.lm_head)
        head = ckpt_io.load_head(head_path or base_dir, text_config, shared, dtype=ckpt_io.DTYPES[model.dtype], device=device,
                                 attn_implementation=model.attn_implementation)[0].eval()
    stop = stop_token_ids(tokenizer, base_dir)
    return ReferenceModel(base, head, tokenizer, mode, draft_steps, stop, name=base_dir.name, draft=draft)


class ReferenceHTTPServer(HTTPServer):
    """One request at a time; up to this many clients wait in the listen queue (a run keeps
    `data.self_generate_concurrency` requests in flight, 64 by default)."""

    request_queue_size = 256
