"""The base's continuations written by OpenAI-compatible servers (issue 20, part A).

Against the project's own reference server (`occamy_mtp.serve.reference_server`, greedy, float32)
started in a subprocess: the store the servers write is byte for byte the store the
embedded generator writes, the work is spread over several servers, and a server killed
halfway leaves a store that a resumed run completes into the same bytes. Against small
fault servers in this process: connection refused, 500s then success, a hung response, a
malformed body, an answer without token ids, the wrong model. Nothing is lost in any.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler
from pathlib import Path

import pytest
import torch

from occamy_mtp.model import checkpoint as ckpt_io
from occamy_mtp.selfgen import engine_writer as G
from occamy_mtp.config import load_config
from occamy_mtp.base.frozen import BaseFacts
from occamy_mtp.run import (continuation_writer, load_tokenizer, open_stores, prepare_data, run_windows,
                            self_generated_needed)
from occamy_mtp.data.windows import stop_token_ids
from occamy_mtp.sampling import GREEDY_TEXT
from occamy_mtp.selfgen.store import META_FILE, STORE_FILE, SelfGenError
from occamy_mtp.testing.loopback import LoopbackServer
from occamy_mtp.testing.checkpoints import build_tiny_checkpoint
from occamy_mtp.testing.tokenizer import SAMPLE_DATA_PATH
from occamy_mtp.settings import plan_of
from test_validate import _wait_for_url

REPO = Path(__file__).resolve().parent.parent
STARTUP_SECONDS = 120
pytestmark = pytest.mark.usefixtures("single_thread")


@pytest.fixture(scope="module")
def world(tmp_path_factory, sample_tokenizer_dir):
    root = tmp_path_factory.mktemp("engine-generate")
    base = build_tiny_checkpoint(root / "base", seed=4, tokenizer_dir=sample_tokenizer_dir)
    data = root / "chats.jsonl"
    data.write_text("".join(SAMPLE_DATA_PATH.read_text().splitlines(keepends=True)[:16]))
    return {"root": root, "base": base.path, "data": data}


def config_of(world, store: Path, *overrides):
    return load_config(None, [
        f"model.base={world['base']}", f"model.donor_head={world['base']}", "model.dtype=float32",
        f"data.files=[{world['data']}]", "data.context_tokens=16", "data.answer_tokens=10",
        "data.train_conversations=6", "data.validation_conversations=2", "data.heldout_conversations=2",
        "data.self_generate_batch_size=3", f"data.self_generated_dir={store}", f"output.dir={world['root'] / 'run'}",
        "eval.serving=[{temperature: 0}]",  # greedy text only: the reference server decodes greedily
        *overrides,
    ])


def write_store(config, base=None):
    """What a run does to its store: every window's continuation, written by the configured writer."""
    tokenizer = load_tokenizer(config.model)
    data = prepare_data(plan_of(config).setup, tokenizer)
    needed = self_generated_needed(plan_of(config).setup, data)
    stores = open_stores(plan_of(config).setup, BaseFacts(config.model.base), stop_token_ids(tokenizer, config.model.base), needed)
    run_windows(plan_of(config).setup, data, stores, continuation_writer(plan_of(config).setup.selfgen, tokenizer, BaseFacts(config.model.base), stop_token_ids(tokenizer, config.model.base), base))
    return stores[GREEDY_TEXT], len(needed[GREEDY_TEXT])


def start_server(world, *flags) -> tuple[subprocess.Popen, str]:
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
    process = subprocess.Popen(
        [sys.executable, "-m", "occamy_mtp", "serve-reference", "--base", str(world["base"]), "--port", "0", *flags],
        stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env, cwd=REPO,
    )
    return process, _wait_for_url(process, time.monotonic() + STARTUP_SECONDS)


def stop(process: subprocess.Popen) -> None:
    if process.poll() is None:
        process.terminate()
    process.wait(timeout=30)
    process.stdout.close()


def lines_of(directory: Path) -> list[dict]:
    """A store's lines, each without its `store` digest (which names the writer: embedded or engine)."""
    lines = [json.loads(line) for line in (directory / STORE_FILE).read_text().splitlines()]
    return [{k: v for k, v in line.items() if k != "store"} for line in lines]


