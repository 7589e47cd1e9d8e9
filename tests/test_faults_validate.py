"""Bad servers against `occamy_mtp.serve.validate` (issue 14, item 8): every malformed or slow
answer is a recorded failure with its reason, never a crash or a hang.

Each case runs a loopback server (a thread on 127.0.0.1, free port) that answers the
generation requests with one crafted fault; the reference side is a well-behaved replay
of SGLang 0.5.23's responses (tests/fixtures). The slow servers send one byte a second
and stop by themselves after `TRICKLE_LIMIT_SECONDS`; `--timeout` must cut each whole
request at its deadline, whatever the per-read progress. Add new cases here as they
are found.
"""

from __future__ import annotations

import copy
import json
import socket
import time
from http.server import BaseHTTPRequestHandler
from pathlib import Path

import pytest

from occamy_mtp.testing.loopback import LoopbackServer
from occamy_mtp.engines import http, openai, sglang
from occamy_mtp.serve import validate as V
from occamy_mtp.commands import validate as validate_command

FIXTURES = Path(__file__).resolve().parent / "fixtures"
GOOD = json.loads((FIXTURES / "sglang-0.5.23-chat-mtp3.json").read_text())
MODELS = json.dumps(GOOD["models"]).encode()
TIMEOUT_SECONDS = 2.5
TRICKLE_LIMIT_SECONDS = 20  # a trickling server gives up by itself after this long
SLACK_SECONDS = 2.0  # scheduling on a busy 2-core machine


def _raw(status: int, body: bytes, kind: str = "application/json", extra: str = "") -> bytes:
    head = f"HTTP/1.1 {status} X\r\nContent-Type: {kind}\r\nContent-Length: {len(body)}\r\nConnection: close\r\n{extra}\r\n"
    return head.encode() + body


class FaultServer(LoopbackServer):
    """GET /v1/models answers normally (unless `models` is given); every POST and GET /metrics
    is answered by `answer(handler)`, which writes raw bytes to the socket."""

    def __init__(self, answer, metrics=None):
        fault = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def do_GET(self):  # noqa: N802
                if self.path == "/metrics" and metrics is not None:
                    self.wfile.write(metrics(self))
                elif self.path == "/v1/models":
                    self.wfile.write(_raw(200, MODELS))
                else:
                    self.wfile.write(_raw(404, b'{"detail": "Not Found"}'))

            def do_POST(self):  # noqa: N802
                self.rfile.read(int(self.headers["Content-Length"]))
                fault.posts += 1
                try:
                    self.wfile.write(answer(self))
                except (BrokenPipeError, ConnectionResetError):
                    pass  # the client gave up, as it should

        self.posts = 0
        super().__init__(Handler)


OVERFLOW = "@1e999"  # written as the bare JSON number 1e999, which parses as infinity


def _response(mutate) -> bytes:
    """The good SGLang response (K = 3) with one field broken by `mutate(response)`."""
    response = copy.deepcopy(GOOD["responses"][0])
    mutate(response)
    text = json.dumps(response, allow_nan=True).replace(json.dumps(OVERFLOW), "1e999")
    return _raw(200, text.encode())


def _meta(response) -> dict:
    return response["choices"][0]["meta_info"]


def _run(tmp_path, candidate: FaultServer, prompts: int = 1, **kwargs) -> dict:
    """Reference: the good replay; candidate: the fault. Returns the report (never raises)."""
    good = FaultServer(lambda handler: _raw(200, json.dumps(GOOD["responses"][0]).encode()))
    settings = openai.RequestSettings(max_tokens=16, timeout_seconds=TIMEOUT_SECONDS)
    with good:
        return V.validate(good.url, candidate.url, V.prompt_set(prompts, []), tmp_path, settings, cold_warm=0,
                          acceptance_pass="never", **kwargs)


def _only_error(report: dict) -> dict:
    assert not report["passed"] and report["failures"]
    assert len(report["errors"]) == 1, report["errors"]
    error = report["errors"][0]
    assert error["server"] == "candidate"
    return error


