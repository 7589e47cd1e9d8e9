"""The endpoint validation tool against real HTTP servers on loopback.

Three `occamy_mtp.serve.reference_server` processes serve a tiny fp32 checkpoint on 127.0.0.1
(free ports): MTP off (plain greedy), MTP on (the reference speculative decoder, 3 draft
steps; SGLang's per-request fields and vLLM's /metrics counters), and a faulty one that
changes one output token, shifts one logprob, sends one malformed response and then dies
mid-run. Engine replay servers (threads on 127.0.0.1) answer with the responses and
/metrics texts of `tests/fixtures/` (each names the engine version it reproduces), so
that the engines' own formats are read as they are. Every request has a timeout and
every process is terminated at the end.
"""

from __future__ import annotations

import json
import os
import selectors
import subprocess
import sys
import time
from http.server import BaseHTTPRequestHandler
from pathlib import Path

import pytest

from occamy_mtp.engines import http, openai, sglang, vllm
from occamy_mtp.serve import validate as V
from occamy_mtp.testing.loopback import LoopbackServer
from occamy_mtp.testing.checkpoints import build_tiny_checkpoint
from occamy_mtp.testing.tokenizer import SAMPLE_DATA_PATH
from occamy_mtp.commands import validate as validate_command

REPO = Path(__file__).resolve().parent.parent
FIXTURES = Path(__file__).resolve().parent / "fixtures"
STARTUP_SECONDS = 240  # importing torch + transformers on a busy 2-core machine
REQUEST_TIMEOUT_SECONDS = 60
PROMPTS = 7
COLD_WARM = 2  # requests: p1 cold (1), p1 warm (2), p2 cold (3), p2 warm (4), p3 (5), p4 (6), p5 (7), p6, p7
MAX_TOKENS = 6
SPEC_LOGPROB_TOLERANCE = 1e-4  # a multi-token verify pass vs one-token steps: fp32 rounding only
# The faulty server: token 2 of request 1 changed, request 3's token 1 logprob shifted,
# request 5 malformed, dies on request 7 (p5); p6 then finds nobody listening.
FAULTS = ["--flip-token", "1:2", "--shift-logprob", "3:1:0.25", "--malformed", "5", "--crash-after", "6"]
SERVERS = {
    "greedy": ["--mode", "greedy"],
    "speculative": ["--mode", "speculative", "--draft-steps", "3"],
    "faulty": ["--mode", "greedy", *FAULTS],
}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory, sample_tokenizer_dir):
    root = tmp_path_factory.mktemp("validate")
    tokenizer_dir = sample_tokenizer_dir
    base = build_tiny_checkpoint(root / "base", seed=4, tokenizer_dir=tokenizer_dir)
    data = root / "chats.jsonl"
    data.write_text("".join(SAMPLE_DATA_PATH.read_text().splitlines(keepends=True)[:12]))
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_dir), local_files_only=True)
    return {"root": root, "base": base.path, "data": data, "tokenizer": tokenizer, "tokenizer_dir": tokenizer_dir}


def _wait_for_url(process: subprocess.Popen, deadline: float) -> str:
    selector = selectors.DefaultSelector()
    selector.register(process.stdout, selectors.EVENT_READ)
    try:
        while time.monotonic() < deadline:
            if selector.select(timeout=1.0):
                line = process.stdout.readline()
                if not line:
                    raise RuntimeError(f"server exited before listening (code {process.wait(5)})")
                if line.startswith("serving "):
                    return line.split()[1]
            elif process.poll() is not None:
                raise RuntimeError(f"server exited before listening (code {process.returncode})")
        raise RuntimeError("server did not start in time")
    finally:
        selector.close()


@pytest.fixture(scope="module")
def servers(tiny):
    """Start the three servers at once (startup is mostly imports), yield their URLs."""
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
    processes = {}
    try:
        for name, flags in SERVERS.items():
            log = open(tiny["root"] / f"{name}.stderr", "w")
            processes[name] = subprocess.Popen(
                [sys.executable, "-m", "occamy_mtp", "serve-reference", "--base", str(tiny["base"]), "--port", "0", *flags],
                stdout=subprocess.PIPE, stderr=log, text=True, env=env, cwd=REPO,
            )
            log.close()
        deadline = time.monotonic() + STARTUP_SECONDS
        urls = {name: _wait_for_url(process, deadline) for name, process in processes.items()}
        yield {"urls": urls, "processes": processes}
    finally:
        for process in processes.values():
            if process.poll() is None:
                process.terminate()
        for process in processes.values():
            try:
                process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait(timeout=10)
            process.stdout.close()


