"""`bench/engine_sampled.py` against the library's own reference server (sampled serving, MTP on).

The script is how the real-engine check compares an engine's per-request acceptance under
sampling with the library's exact expectation given the engine's text. Served by the
library's reference server (whose decoder is the library's), that comparison must hold
exactly where it is certain and within chance where it is random: under greedy drafts the
walk given the text is certain, so the drafts proposed at each step equal their expectation;
the accepted drafts lie within a z-score of 4.5 under either draft rule; every sampled token
lies inside the processed distribution's support. The verify passes differ by the budget's
last token alone: the library's walk counts the plain base step it takes there as a round,
the server's SGLang-style count (`spec_verify_ct`) counts verify passes only. The test also
keeps the script running as the library changes: nothing else in the suite calls it.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from occamy_mtp.testing.demo_models import SHIPPED_DIR
from occamy_mtp.testing.tokenizer import SAMPLE_DATA_PATH
from occamy_mtp.commands import validate as validate_command
from test_engine_generate import start_server, stop

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "bench"))
import engine_sampled  # noqa: E402

DRAFT_STEPS = 2
WINDOWS = 8
pytestmark = pytest.mark.usefixtures("single_thread")


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """The shipped demo build, read in place (its donor head is accepted often enough to count)."""
    root = tmp_path_factory.mktemp("engine-sampled")
    models = SHIPPED_DIR
    config = root / "run.yaml"
    config.write_text(f"model:\n  base: {models / 'base'}\n  donor_head: {models / 'donor'}\n  tokenizer: {models / 'tokenizer'}\n"
                      f"  dtype: float32\ndata:\n  files: [{SAMPLE_DATA_PATH}]\n")
    return {"root": root, "base": models / "base", "head": models / "donor", "tokenizer": models / "tokenizer", "config": config}


def assert_proposals_agree(measured: dict, expected: dict, answers: list) -> None:
    """Under greedy drafts the drafts proposed are certain given the text, with one difference of
    counting at a text's end: a round whose accepted draft is the stop token drafted its later steps
    too, and the server's histogram counts them proposed, where the library's walk stops at the text's
    last token. So step 1 agrees exactly, and each later step by at most one a finished answer."""
    finished = sum(answer["finished"] for answer in answers)
    assert measured["proposed"][0] == expected["proposed"][0]
    for served, walked in zip(measured["proposed"][1:], expected["proposed"][1:]):
        assert 0 <= served - walked <= finished, (measured["proposed"], expected["proposed"], finished)


@pytest.mark.parametrize("draft", ["greedy", "sampled"])
def test_the_engine_check_s_expectation_holds_for_the_library_s_own_server(world, draft, capsys):
    process, url = start_server(world, "--head", str(world["head"]), "--tokenizer", str(world["tokenizer"]), "--mode", "speculative",
                                "--draft-steps", str(DRAFT_STEPS), "--draft", draft)
    out = world["root"] / f"{draft}.json"
    try:
        code = engine_sampled.main(["--url", url, "--config", str(world["config"]), "--head", "donor",
                                    "--draft-steps", str(DRAFT_STEPS), "--temperature", "0.7", "--top-p", "0.8",
                                    "--draft", draft, "--windows", str(WINDOWS), "--max-tokens", "32", "--out", str(out)])
    finally:
        stop(process)
    assert code == 0, capsys.readouterr().err
    report = json.loads(out.read_text())
    check, fidelity = report["check"], report["fidelity"]
    assert report["requests"] == WINDOWS and check["decodes"] == WINDOWS
    assert fidelity["tokens"] > 0 and fidelity["outside_the_processed_support"] == 0
    assert all(answer["counts"]["histogram_consistent"] for answer in report["answers"])
    measured, expected = check["measured"], check["expected"]
    assert measured["verify_passes"] > 0 and sum(measured["accepted"]) > 0
    assert abs(check["z"]["accepted"]) < 4.5, check["z"]
    if draft == "greedy":  # the walk given the text is certain
        assert_proposals_agree(measured, expected, report["answers"])
        # verify passes on both sides (a plain step where one token is left is no verify pass): equal, and z 0
        assert expected["verify_passes"] == pytest.approx(measured["verify_passes"], abs=1e-9) and check["z"]["verify_passes"] == 0


def test_per_request_counts_in_each_engine_s_fields_or_from_the_metrics_counters_agree(world, capsys):
    """The same seeded requests to the reference server answering with SGLang's per-request fields, vLLM's,
    or none (the /metrics counters read across each request instead): the same counts per request, read
    from where each engine puts them, and the same per-prompt report (issue 60, item 3)."""
    reports = {}
    for fields in ("sglang", "vllm", "none"):
        process, url = start_server(world, "--head", str(world["head"]), "--tokenizer", str(world["tokenizer"]), "--mode",
                                    "speculative", "--draft-steps", str(DRAFT_STEPS), "--per-request", fields)
        out = world["root"] / f"fields-{fields}.json"
        try:
            code = engine_sampled.main(["--url", url, "--config", str(world["config"]), "--head", "donor",
                                        "--draft-steps", str(DRAFT_STEPS), "--serving", "thinking-coding",
                                        "--windows", "4", "--max-tokens", "24", "--out", str(out)])
        finally:
            stop(process)
        assert code == 0, capsys.readouterr().err
        reports[fields] = json.loads(out.read_text())
    sources = {fields: {a["counts"]["source"] for a in r["answers"]} for fields, r in reports.items()}
    assert sources == {"sglang": {"sglang: sglext.spec_tokens_details"}, "vllm": {"vllm: metrics.speculative_decoding"},
                       "none": {"vllm: /metrics counters (after - before)"}}, sources
    counted = {fields: [(a["counts"]["verify_passes"], a["counts"]["accepted_tokens"], a["counts"]["histogram"])
                        for a in r["answers"]] for fields, r in reports.items()}
    assert counted["sglang"] == counted["vllm"] == counted["none"]
    assert all(sum(passes for passes, _, _ in c) > 0 for c in counted.values())
    by_prompt = reports["none"]["check"]["per_prompt"]
    assert [row["prompt"] for row in by_prompt["prompts"]] == [a["prompt"] for a in reports["none"]["answers"]]
    assert by_prompt == reports["sglang"]["check"]["per_prompt"]
    for row in by_prompt["prompts"]:  # each prompt's own text: its measured and expected figures, and their difference
        assert row["texts"] == 1 and row["difference"] == pytest.approx(row["measured_accept_length"] - row["expected_accept_length"])
    assert len(by_prompt["furthest"]) == 3 and by_prompt["spread"] >= 0
    differences = sorted((abs(row["difference"]), row["prompt"]) for row in by_prompt["prompts"])
    assert {name for _, name in differences[-3:]} == set(by_prompt["furthest"])


def test_a_preset_by_name_brings_its_thinking_mode(world, capsys):
    """--serving thinking-coding: the card's sampling (temperature 0.6, top-p 0.95, top-k 20) on prompts rendered
    with thinking on, and the expectation still holds on the server's text."""
    from transformers import AutoTokenizer

    process, url = start_server(world, "--head", str(world["head"]), "--tokenizer", str(world["tokenizer"]), "--mode", "speculative",
                                "--draft-steps", str(DRAFT_STEPS), "--draft", "greedy")
    out = world["root"] / "thinking-coding.json"
    try:
        code = engine_sampled.main(["--url", url, "--config", str(world["config"]), "--head", "donor", "--draft-steps",
                                    str(DRAFT_STEPS), "--serving", "thinking-coding", "--windows", str(WINDOWS),
                                    "--max-tokens", "32", "--out", str(out)])
    finally:
        stop(process)
    assert code == 0, capsys.readouterr().err
    report = json.loads(out.read_text())
    assert report["serving"]["label"] == "thinking-coding" and report["requests"] == WINDOWS
    tokenizer = AutoTokenizer.from_pretrained(str(world["tokenizer"]))
    assert all(tokenizer.decode(a["prompt_ids"]).endswith("<|im_start|>assistant\n<think>\n") for a in report["answers"])
    assert report["fidelity"]["outside_the_processed_support"] == 0 and abs(report["check"]["z"]["accepted"]) < 4.5
    assert_proposals_agree(report["check"]["measured"], report["check"]["expected"], report["answers"])  # greedy drafts: certain
    assert engine_sampled.main(["--url", url, "--config", str(world["config"]), "--head", "donor", "--draft-steps", "1",
                                "--serving", "no-such-preset", "--out", str(out)]) == 2
    assert "expected greedy or one of thinking-general, thinking-coding" in capsys.readouterr().err