# Each case: a body whose one broken field must come back as a malformed response naming it.
MALFORMED_BODIES = {
    "completion_tokens null": (lambda r: _meta(r).update(completion_tokens=None), "completion_tokens is None"),
    "1e999 verify count": (lambda r: _meta(r).update(spec_verify_ct=OVERFLOW), "spec_verify_ct is inf"),
    "1e999 logprob": (lambda r: r["choices"][0]["logprobs"]["content"][0].update(logprob=OVERFLOW), "logprob 0 is inf, not a finite"),
    "1e999 completion tokens": (lambda r: _meta(r).update(completion_tokens=OVERFLOW), "completion_tokens is inf"),
    "NaN logprob literal": (lambda r: r["choices"][0]["logprobs"]["content"][1].update(logprob=float("nan")), "not a JSON number"),
    "histogram a string": (lambda r: _meta(r).update(spec_correct_drafts_histogram="2,1,1,1"), "not a list of counts"),
    "histogram of floats": (lambda r: _meta(r).update(spec_correct_drafts_histogram=[2, 1.5, 1, 1]), "histogram[1] is 1.5"),
    "negative drafts": (lambda r: _meta(r).update(spec_num_proposed_drafts=-15), "outside 0..2^53"),
    "accepted above drafted": (lambda r: _meta(r).update(spec_num_correct_drafts=99), "99 accepted drafts of 15"),
    "meta_info a list": (lambda r: r["choices"][0].update(meta_info=[1, 2]), "meta_info is list, not an object"),
    "logprobs content an object": (lambda r: r["choices"][0]["logprobs"].update(content={"token": "a"}), "not a list of objects"),
    "token ids a string": (lambda r: r["choices"][0].update(response_token_ids="785 12884"), "response_token_ids is str"),
    "ids and tokens disagree": (lambda r: r["choices"][0]["response_token_ids"].pop(), "11 token ids for 12 logprob tokens"),
    "sglext details a number": (lambda r: (r["choices"][0].pop("meta_info"), r.update(sglext={"spec_tokens_details": 7})),
                                "spec_tokens_details is int"),
    "vLLM per-request metrics incomplete": (lambda r: (r["choices"][0].pop("meta_info"), r.pop("sglext"),
                                                       r.update(metrics={"speculative_decoding": {"num_spec_steps": 4}})),
                                            "lacks num_accepted_draft_tokens"),
    "vLLM histogram an object": (lambda r: (r["choices"][0].pop("meta_info"), r.pop("sglext"), r.update(metrics={"speculative_decoding": {
        "num_spec_steps": 4, "num_accepted_draft_tokens": 3, "num_draft_tokens": 12, "acceptance_histogram": {"0": 2}}})),
        "acceptance_histogram is dict"),
}


@pytest.mark.parametrize("case", sorted(MALFORMED_BODIES))
def test_a_malformed_field_is_a_recorded_failure(case, tmp_path):
    mutate, reason = MALFORMED_BODIES[case]
    with FaultServer(lambda handler: _response(mutate)) as server:
        report = _run(tmp_path, server)
    error = _only_error(report)
    assert error["kind"] == "malformed" and reason in error["message"], error["message"]
    assert json.loads((tmp_path / "validation.json").read_text())["errors"] == report["errors"]