def settings() -> openai.RequestSettings:
    return openai.RequestSettings(endpoint=openai.CHAT, max_tokens=MAX_TOKENS, timeout_seconds=REQUEST_TIMEOUT_SECONDS)


@pytest.fixture(scope="module")
def recorded(tiny, servers):
    """The MTP-off server's responses to the fixed set (authored + heldout prefixes), recorded once."""
    heldout = V.heldout_prefixes([tiny["data"]], tiny["tokenizer"], train_conversations=4, heldout_conversations=3)
    prompts = V.prompt_set(PROMPTS, heldout)
    out = tiny["root"] / "record"
    assert V.validate(servers["urls"]["greedy"], None, prompts, out, settings(), cold_warm=COLD_WARM) is None
    return {"prompts": prompts, "path": out / "responses-reference.json"}


def test_prompt_set_mixes_authored_prompts_and_heldout_prefixes(tiny, recorded):
    prompts = recorded["prompts"]
    assert len(prompts) == PROMPTS
    assert {p.source for p in prompts} == {"authored", "heldout"}
    heldout = [p for p in prompts if p.source == "heldout"]
    assert all(p.messages[-1]["role"] == "user" for p in heldout)  # the messages before an assistant turn
    run = json.loads(recorded["path"].read_text())
    assert len(run["requests"]) == PROMPTS + COLD_WARM and all("response" in r for r in run["requests"])
    body = V.request_body(prompts[0], settings(), "m")
    assert body["temperature"] == 0 and body["chat_template_kwargs"] == {"enable_thinking": False} and body["logprobs"] is True


def test_identical_server_passes(recorded, servers, tmp_path):
    """The "one server restarted between" protocol: a recorded reference, the live server,
    through the real entry point (stdlib only: no --data, the recording holds the prompts)."""
    result = subprocess.run(
        [sys.executable, "-m", "occamy_mtp", "validate", "--reference", str(recorded["path"]),
         "--candidate", servers["urls"]["greedy"], "--out", str(tmp_path), "--quiet", "--timeout", str(REQUEST_TIMEOUT_SECONDS),
         "--allow-no-drafts"],
        capture_output=True, text=True, timeout=300, cwd=REPO, env=dict(os.environ, PYTHONPATH=str(REPO)),
    )
    assert result.returncode == 0, result.stdout + result.stderr
    report = json.loads((tmp_path / "validation.json").read_text())
    assert report["passed"] and report["fixed"] == {"exact": PROMPTS, "of": PROMPTS}
    assert report["cold_warm"]["candidate"] == {"exact": COLD_WARM, "of": COLD_WARM, "prompts": report["cold_warm"]["candidate"]["prompts"]}
    assert report["max_logprob_diff"] == 0.0 and not report["errors"] and report["failures"] == []
    assert report["prompts"][0]["comparisons"]["cold"]["compared_by"] == "token_ids"
    assert report["divergence"]["prompts"] == 0 and report["acceptance_pass"] is None  # nothing drafted, but not asked for
    assert f"fixed prompts: {PROMPTS}/{PROMPTS} exact" in result.stdout and "RESULT: PASS" in result.stdout
    assert "acceptance (candidate): not reported" in result.stdout