@pytest.fixture(scope="module")
def embedded(world):
    """The store the base in this process writes (its lines): the reference for every engine-written one."""
    base = ckpt_io.load_base(world["base"], dtype=torch.float32, device=torch.device("cpu"))
    store, windows = write_store(config_of(world, world["root"] / "embedded"), base)
    assert store.generated_now > 0
    return lines_of(world["root"] / "embedded")


@pytest.fixture(scope="module")
def servers(world):
    started = [start_server(world) for _ in range(2)]
    yield [url for _, url in started]
    for process, _ in started:
        stop(process)


def test_two_servers_write_the_embedded_generator_s_store(world, embedded, servers, tmp_path):
    config = config_of(world, tmp_path / "engines", f"data.self_generate_endpoints=[{servers[0]},{servers[1]}]",
                       "data.self_generate_concurrency=2")
    store, _ = write_store(config)
    assert lines_of(tmp_path / "engines") == embedded
    meta = json.loads((tmp_path / "engines" / META_FILE).read_text())
    assert meta["writer"] == "engine" and meta["writer_details"]["model"] == "base"
    assert [s["url"] for s in meta["writer_details"]["servers"]] == servers
    assert all(s["token_ids"] for s in meta["writer_details"]["servers"])
    provenance = store.provenance([])
    assert provenance["writer"] == "engine" and provenance["writer_details"]["concurrency"] == 2


