"""The endpoint validation tool against real HTTP server processes on loopback.

Three `occamy_mtp.serve_reference` processes serve a tiny fp32 checkpoint on 127.0.0.1
(free ports): MTP off (plain greedy), MTP on (the reference speculative decoder, 3 draft
steps), and a faulty one that changes one output token, shifts one logprob, sends one
malformed response and then dies mid-run. Every request has a timeout and every
process is terminated at the end.
"""

from __future__ import annotations

import json
import os
import selectors
import subprocess
import sys
import time
from pathlib import Path

import pytest

from occamy_mtp import validate as V
from occamy_mtp.testing.checkpoints import build_tiny_checkpoint
from occamy_mtp.testing.tokenizer import SAMPLE_DATA_PATH

REPO = Path(__file__).resolve().parent.parent
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
                [sys.executable, "-m", "occamy_mtp.serve_reference", "--base", str(tiny["base"]), "--port", "0", *flags],
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


def settings() -> V.RequestSettings:
    return V.RequestSettings(endpoint=V.CHAT, max_tokens=MAX_TOKENS, timeout_seconds=REQUEST_TIMEOUT_SECONDS)


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
        [sys.executable, "-m", "occamy_mtp.validate", "--reference", str(recorded["path"]),
         "--candidate", servers["urls"]["greedy"], "--out", str(tmp_path), "--quiet", "--timeout", str(REQUEST_TIMEOUT_SECONDS)],
        capture_output=True, text=True, timeout=300, cwd=REPO, env=dict(os.environ, PYTHONPATH=str(REPO)),
    )
    assert result.returncode == 0, result.stdout + result.stderr
    report = json.loads((tmp_path / "validation.json").read_text())
    assert report["passed"] and report["fixed"] == {"exact": PROMPTS, "of": PROMPTS}
    assert report["cold_warm"]["candidate"] == {"exact": COLD_WARM, "of": COLD_WARM, "prompts": report["cold_warm"]["candidate"]["prompts"]}
    assert report["max_logprob_diff"] == 0.0 and not report["errors"]
    assert report["prompts"][0]["comparisons"]["cold"]["compared_by"] == "token_ids"
    assert f"fixed prompts: {PROMPTS}/{PROMPTS} exact" in result.stdout and "RESULT: PASS" in result.stdout
    assert "acceptance (candidate): not reported" in result.stdout


def test_mtp_on_server_passes_and_reports_acceptance(recorded, servers, tmp_path):
    report = V.validate(str(recorded["path"]), servers["urls"]["speculative"], [], tmp_path, settings(),
                        tolerance=SPEC_LOGPROB_TOLERANCE)
    assert report["passed"], V.format_summary(report)
    assert not report["token_differences"] and report["max_logprob_diff"] <= SPEC_LOGPROB_TOLERANCE
    acceptance = report["acceptance"]["candidate"]
    assert acceptance["responses"] == PROMPTS + COLD_WARM
    assert acceptance["completion_tokens"] == (PROMPTS + COLD_WARM) * MAX_TOKENS  # nobody stops early at 6 tokens
    assert acceptance["accept_length"] == pytest.approx(acceptance["completion_tokens"] / acceptance["verify_passes"])
    assert 0 <= acceptance["accept_rate"] <= 1 and len(acceptance["per_step"]["proposed"]) == 3
    assert report["acceptance"]["reference"] is None
    summary = V.format_summary(report)
    assert "accept length" in summary and "per step: step 1" in summary and "RESULT: PASS" in summary


def test_faulty_server_is_flagged_token_logprob_malformed_and_death(recorded, servers, tmp_path):
    report = V.validate(str(recorded["path"]), servers["urls"]["faulty"], [], tmp_path, settings(), max_consecutive_errors=2)
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
    with pytest.raises(V.RequestFailed, match="missing field"):
        V.parse_response({"choices": [{"message": {"content": "hi"}}]}, V.CHAT)
    with pytest.raises(V.RequestFailed, match="one number per token"):
        V.parse_response({"choices": [{"text": "a", "logprobs": {"tokens": ["a"], "token_logprobs": [None]}}]}, V.COMPLETIONS)
    parsed = V.parse_response({"choices": [{"text": "ab", "logprobs": {"tokens": ["token_id:5", "token_id:7"], "token_logprobs": [-1.0, -2.0]}}],
                               "meta_info": {"spec_verify_ct": 1, "completion_tokens": 2}}, V.COMPLETIONS)
    assert parsed["token_ids"] == [5, 7] and parsed["speculative"] == {"verify_passes": 1, "completion_tokens": 2}


def test_unreachable_server_and_bad_arguments(tmp_path, capsys):
    prompts = V.prompt_set(2, [])
    run = V.collect("http://127.0.0.1:9", prompts, 0, V.RequestSettings(timeout_seconds=5), max_consecutive_errors=1)
    assert run["model_error"]["kind"] == "transport" and all(r["error"]["kind"] == "skipped" for r in run["requests"])
    assert V.main(["--reference", "not-a-url-or-file", "--candidate", "http://127.0.0.1:9", "--out", str(tmp_path)]) == 2
    assert "--reference" in capsys.readouterr().err
    assert V.main(["--reference", "http://127.0.0.1:9", "--extra-body", "[1]", "--out", str(tmp_path)]) == 2