def test_mtp_on_server_passes_and_reports_acceptance(recorded, servers, tmp_path):
    """The reference decoder's counts, read as SGLang reports them (per request) and as vLLM
    does (/metrics, before and after): the two readings must agree count for count."""
    report = V.validate(str(recorded["path"]), servers["urls"]["speculative"], [], tmp_path, settings(),
                        tolerance=SPEC_LOGPROB_TOLERANCE)
    assert report["passed"], V.format_summary(report)
    assert not report["token_differences"] and report["max_logprob_diff"] <= SPEC_LOGPROB_TOLERANCE
    acceptance = report["acceptance"]["candidate"]
    assert acceptance["engine"] == "occamy-mtp" and acceptance["source"] == sglang.SGLANG_META
    assert acceptance["responses"] == PROMPTS + COLD_WARM and not acceptance["drafted_nothing"]
    assert acceptance["completion_tokens"] == (PROMPTS + COLD_WARM) * MAX_TOKENS  # nobody stops early at 6 tokens
    assert acceptance["tokens_per_verify_pass"] == pytest.approx(acceptance["completion_tokens"] / acceptance["verify_passes"])
    assert acceptance["accept_length"] == pytest.approx(1 + acceptance["accepted_tokens"] / acceptance["verify_passes"])
    assert 0 <= acceptance["accept_rate"] <= 1 and len(acceptance["per_position"]["proposed"]) == 3
    per_position = acceptance["per_position"]
    assert per_position["proposed"][0] == acceptance["verify_passes"]  # every verify pass proposes step 1
    assert sum(per_position["accepted"]) == acceptance["accepted_tokens"]
    metrics = acceptance["metrics"]  # the same decoder's counts through vLLM-style /metrics counters
    assert metrics["source"] == vllm.VLLM_METRICS
    assert (metrics["drafts"], metrics["accepted_tokens"], metrics["draft_tokens"]) == (
        acceptance["verify_passes"], acceptance["accepted_tokens"], acceptance["draft_tokens"])
    assert metrics["per_position"] == per_position
    assert report["acceptance"]["reference"] is None and report["acceptance_pass"] is None
    summary = V.format_summary(report)
    assert "accept length" in summary and "per step (chained): step 1" in summary and "cross-check" in summary
    assert "RESULT: PASS" in summary


def test_mtp_off_candidate_fails_for_drafting_nothing(recorded, servers, tmp_path):
    """An MTP-off server in the candidate's place gives identical tokens but no drafts: FAIL,
    with the reason, after the acceptance pass without logprobs found no drafts either."""
    report = V.validate(str(recorded["path"]), servers["urls"]["greedy"], [], tmp_path, settings())
    assert not report["passed"] and report["fixed"]["exact"] == PROMPTS
    assert len(report["failures"]) == 1 and "reported no speculative counts" in report["failures"][0]
    assert report["acceptance_pass"] == {"of": PROMPTS, "compared_by": ["token_ids"], "differences": []}
    assert (tmp_path / "responses-candidate-acceptance.json").is_file()
    body = V.request_body(recorded["prompts"][0], openai.RequestSettings(logprobs=False), "m")
    assert "logprobs" not in body and "return_tokens_as_token_ids" not in body and body["return_token_ids"] is True
    assert "FAIL: the candidate reported no speculative counts" in V.format_summary(report)


def test_window_contexts_go_as_token_ids_to_completions(tiny, servers, tmp_path):
    """--prompt-source windows: the heldout windows' contexts, as token ids, exactly the prompts
    `occamy_mtp.evaluation.evaluate --reference-decoder` decodes; acceptance read from /v1/completions."""
    from occamy_mtp.data import prepare

    split = dict(train_conversations=4, heldout_conversations=3)
    prompts = V.heldout_window_contexts([tiny["data"]], tiny["tokenizer"], **split)
    windows = prepare.prepare_windows([tiny["data"]], tiny["tokenizer"], **split).heldout
    assert [p.prompt_ids for p in prompts] == [tuple(w.input_ids[: w.answer_start]) for w in windows]
    completions = openai.RequestSettings(endpoint=openai.COMPLETIONS, max_tokens=MAX_TOKENS, timeout_seconds=REQUEST_TIMEOUT_SECONDS)
    body = V.request_body(prompts[0], completions, "m")
    assert body["prompt"] == list(prompts[0].prompt_ids) and body["logprobs"] == openai.DEFAULT_TOP_LOGPROBS
    with pytest.raises(V.ValidationError, match="completions"):
        V.request_body(prompts[0], settings(), "m")
    V.validate(servers["urls"]["greedy"], None, prompts, tmp_path / "off", completions, cold_warm=0)
    report = V.validate(str(tmp_path / "off" / "responses-reference.json"), servers["urls"]["speculative"], [], tmp_path / "on",
                        completions, tolerance=SPEC_LOGPROB_TOLERANCE)
    assert report["passed"], V.format_summary(report)
    assert report["fixed"] == {"exact": len(prompts), "of": len(prompts)} and report["endpoint"] == openai.COMPLETIONS
    acceptance = report["acceptance"]["candidate"]
    assert acceptance["source"] == sglang.SGLANG_SGLEXT  # no meta_info on completions (as in SGLang); sglext is there
    assert acceptance["responses"] == len(prompts) and acceptance["verify_passes"] > 0
    assert acceptance["metrics"]["accepted_tokens"] == acceptance["accepted_tokens"]