def test_validate_under_a_preset_passes_the_library_s_own_servers_and_fails_a_text_not_sampled(world, tmp_path, capsys):
    """`validate --serving thinking-coding` against the reference server with MTP off and on (K = 2): both
    texts are samples of what was asked, MTP on leaves the text's distribution where it was, and the
    candidate's acceptance is the library's expectation on its own text, so it passes. The same run with
    the candidate's answers replaced by a token the base all but never writes there fails, naming the
    support and the shift; a preset refuses the chat endpoint."""
    from occamy_mtp.serve import validate as V

    off, off_url = start_server(world, "--tokenizer", str(world["tokenizer"]), "--mode", "greedy")
    on, on_url = start_server(world, "--head", str(world["head"]), "--tokenizer", str(world["tokenizer"]), "--mode", "speculative",
                              "--draft-steps", str(DRAFT_STEPS))
    flags = ["--config", str(world["config"]), "--serving", "thinking-coding", "--prompt-source", "windows", "--prompts", "4",
             "--samples", "2", "--max-tokens", "16", "--head", "donor", "--draft-steps", str(DRAFT_STEPS), "--quiet"]
    try:
        code = validate_command.main(["--reference", off_url, "--candidate", on_url, "--out", str(tmp_path / "live"), *flags])
    finally:
        stop(off)
        stop(on)
    printed = capsys.readouterr()
    assert code == 0, printed.err
    report = json.loads((tmp_path / "live" / V.REPORT_FILE).read_text())
    assert report["passed"] and report["serving"] == "thinking-coding" and report["thinking"] is True
    assert all(f["tokens"] > 0 and f["outside_the_processed_support"] == 0 for f in report["fidelity"].values())
    assert report["distribution_shift"]["prompts"] == 4 and abs(report["distribution_shift"]["z"]) < 4.5
    check = report["acceptance_check"]
    assert check["decodes"] == 8 and sum(check["measured"]["accepted"]) > 0 and abs(check["z"]["accepted"]) < 4.5
    # greedy drafts: the verify passes given the text are certain, the server's count (no plain step at a
    # budget's end) the expectation's exactly
    assert check["z"]["verify_passes"] == 0 and check["measured"]["verify_passes"] == check["expected"]["verify_passes"]
    assert "PASSED" in printed.out and "expected on its text" in printed.out

    miscounted = json.loads((tmp_path / "live" / "responses-candidate.json").read_text())
    for answer in miscounted["answers"]:  # a server that counts one verify pass too many a request
        answer["counts"]["verify_passes"] += 1
    (tmp_path / "miscounted.json").write_text(json.dumps(miscounted))
    assert validate_command.main(["--reference", str(tmp_path / "live" / "responses-reference.json"), "--candidate",
                                  str(tmp_path / "miscounted.json"), "--out", str(tmp_path / "miscounted"), *flags]) == 1
    assert "candidate: verify passes z +inf" in capsys.readouterr().err

    candidate = json.loads((tmp_path / "live" / "responses-candidate.json").read_text())
    rare = world_rare_token(world)
    for answer in candidate["answers"]:
        answer["output_ids"] = [rare] * len(answer["output_ids"])
    tampered = tmp_path / "tampered.json"
    tampered.write_text(json.dumps(candidate))
    code = validate_command.main(["--reference", str(tmp_path / "live" / "responses-reference.json"), "--candidate", str(tampered),
                   "--out", str(tmp_path / "tampered"), *flags])
    err = capsys.readouterr().err
    assert code == 1
    assert "candidate: " in err and "outside the processed distribution's support" in err
    assert "MTP on changes the text's distribution" in err

    # MTP off as the candidate, without --head: it drafted nothing, which fails unless allowed
    at = flags.index("--head")
    unhead = flags[:at] + flags[at + 4 :]  # without --head donor --draft-steps K
    recorded_off = str(tmp_path / "live" / "responses-reference.json")
    assert validate_command.main(["--reference", recorded_off, "--candidate", recorded_off, "--out", str(tmp_path / "off"), *unhead]) == 1
    assert "candidate: drafted nothing" in capsys.readouterr().err
    assert validate_command.main(["--reference", recorded_off, "--candidate", recorded_off, "--out", str(tmp_path / "off"),
                                  "--allow-no-drafts", *unhead]) == 0
    assert "not set against the library's expectation" in capsys.readouterr().out

    assert validate_command.main(["--reference", off_url, "--endpoint", "chat", "--out", str(tmp_path / "chat"), *flags]) == 2
    assert "drop --endpoint chat" in capsys.readouterr().err

    # a penalized preset whose engine rule is not the candidate's engine's is refused before any figure (issue 60)
    for role in ("reference", "candidate"):
        run = json.loads((tmp_path / "live" / f"responses-{role}.json").read_text())
        run.update(serving="instruct-general", engine="sglang" if role == "candidate" else run["engine"])
        (tmp_path / f"sglang-{role}.json").write_text(json.dumps(run))
    at = flags.index("--serving")
    general = flags[:at] + ["--serving", "instruct-general"] + flags[at + 2 :]
    assert validate_command.main(["--reference", str(tmp_path / "sglang-reference.json"), "--candidate",
                                  str(tmp_path / "sglang-candidate.json"), "--out", str(tmp_path / "sglang"), *general]) == 2
    err = capsys.readouterr().err
    assert "served by sglang, whose penalties differ from vllm's" in err and "give --serving instruct-general-sglang" in err


def world_rare_token(world) -> int:
    """A token id the demo base gives almost no probability after any context: the last of its vocabulary
    (an id the tokenizer never produces), well outside a top-k of 20."""
    from occamy_mtp.model import checkpoint as ckpt_io

    return ckpt_io.read_config(world["base"]).text_config.vocab_size - 1