MALFORMED_BYTES = {
    "nested 100000 deep": (_raw(200, b'{"choices": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"), "nested too deeply"),
    "a JSON array": (_raw(200, b"[1, 2, 3]"), "a JSON list, not an object"),
    "not JSON": (_raw(200, b"<html>busy</html>"), "not JSON"),
    "bad UTF-8": (_raw(200, b'{"choices": "\xff\xfe"}'), "not JSON"),
    "huge integer": (_raw(200, b'{"choices": [{"text": "a", "logprobs": {"tokens": ["a"], "token_logprobs": [' + b"9" * 5000 + b"]}}]}"),
                     "not JSON"),
    "no status line": (b"SPEAK FRIEND\r\n\r\n{}", "not an HTTP status line"),
    "bad chunking": (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\nConnection: close\r\n\r\nzz\r\n{}\r\n0\r\n\r\n", "bad chunked"),
}


@pytest.mark.parametrize("case", sorted(MALFORMED_BYTES))
def test_a_malformed_body_is_a_recorded_failure(case, tmp_path):
    raw, reason = MALFORMED_BYTES[case]
    with FaultServer(lambda handler: raw) as server:
        report = _run(tmp_path, server)
    error = _only_error(report)
    assert error["kind"] == "malformed" and reason in error["message"], error["message"]


def test_transport_faults_are_recorded(tmp_path):
    """HTTP 500, a body cut short of its Content-Length, a chunked body (which is fine), and
    a body over the size limit."""
    cases = [
        (_raw(500, b'{"error": "boom"}'), "http", "HTTP 500"),
        (b"HTTP/1.1 200 OK\r\nContent-Length: 500\r\nConnection: close\r\n\r\n{\"choices\"", "transport", "closed after 10 of 500"),
    ]
    for raw, kind, reason in cases:
        with FaultServer(lambda handler, raw=raw: raw) as server:
            error = _only_error(_run(tmp_path, server))
        assert error["kind"] == kind and reason in error["message"], error["message"]
    body = json.dumps(GOOD["responses"][0]).encode()
    chunked = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\nConnection: close\r\n\r\n" + b"".join(
        b"%x\r\n%s\r\n" % (len(body[i : i + 1000]), body[i : i + 1000]) for i in range(0, len(body), 1000)) + b"0\r\n\r\n"
    with FaultServer(lambda handler: chunked) as server:
        report = _run(tmp_path, server)
    assert report["passed"], V.format_summary(report)


def test_a_body_over_the_limit_is_refused(tmp_path, monkeypatch):
    monkeypatch.setattr(http, "MAX_RESPONSE_BYTES", 64_000)  # the good response is ~21 kB
    with FaultServer(lambda handler: _raw(200, b" " * 100_000)) as server:
        error = _only_error(_run(tmp_path, server))
    assert error["kind"] == "malformed" and "larger than 64000 bytes" in error["message"]


def _trickle(prefix: bytes):
    """Send `prefix`, then one byte a second, until the client hangs up or the limit is reached."""
    def answer(handler) -> bytes:
        handler.wfile.write(prefix)
        handler.wfile.flush()
        started = time.monotonic()
        while time.monotonic() - started < TRICKLE_LIMIT_SECONDS:
            handler.wfile.write(b" ")
            handler.wfile.flush()
            time.sleep(1.0)
        return b""
    return answer


@pytest.mark.parametrize("where", ["body", "headers"])
def test_a_trickling_server_is_cut_at_the_timeout(where, tmp_path):
    """One byte a second: each socket read makes progress, the whole request must not."""
    prefix = b"HTTP/1.1 200 OK\r\nContent-Length: 100000\r\n\r\n{" if where == "body" else b"HTTP/1.1 200 OK\r\n"
    with FaultServer(_trickle(prefix)) as server:
        started = time.monotonic()
        report = _run(tmp_path, server, prompts=3, max_consecutive_errors=1)
        elapsed = time.monotonic() - started
    assert server.posts == 1  # the first timeout takes the server for dead; the rest is skipped
    kinds = [e["kind"] for e in report["errors"]]
    assert kinds == ["transport", "skipped", "skipped"] and not report["passed"]
    assert f"within the {TIMEOUT_SECONDS:g} s timeout (whole request" in report["errors"][0]["message"]
    request = next(r for r in json.loads((tmp_path / "responses-candidate.json").read_text())["requests"] if r["attempt"] == "cold")
    assert TIMEOUT_SECONDS - 0.1 <= request["seconds"] <= TIMEOUT_SECONDS + SLACK_SECONDS
    assert elapsed < 3 * TIMEOUT_SECONDS + 10 * SLACK_SECONDS  # the reference run, this one, no more


def test_the_command_line_timeout_bounds_a_request(tmp_path, capsys):
    with FaultServer(_trickle(b"HTTP/1.1 200 OK\r\nContent-Length: 100000\r\n\r\n")) as slow:
        started = time.monotonic()
        code = validate_command.main(["--reference", slow.url, "--out", str(tmp_path), "--prompts", "1", "--cold-warm", "0",
                       "--timeout", "1.5", "--quiet"])
        elapsed = time.monotonic() - started
    assert code == 0 and elapsed < 1.5 + 3 * SLACK_SECONDS  # recording a reference exits 0; the error is in the file
    run = json.loads((tmp_path / "responses-reference.json").read_text())
    assert "1.5 s timeout" in run["requests"][0]["error"]["message"]
    assert validate_command.main(["--reference", slow.url, "--out", str(tmp_path), "--timeout", "inf"]) == 2
    assert "--timeout" in capsys.readouterr().err


def test_malformed_metrics_do_not_fail_the_requests(tmp_path):
    """A /metrics page with a negative counter: the reading is reported as unusable, the
    responses are still compared, and acceptance comes from the responses."""
    metrics = lambda handler: _raw(200, b'vllm:spec_decode_num_drafts_total{engine="0"} -1.0\n', "text/plain")  # noqa: E731
    with FaultServer(lambda handler: _raw(200, json.dumps(GOOD["responses"][0]).encode()), metrics) as server:
        report = _run(tmp_path, server)
    acceptance = report["acceptance"]["candidate"]
    assert report["passed"] and acceptance["source"] == sglang.SGLANG_META
    assert "not a count" in acceptance["metrics"]["error"]


def test_a_dead_port_fails_fast(tmp_path):
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    sock.close()  # nobody listens there now
    started = time.monotonic()
    run = V.collect(f"http://127.0.0.1:{port}", V.prompt_set(2, []), 0, openai.RequestSettings(timeout_seconds=TIMEOUT_SECONDS))
    assert time.monotonic() - started < TIMEOUT_SECONDS
    assert run["model_error"]["kind"] == "transport" and [r["error"]["kind"] for r in run["requests"]] == ["skipped", "skipped"]