def test_faulty_server_is_flagged_token_logprob_malformed_and_death(recorded, servers, tmp_path):
    report = V.validate(str(recorded["path"]), servers["urls"]["faulty"], [], tmp_path, settings(), max_consecutive_errors=2,
                        require_drafts=False, acceptance_pass="never", tolerance=0.0)  # logprobs judged
    names = [p.name for p in recorded["prompts"]]
    assert not report["passed"]
    # One token changed: prompt 1 (cold request), at output token 2, found by token id.
    assert report["token_differences"] == [names[0]]
    row = report["prompts"][0]
    assert row["comparisons"]["cold"]["difference"]["position"] == 2 and row["comparisons"]["warm"]["exact"]
    assert report["cold_warm"]["candidate"]["exact"] == COLD_WARM - 2  # prompt 1 and 2 cold differ from their warm
    # One logprob changed by 0.25 with identical tokens: prompt 2.
    assert report["logprob_differences"] == [names[1]]
    assert report["prompts"][1]["max_logprob_diff"] == pytest.approx(0.25, abs=1e-6)
    assert report["max_logprob_diff"] == pytest.approx(0.25, abs=1e-6)
    # Malformed response (prompt 3), the crash (prompt 5), nobody listening (prompt 6), then skipped (7).
    kinds = {(e["prompt"], e["kind"]) for e in report["errors"]}
    assert (names[2], "malformed") in kinds
    assert (names[4], "transport") in kinds and (names[5], "transport") in kinds and (names[6], "skipped") in kinds
    assert all(e["server"] == "candidate" for e in report["errors"])
    assert report["prompts"][3]["exact"]  # prompt 4 was answered normally before the crash
    assert report["fixed"] == {"exact": 1, "of": PROMPTS}
    assert servers["processes"]["faulty"].wait(timeout=30) == 3  # serve_reference's crash exit code
    summary = V.format_summary(report)
    assert "token difference" in summary and "logprob difference" in summary and "malformed" in summary and "RESULT: FAIL" in summary
    saved = json.loads((tmp_path / "validation.json").read_text())
    assert saved["passed"] is False and saved["errors"] == report["errors"]


def test_parse_response_refuses_malformed_shapes():
    with pytest.raises(http.RequestFailed, match="logprobs"):
        openai.parse_response({"choices": [{"message": {"content": "hi"}}]}, openai.CHAT)
    with pytest.raises(http.RequestFailed, match="not a finite number"):
        openai.parse_response({"choices": [{"text": "a", "logprobs": {"tokens": ["a"], "token_logprobs": [None]}}]}, openai.COMPLETIONS)
    parsed = openai.parse_response({"choices": [{"text": "ab", "logprobs": {"tokens": ["token_id:5", "token_id:7"], "token_logprobs": [-1.0, -2.0]}}],
                               "sglext": {"spec_tokens_details": {"spec_verify_ct": 1, "spec_num_correct_drafts": 0,
                                                                  "spec_num_proposed_drafts": 3, "spec_correct_drafts_histogram": [1, 0, 0, 0]}}},
                              openai.COMPLETIONS)
    assert parsed["token_ids"] == [5, 7] and parsed["speculative"]["source"] == sglang.SGLANG_SGLEXT
    assert parsed["speculative"]["draft_steps"] == 3 and parsed["speculative"]["histogram_consistent"]
    without = openai.parse_response({"choices": [{"text": "ab", "token_ids": [5, 7]}]}, openai.COMPLETIONS, logprobs=False)
    assert without["token_ids"] == [5, 7] and without["tokens"] is None and without["speculative"] is None