def test_a_store_is_not_extended_by_another_writer(world, embedded, servers, tmp_path):
    directory = tmp_path / "mixed"
    directory.mkdir()
    lines = (world["root"] / "embedded" / STORE_FILE).read_bytes().splitlines(keepends=True)
    (directory / STORE_FILE).write_bytes(b"".join(lines[: len(lines) // 2]))
    (directory / META_FILE).write_text((world["root"] / "embedded" / META_FILE).read_text())
    with pytest.raises(SelfGenError, match="writer: 'embedded' in the store, 'engine' now"):
        write_store(config_of(world, directory, f"data.self_generate_endpoints=[{servers[0]}]"))


def test_a_server_killed_halfway_resumes_into_the_same_store(world, embedded, tmp_path):
    config = config_of(world, tmp_path / "killed", "data.self_generate_retries=1", "data.self_generate_concurrency=1")
    process, url = start_server(world, "--crash-after", "4")  # the probe, then 3 continuations
    try:
        with pytest.raises(G.EngineError, match=rf"{url} failed on a request \(after 2 tries\)"):
            write_store(config_of(world, tmp_path / "killed", f"data.self_generate_endpoints=[{url}]",
                                  "data.self_generate_retries=1", "data.self_generate_concurrency=1"))
    finally:
        stop(process)
    written_bytes = (tmp_path / "killed" / STORE_FILE).read_bytes()
    written = lines_of(tmp_path / "killed")
    assert written and embedded[: len(written)] == written and written != embedded  # what came back stays
    process, url = start_server(world)
    try:
        config = config_of(world, tmp_path / "killed", f"data.self_generate_endpoints=[{url}]")
        write_store(config)
    finally:
        stop(process)
    assert lines_of(tmp_path / "killed") == embedded
    assert (tmp_path / "killed" / STORE_FILE).read_bytes().startswith(written_bytes)  # appended to, not rewritten


def test_servers_write_sampled_text_seeded_per_context(world, embedded, servers, tmp_path):
    """data.train_text sampled (temperature > 0) with servers: each context is asked at that temperature
    with a seed of its own (the store's seed and the context), so the text does not depend on
    which server answers it or when; its store records how it was written and is not the greedy one."""
    from occamy_mtp.sampling import TextSampling

    sampled = ["data.train_text={temperature: 0.9, top_p: 0.95}", "data.self_generate_seed=3"]
    text = TextSampling(0.9, 0.95, 0, 3)

    def write(directory, urls):
        config = config_of(world, directory, f"data.self_generate_endpoints=[{','.join(urls)}]", *sampled)
        tokenizer = load_tokenizer(config.model)
        data = prepare_data(plan_of(config).setup, tokenizer)
        needed = self_generated_needed(plan_of(config).setup, data)
        stores = open_stores(plan_of(config).setup, BaseFacts(config.model.base), stop_token_ids(tokenizer, config.model.base), needed)
        run_windows(plan_of(config).setup, data, stores, continuation_writer(plan_of(config).setup.selfgen, tokenizer, BaseFacts(config.model.base), stop_token_ids(tokenizer, config.model.base)))
        assert set(needed) == {GREEDY_TEXT, text}  # validation and heldout greedy (eval.serving), train sampled
        return stores[text].directory

    one, two = write(tmp_path / "one", servers[:1]), write(tmp_path / "two", servers)
    assert one == tmp_path / "one" / "sampled-t0.9-p0.95-seed3"
    assert lines_of(one) == lines_of(two)  # seeded per context: the same text whichever server wrote it
    meta = json.loads((one / META_FILE).read_text())
    assert meta["writer"] == "engine" and meta["sampling"] == {"temperature": 0.9, "top_p": 0.95, "top_k": 0, "seed": 3}
    greedy = {line["context_sha256"]: line["tokens"] for line in embedded}
    differs = [line["tokens"] != greedy[line["context_sha256"]] for line in lines_of(one) if line["context_sha256"] in greedy]
    assert differs and any(differs)
    assert lines_of(tmp_path / "one") == [line for line in embedded if line["context_sha256"] in {
        line["context_sha256"] for line in lines_of(tmp_path / "one")}]  # the greedy store beside it is the greedy text


# ----------------------------------------------------------------------------------
# Fault servers
# ----------------------------------------------------------------------------------


class FakeEngine(LoopbackServer):
    """An OpenAI-compatible server whose continuation of a prompt is the prompt's last token
    + 1, + 2, ... (then the stop token 7 once it reaches 5 tokens); `fault(number, handler)`
    may answer a request (1-based POST count) itself and return True."""

    STOP = 7

    def __init__(self, fault=None, model="fake", token_ids=True):
        engine = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def _json(self, status, obj):
                body = json.dumps(obj).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def do_GET(self):  # noqa: N802
                self._json(200, {"data": [{"id": model, "owned_by": "fake"}]})

            def do_POST(self):  # noqa: N802
                request = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                with engine.lock:
                    engine.posts += 1
                    number = engine.posts
                try:
                    if fault is not None and fault(number, self):
                        return
                    ids = engine.continuation(request["prompt"], request["max_tokens"])
                    choice = {"text": " ".join(f"t{t}" for t in ids if t != engine.STOP), "index": 0,
                              "finish_reason": "stop" if ids[-1] == engine.STOP else "length"}
                    if token_ids:
                        choice["token_ids"] = ids
                    else:  # as vLLM says it stopped at the eos
                        choice["stop_reason"] = None
                    self._json(200, {"choices": [choice]})
                except (BrokenPipeError, ConnectionResetError):
                    pass

        self.posts = 0
        self.lock = threading.Lock()
        super().__init__(Handler)

    def continuation(self, prompt, max_tokens):
        ids = [(prompt[-1] + k) % 20 + 8 for k in range(1, max_tokens + 1)]
        return ids[:4] + [self.STOP] if max_tokens >= 5 else ids


class Tokenizer:
    """What the writer asks of a tokenizer: the fake engine's text back to ids."""

    eos_token_id = FakeEngine.STOP

    def __call__(self, text, add_special_tokens=False):
        return {"input_ids": [int(word[1:]) if word[1:].isdigit() else 1 for word in text.split()]}

    def decode(self, ids):
        return " ".join(f"t{t}" for t in ids)


CONTEXTS = [(1, 2, 3), (4, 5), (6,), (9, 10, 11), (12,), (13, 14)]


def request(timeout=5.0, retries=2) -> G.Request:
    return G.Request(max_new_tokens=6, stop_token_ids=frozenset({FakeEngine.STOP}), vocab_size=64, timeout_seconds=timeout,
                     retries=retries)


def run_writer(urls, req=None, model="", concurrency=3):
    writer = G.EngineWriter(urls, model, Tokenizer(), req or request(), concurrency)
    answers = dict(writer.answers(CONTEXTS, [True] * len(CONTEXTS), 6, {FakeEngine.STOP}, lambda line: None))
    return writer, [answers[i] for i in range(len(CONTEXTS))]


@pytest.fixture(autouse=True)
def fast_backoff(monkeypatch):
    monkeypatch.setattr(G, "BACKOFF_SECONDS", 0.01)


def expected():
    engine = FakeEngine()
    return [engine.continuation(list(c), 6) for c in CONTEXTS]


def test_answers_are_read_as_token_ids_and_end_at_the_stop_token():
    with FakeEngine() as engine:
        writer, answers = run_writer([engine.url])
    assert [list(a.tokens) for a in answers] == expected() and all(a.finished for a in answers)
    assert writer.sources == {"token_ids": len(CONTEXTS)}


def test_answers_without_token_ids_are_tokenized_and_counted():
    with FakeEngine(token_ids=False) as engine:
        writer, answers = run_writer([engine.url])
    assert [list(a.tokens) for a in answers] == expected()  # the stop token is put back from finish_reason
    assert writer.sources == {"text": len(CONTEXTS)}


def test_server_errors_are_retried():
    def fail_twice(number, handler):
        if number in (2, 3):  # after the probe: two 500s, then answers
            handler._json(500, {"error": "overloaded"})
            return True
        return False

    with FakeEngine(fail_twice) as engine:
        _, answers = run_writer([engine.url], concurrency=1)
    assert [list(a.tokens) for a in answers] == expected()


def test_a_server_that_stays_down_stops_the_run_naming_it():
    def always_500(number, handler):
        if number > 1:
            handler._json(503, {"error": "down"})
            return True
        return False

    with FakeEngine(always_500) as engine:
        with pytest.raises(G.EngineError, match=rf"{engine.url} failed on a request \(after 3 tries\): POST /v1/completions: HTTP 503"):
            run_writer([engine.url])


def test_a_hung_response_times_out_and_is_retried():
    def hang_once(number, handler):
        if number == 2:
            time.sleep(1.5)
            return True
        return False

    with FakeEngine(hang_once) as engine:
        _, answers = run_writer([engine.url], request(timeout=0.5), concurrency=1)
    assert [list(a.tokens) for a in answers] == expected()


def test_a_malformed_body_is_retried_then_refused():
    def malformed(number, handler):
        if number > 1:
            handler.send_response(200)
            handler.send_header("Content-Length", "7")
            handler.end_headers()
            handler.wfile.write(b'{"choic')
            return True
        return False

    with FakeEngine(malformed) as engine:
        with pytest.raises(G.EngineError, match="not valid JSON|malformed|JSON"):
            run_writer([engine.url])


def test_connection_refused_and_the_wrong_model_are_refused_before_the_run():
    with FakeEngine() as engine:
        url = engine.url
    with pytest.raises(G.EngineError, match=rf"{url} does not answer"):
        run_writer([url])
    with FakeEngine(model="another-model") as engine:
        with pytest.raises(G.EngineError, match="serves 'another-model', not data.self_generate_model 'fake'"):
            run_writer([engine.url], model="fake")
        assert engine.posts == 0  # refused before any request


def test_out_of_vocabulary_and_over_budget_answers_are_refused():
    class Wild(FakeEngine):
        def continuation(self, prompt, max_tokens):
            return [99] * max_tokens

    with Wild() as engine:
        with pytest.raises(G.EngineError, match="outside the base's vocabulary"):
            run_writer([engine.url], request(retries=0))


def test_several_train_continuations_are_each_a_train_window(world, servers, tmp_path):
    """data.train_continuations 2 under a sampled train text: the base writes each train context twice, from
    seeds 3 and 4 (a store each), and the run trains on both, each context's continuations together."""
    from occamy_mtp.sampling import TextSampling

    texts = [TextSampling(0.9, 0.95, 0, 3), TextSampling(0.9, 0.95, 0, 4)]
    one = None
    for continuations in (1, 2):
        config = config_of(world, tmp_path / f"run-{continuations}", f"data.self_generate_endpoints=[{servers[0]}]",
                           "data.train_text={temperature: 0.9, top_p: 0.95}", "data.self_generate_seed=3",
                           f"data.train_continuations={continuations}")
        setup = plan_of(config).setup
        tokenizer = load_tokenizer(config.model)
        data = prepare_data(setup, tokenizer)
        facts, stops = BaseFacts(config.model.base), stop_token_ids(tokenizer, config.model.base)
        needed = self_generated_needed(setup, data)
        stores = open_stores(setup, facts, stops, needed)
        windows = run_windows(setup, data, stores, continuation_writer(setup.selfgen, tokenizer, facts, stops))
        assert set(needed) == {GREEDY_TEXT, *texts[:continuations]}
        if continuations == 1:
            one = windows.train
            continue
        assert len(windows.train) == 2 * len(one) == 2 * len(data.train)
        assert windows.train[0::2] == one  # the first seed's windows are the one-continuation run's
        assert [w.input_ids[: w.answer_start] for w in windows.train[1::2]] == [w.input_ids[: w.answer_start] for w in one]