def test_prometheus_counters_are_read_as_vllm_writes_them():
    """vLLM 0.32's /metrics around two requests: the counters' growth equals the sum of the two
    responses' own `metrics.speculative_decoding` (the engine's two reports of the same steps)."""
    before, after = (vllm.parse_spec_counters((FIXTURES / f"vllm-0.32.0-metrics-mtp3-{i}.txt").read_text()) for i in (0, 2))
    delta = vllm.counter_delta({"counters": before}, {"counters": after})
    spec = [r["metrics"]["speculative_decoding"] for r in _fixture("vllm-0.32.0-chat-mtp3.json")["responses"]]
    assert delta["drafts"] == sum(s["num_spec_steps"] for s in spec)
    assert delta["draft_tokens"] == sum(s["num_draft_tokens"] for s in spec)
    assert delta["accepted_tokens"] == sum(s["num_accepted_draft_tokens"] for s in spec)
    histogram = [sum(h) for h in zip(*(s["acceptance_histogram"] for s in spec))]
    assert delta["accepted_per_position"] == [sum(histogram[k + 1 :]) for k in range(3)]  # position k: >= k+1 accepted
    assert vllm.parse_spec_counters((FIXTURES / "vllm-0.32.0-metrics-mtp-off-2.txt").read_text()) is None  # speculation off
    with pytest.raises(http.RequestFailed, match="not a count"):
        vllm.parse_spec_counters('vllm:spec_decode_num_drafts_total{engine="0"} -3.0\n')


def test_unreachable_server_and_bad_arguments(tmp_path, capsys):
    prompts = V.prompt_set(2, [])
    run = V.collect("http://127.0.0.1:9", prompts, 0, openai.RequestSettings(timeout_seconds=5), max_consecutive_errors=1)
    assert run["model_error"]["kind"] == "transport" and all(r["error"]["kind"] == "skipped" for r in run["requests"])
    assert validate_command.main(["--reference", "not-a-url-or-file", "--candidate", "http://127.0.0.1:9", "--out", str(tmp_path)]) == 2
    assert "--reference" in capsys.readouterr().err
    assert validate_command.main(["--reference", "http://127.0.0.1:9", "--extra-body", "[1]", "--out", str(tmp_path)]) == 2


# ----------------------------------------------------------------------------------
# The engines' own formats, replayed from tests/fixtures
# ----------------------------------------------------------------------------------


class ReplayServer(LoopbackServer):
    """A loopback HTTP server answering with a fixture's recorded bodies: POSTs get the
    fixture's responses in turn; GET /metrics gets `metrics[i]` once i POSTs were served
    (the last one afterwards); other GETs a fixed table of JSON bodies."""

    def __init__(self, responses: list[dict], gets: dict[str, dict], metrics: list[str] | None = None):
        self.responses, self.gets, self.metrics = responses, gets, metrics
        self.posted: list[dict] = []
        replay = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def _send(self, status: int, body: bytes, kind: str = "application/json"):
                self.send_response(status)
                self.send_header("Content-Type", kind)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def do_GET(self):  # noqa: N802
                if self.path == "/metrics" and replay.metrics is not None:
                    text = replay.metrics[min(len(replay.posted), len(replay.metrics) - 1)]
                    self._send(200, text.encode(), "text/plain; version=0.0.4; charset=utf-8")
                elif self.path in replay.gets:
                    self._send(200, json.dumps(replay.gets[self.path]).encode())
                else:
                    self._send(404, b'{"detail": "Not Found"}')

            def do_POST(self):  # noqa: N802
                replay.posted.append(json.loads(self.rfile.read(int(self.headers["Content-Length"]))))
                self._send(200, json.dumps(replay.responses[(len(replay.posted) - 1) % len(replay.responses)]).encode())

        super().__init__(Handler)


def _fixture(name: str) -> dict:
    return json.loads((FIXTURES / name).read_text())


def _sglang_server(name: str) -> ReplayServer:
    fixture = _fixture(name)
    return ReplayServer(fixture["responses"], {"/v1/models": fixture["models"], "/server_info": fixture["server_info"]})


def _replay_settings() -> openai.RequestSettings:
    return openai.RequestSettings(endpoint=openai.CHAT, max_tokens=16, timeout_seconds=REQUEST_TIMEOUT_SECONDS)


@pytest.mark.parametrize("version", ["0.5.23", "0.5.13"])
def test_sglang_acceptance_is_read_from_meta_info(version, tmp_path):
    """SGLang's chat responses (K = 3): meta_info asked for in the body, read per request; the
    expected counts are added up by hand from the two recorded responses."""
    prompts = V.prompt_set(2, [])
    with _sglang_server(f"sglang-{version}-chat-mtp-off.json") as off, _sglang_server(f"sglang-{version}-chat-mtp3.json") as on:
        report = V.validate(off.url, on.url, prompts, tmp_path, _replay_settings(), cold_warm=0)
        sent = on.posted[0]
    assert sent["return_meta_info"] is True and sent["return_spec_tokens_details"] is True and sent["top_logprobs"] == 2
    assert report["passed"], V.format_summary(report)
    assert report["prompts"][0]["comparisons"]["cold"]["compared_by"] == ("token_ids" if version == "0.5.23" else "token_strings")
    acceptance = report["acceptance"]["candidate"]
    assert (acceptance["engine"], acceptance["engine_version"], acceptance["source"]) == ("sglang", version, sglang.SGLANG_META)
    # Responses: (12 tokens, 5 verify passes, 6 of 15 drafts, histogram [2, 1, 1, 1]) and (8, 4, 3 of 12, [2, 1, 1, 0]).
    assert (acceptance["verify_passes"], acceptance["accepted_tokens"], acceptance["draft_tokens"]) == (9, 9, 27)
    assert acceptance["accept_rate"] == pytest.approx(9 / 27) and acceptance["accept_length"] == pytest.approx(2.0)
    assert acceptance["tokens_per_verify_pass"] == pytest.approx(20 / 9)  # SGLang's spec_accept_length over both
    assert acceptance["histogram"] == [4, 2, 2, 1]
    assert acceptance["per_position"]["proposed"] == [9, 5, 3] and acceptance["per_position"]["accepted"] == [5, 3, 1]
    reference = report["acceptance"]["reference"]  # MTP off: meta_info without spec fields, no /metrics
    assert reference["source"] is None and "HTTP 404" in reference["metrics"]["error"]


def test_sglang_sglext_alone_is_read(tmp_path):
    """A 0.5.23 response without meta_info (not asked for) still carries sglext.spec_tokens_details."""
    fixture = _fixture("sglang-0.5.23-chat-mtp3.json")
    for response in fixture["responses"]:
        del response["choices"][0]["meta_info"]
    prompts = V.prompt_set(2, [])
    with _sglang_server("sglang-0.5.23-chat-mtp-off.json") as off, \
            ReplayServer(fixture["responses"], {"/v1/models": fixture["models"]}) as on:
        report = V.validate(off.url, on.url, prompts, tmp_path, _replay_settings(), cold_warm=0)
    acceptance = report["acceptance"]["candidate"]
    assert report["passed"] and acceptance["source"] == sglang.SGLANG_SGLEXT
    assert (acceptance["verify_passes"], acceptance["accepted_tokens"], acceptance["draft_tokens"]) == (9, 9, 27)
    assert "tokens_per_verify_pass" not in acceptance  # sglext has no completion_tokens


def test_divergence_is_located_with_the_reference_margin(tmp_path):
    """The candidate takes the reference's runner-up at output token 3 of the first prompt."""
    fixture = _fixture("sglang-0.5.23-chat-mtp3.json")
    choice = fixture["responses"][0]["choices"][0]
    entry = choice["logprobs"]["content"][3]
    runner_up = entry["top_logprobs"][1]
    entry["token"], entry["top_logprobs"] = runner_up["token"], [runner_up, entry["top_logprobs"][0]]
    choice["response_token_ids"][3] = 17545
    prompts = V.prompt_set(2, [])
    with _sglang_server("sglang-0.5.23-chat-mtp-off.json") as off, \
            ReplayServer(fixture["responses"], {"/v1/models": fixture["models"]}) as on:
        report = V.validate(off.url, on.url, prompts, tmp_path, _replay_settings(), cold_warm=0)
    assert not report["passed"] and report["divergence"]["prompts"] == 1 and report["divergence"]["of"] == 2
    detail = report["divergence"]["details"][0]
    assert (detail["position"], detail["reference"], detail["candidate"]) == (3, 6303, 17545)
    assert detail["reference_margin"] == pytest.approx(1.75) and detail["candidate_took_reference_runner_up"]
    assert report["prompts"][0]["max_logprob_diff"] == 0.0  # logprobs compared before the divergence only
    assert "first differing output token at 3" in V.format_summary(report)


def test_logprobs_that_differ_in_their_last_bits_do_not_fail_identical_tokens_unless_asked():
    """A verify pass over 1 + K positions rounds otherwise than a one-token step: the same tokens with
    logprobs 2e-6 apart are exact under the command's default tolerance, not under 0."""
    reference = {"token_ids": [5, 6, 7], "tokens": None, "text": "abc", "logprobs": [-0.5, -1.25, -0.125]}
    candidate = {**reference, "logprobs": [-0.5, -1.25 + 2e-6, -0.125]}
    default = V.DEFAULT_LOGPROB_TOLERANCE
    judged = V.compare_responses(reference, candidate, default)
    assert judged["exact"] and judged["max_logprob_diff"] == pytest.approx(2e-6, rel=1e-3)
    assert not V.compare_responses(reference, candidate, 0.0)["exact"]
    other = {**candidate, "token_ids": [5, 6, 8]}
    assert not V.compare_responses(reference, other, default)["exact"]  # tokens still decide


def _vllm_server(name: str) -> ReplayServer:
    fixture = _fixture(f"vllm-0.32.0-chat-{name}.json")
    metrics = [(FIXTURES / f"vllm-0.32.0-metrics-{name}-{i}.txt").read_text() for i in range(3)]
    return ReplayServer(fixture["responses"], {"/v1/models": fixture["models"], "/version": fixture["version_endpoint"]}, metrics)


def test_vllm_acceptance_per_request_and_from_metrics(tmp_path):
    """vLLM 0.32's real responses and /metrics pages (captured, tests/fixtures): per-request
    figures preferred, the /metrics counters read before and after agree with them."""
    prompts = V.prompt_set(2, [])
    with _vllm_server("mtp-off") as off, _vllm_server("mtp3") as on:
        report = V.validate(off.url, on.url, prompts, tmp_path, openai.RequestSettings(max_tokens=24, timeout_seconds=60),
                            cold_warm=0, tolerance=0.05)
        sent = on.posted[0]
    assert sent["return_tokens_as_token_ids"] is True and sent["return_token_ids"] is True and sent["logprobs"] is True
    assert report["passed"], V.format_summary(report)
    assert report["prompts"][0]["comparisons"]["cold"]["compared_by"] == "token_ids"
    assert 0 < report["max_logprob_diff"] <= 0.05  # bf16: the verify pass and one-token decode round differently
    spec = [r["metrics"]["speculative_decoding"] for r in _fixture("vllm-0.32.0-chat-mtp3.json")["responses"]]
    acceptance = report["acceptance"]["candidate"]
    assert (acceptance["engine"], acceptance["engine_version"], acceptance["source"]) == ("vllm", "0.32.0", vllm.VLLM_PER_REQUEST)
    assert acceptance["verify_passes"] == sum(s["num_spec_steps"] for s in spec)
    assert acceptance["accepted_tokens"] == sum(s["num_accepted_draft_tokens"] for s in spec)
    assert acceptance["accept_length"] == pytest.approx(
        1 + sum(s["num_accepted_draft_tokens"] for s in spec) / sum(s["num_spec_steps"] for s in spec))
    metrics = acceptance["metrics"]
    assert metrics["source"] == vllm.VLLM_METRICS and metrics["per_position"] == acceptance["per_position"]
    assert (metrics["drafts"], metrics["accepted_tokens"], metrics["draft_tokens"]) == (
        acceptance["verify_passes"], acceptance["accepted_tokens"], acceptance["draft_tokens"])
    assert report["acceptance"]["reference"] is None  # MTP off: no counters, no per-request figures


def test_vllm_metrics_alone(tmp_path):
    """Without --per-request-spec-decode-metrics the /metrics counters are the only source."""
    fixture = _fixture("vllm-0.32.0-chat-mtp3.json")
    for response in fixture["responses"]:
        response["metrics"] = None
    metrics = [(FIXTURES / f"vllm-0.32.0-metrics-mtp3-{i}.txt").read_text() for i in range(3)]
    prompts = V.prompt_set(2, [])
    with _vllm_server("mtp-off") as off, ReplayServer(fixture["responses"], {"/v1/models": fixture["models"]}, metrics) as on:
        report = V.validate(off.url, on.url, prompts, tmp_path, openai.RequestSettings(max_tokens=24, timeout_seconds=60),
                            cold_warm=0, tolerance=0.05)
    acceptance = report["acceptance"]["candidate"]
    assert report["passed"] and acceptance["source"] == vllm.VLLM_METRICS and acceptance["engine_version"] is None
    before, after = (vllm.parse_spec_counters(metrics[i]) for i in (0, 2))
    assert acceptance["verify_passes"] == after["drafts"] - before["drafts"] > 0
    assert "from vllm: /metrics counters" in V.format_summary(report)


def test_vllm_that_does_not_speculate_with_logprobs_gets_an_acceptance_pass(tmp_path):
    """An engine that drafts nothing on logprob requests (older vLLM): the counters stand still
    during the logprob run, so the prompts go once more without logprobs, and that pass
    supplies the acceptance and a token comparison."""
    fixture = _fixture("vllm-0.32.0-chat-mtp3.json")
    for response in fixture["responses"]:
        response["metrics"] = None
    counters = [(FIXTURES / f"vllm-0.32.0-metrics-mtp3-{i}.txt").read_text() for i in range(3)]
    # 2 logprob requests: the counters stay; then 2 plain requests: they advance.
    metrics = [counters[0]] * 3 + [counters[1], counters[2]]
    prompts = V.prompt_set(2, [])
    with _vllm_server("mtp-off") as off, ReplayServer(fixture["responses"], {"/v1/models": fixture["models"]}, metrics) as on:
        report = V.validate(off.url, on.url, prompts, tmp_path, openai.RequestSettings(max_tokens=24, timeout_seconds=60),
                            cold_warm=0, tolerance=0.05)
        plain = on.posted[2:]
    assert len(plain) == 2 and all("logprobs" not in body for body in plain)
    assert report["acceptance"]["candidate"]["drafted_nothing"] is True
    assert report["acceptance"]["acceptance_pass"]["drafted_nothing"] is False
    assert report["acceptance_pass"] == {"of": 2, "compared_by": ["token_ids"], "differences": []}
    assert report["passed"], V.format_summary(report)


def test_thinking_prompts_open_the_think_block(tiny):
    """--thinking: chat requests ask the template for thinking, completions prompts are rendered with it, and the
    heldout windows' contexts are the thinking-mode prompts evaluation measures a thinking preset on."""
    split = dict(train_conversations=4, heldout_conversations=3)
    tokenizer = tiny["tokenizer"]
    on, off = (V.heldout_window_contexts([tiny["data"]], tokenizer, mode, **split) for mode in (True, False))
    assert [p.name for p in on] == [p.name for p in off]
    assert all(tokenizer.decode(p.prompt_ids).endswith("assistant\n<think>\n") for p in on)
    assert all(tokenizer.decode(p.prompt_ids).endswith("<think>\n\n</think>\n\n") for p in off)
    prompt = V.prompt_set(1, [])[0]
    assert V.request_body(prompt, openai.RequestSettings(thinking=True), "m")["chat_template_kwargs"] == {"enable_thinking": True}
    assert V.request_body(prompt, openai.RequestSettings(), "m")["chat_template_kwargs"] == {"enable_thinking": False}
    body = V.request_body(prompt, openai.RequestSettings(endpoint=openai.COMPLETIONS, thinking=True), "m", tokenizer)
    assert body["prompt"].endswith("<|im_start|>assistant\n<think>\n")
