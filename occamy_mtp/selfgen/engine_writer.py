"""The base's continuations written by serving engines: OpenAI-compatible servers, many requests in flight.

Each context is one completion of token ids (`engines.completions`: greedy or sampled with a
seed per context, stopping at the base's stop tokens, token ids read back). `connect` checks
every server first (it answers, names a model, the model is `data.self_generate_model` when
set, and a short greedy probe comes back); `write` keeps `concurrency` requests in flight per
server and retries a failed request with backoff; a server that stays down stops the run,
naming its URL and the last error. Continuations whose text had to be tokenized and did not
decode back to it are counted.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, replace

from occamy_mtp.engines.completions import Answer, Request, read_answer, request_body
from occamy_mtp.engines.http import RequestFailed, post_json, server_identity
from occamy_mtp.errors import OccamyError
from occamy_mtp.sampling import TextSampling
from occamy_mtp.selfgen.store import ENGINE, Continuation

PROBE_TOKENS = 2  # new tokens of the probe request: enough to see token ids come back
BACKOFF_SECONDS = 1.0  # the first retry's wait; each next one doubles, up to MAX_BACKOFF_SECONDS
MAX_BACKOFF_SECONDS = 30.0
PROGRESS_SECONDS = 10.0  # how often progress is logged


class EngineError(OccamyError, RuntimeError):
    """A server that cannot write the continuations: names its URL and what went wrong."""


@dataclass(frozen=True)
class Server:
    """One server that writes continuations, as `connect` found it."""

    url: str
    model: str
    engine: str | None
    version: str | None
    token_ids: bool
    """The probe came back with token ids (else the server's text is tokenized)."""

    def to_dict(self) -> dict:
        return asdict(self)


def _completion(url: str, model: str, prompt_ids: Sequence[int], tokenizer, request: Request,
                max_tokens: int | None = None, stopped: threading.Event | None = None, greedy: bool = False) -> Answer:
    """One context's continuation from one server, retried on a connection error, a timeout,
    an HTTP 5xx or a malformed answer; RequestFailed after the last try."""
    body = request_body(model, prompt_ids, request, max_tokens, greedy)
    for attempt in range(request.retries + 1):
        try:
            return read_answer(post_json(url.rstrip("/") + "/v1/completions", body, request.timeout_seconds), tokenizer,
                               request, max_tokens)
        except RequestFailed as err:
            err.tries = attempt + 1
            if err.kind == "http" and err.status is not None and err.status < 500 or attempt == request.retries:
                raise  # a client error (4xx) is not retried: the same request would fail the same way
            if stopped is not None and stopped.wait(min(MAX_BACKOFF_SECONDS, BACKOFF_SECONDS * 2**attempt)):
                raise
            if stopped is None:
                time.sleep(min(MAX_BACKOFF_SECONDS, BACKOFF_SECONDS * 2**attempt))
    raise AssertionError("unreachable")


def connect(urls: Sequence[str], expected_model: str, probe_prompt: Sequence[int], tokenizer, request: Request) -> list[Server]:
    """Check every server before the run: it answers, names the expected model (all the same
    one), and a short greedy probe comes back; EngineError names the server that does not."""
    servers = []
    for url in urls:
        try:
            identity = server_identity(url, request.timeout_seconds)
        except RequestFailed as err:
            raise EngineError(f"data.self_generate_endpoints: {url} does not answer as an OpenAI-compatible server "
                              f"({err})") from None
        model = identity["model"]
        if expected_model and model != expected_model:
            raise EngineError(f"data.self_generate_endpoints: {url} serves {model!r}, not data.self_generate_model "
                              f"{expected_model!r}; point the run at servers of the base")
        if servers and model != servers[0].model:
            raise EngineError(f"data.self_generate_endpoints: {url} serves {model!r} and {servers[0].url} serves "
                              f"{servers[0].model!r}; every server must serve the same base")
        try:
            probe = _completion(url, model, probe_prompt, tokenizer, request, PROBE_TOKENS, greedy=True)
        except RequestFailed as err:
            raise EngineError(f"data.self_generate_endpoints: {url}: a {PROBE_TOKENS}-token greedy probe failed ({err})") from None
        servers.append(Server(url, model, identity["engine"], identity["version"], probe.source == "token_ids"))
    return servers


def write(servers: Sequence[Server], contexts: Sequence[Sequence[int]], tokenizer, request: Request, concurrency: int,
          log: Callable[[str], None]) -> Iterator[tuple[int, Answer]]:
    """(index into `contexts`, its answer) as each comes back, `concurrency` requests in flight per server.

    A request that fails after its retries stops every worker and raises EngineError with
    the server's URL and the error; what was yielded before stays the caller's.
    """
    todo: queue.Queue[int] = queue.Queue()
    for index in range(len(contexts)):
        todo.put(index)
    done: queue.Queue = queue.Queue()
    stopped = threading.Event()

    def worker(server: Server) -> None:
        while not stopped.is_set():
            try:
                index = todo.get_nowait()
            except queue.Empty:
                return
            try:
                done.put((index, _completion(server.url, server.model, contexts[index], tokenizer, request, stopped=stopped)))
            except RequestFailed as err:
                tries = "once, not retried" if err.tries == 1 else f"after {err.tries} tries"
                done.put((index, EngineError(f"data.self_generate_endpoints: {server.url} failed on a request ({tries}): "
                                             f"{err}")))
                stopped.set()
                return

    threads = [threading.Thread(target=worker, args=(server,), daemon=True)
               for server in servers for _ in range(min(concurrency, len(contexts)))]
    for thread in threads:
        thread.start()
    started = last_log = time.monotonic()
    received = tokens = 0
    try:
        while received < len(contexts):
            index, answer = done.get()
            if isinstance(answer, EngineError):
                stopped.set()
                yield from _received(done)  # what other servers answered already is the caller's too
                raise answer
            received += 1
            tokens += len(answer.tokens)
            now = time.monotonic()
            if now - last_log >= PROGRESS_SECONDS or received == len(contexts):
                last_log = now
                log(f"  {received}/{len(contexts)} continuations from {len(servers)} server(s), "
                    f"{tokens / max(now - started, 1e-9):,.0f} tokens/s")
            yield index, answer
    finally:
        stopped.set()  # workers take no new request; one still waiting on a server ends with it (daemon threads)


def _received(done: queue.Queue) -> Iterator[tuple[int, Answer]]:
    """The answers already in `done`, without waiting for the requests still in flight."""
    while True:
        try:
            index, answer = done.get_nowait()
        except queue.Empty:
            return
        if not isinstance(answer, EngineError):
            yield index, answer


class EngineWriter:
    """The servers of `connect` as the self-generated store's writer (`store.Writer`)."""

    source = ENGINE
    shares_batches = False  # a server batches the requests it is sent itself

    def __init__(self, urls: Sequence[str], expected_model: str, tokenizer, request: Request, concurrency: int):
        self.urls, self.expected_model = list(urls), expected_model
        self.tokenizer, self.request, self.concurrency = tokenizer, request, concurrency
        self.sampling = request.sampling
        self._servers: list[Server] | None = None
        self.sources: dict[str, int] = {}
        """How the answers' tokens were read: "token_ids", "text", "text_lossy" -> count."""

    def for_text(self, sampling: TextSampling) -> "EngineWriter":
        """The same servers (checked once) writing under other sampling settings."""
        writer = EngineWriter(self.urls, self.expected_model, self.tokenizer, replace(self.request, sampling=sampling),
                              self.concurrency)
        writer._servers = self._servers
        return writer

    @property
    def servers(self) -> list[Server]:
        """The servers, checked by `connect` the first time they are needed (before any request)."""
        if self._servers is None:
            probe = self.tokenizer("Hello", add_special_tokens=False)["input_ids"]
            self._servers = connect(self.urls, self.expected_model, probe, self.tokenizer, self.request)
        return self._servers

    def details(self) -> dict:
        return {"model": self.servers[0].model, "servers": [s.to_dict() for s in self.servers],
                "concurrency": self.concurrency}

    def describe(self) -> str:
        engines = sorted({f"{s.engine or 'unknown engine'} {s.version or ''}".strip() for s in self.servers})
        return f"{len(self.servers)} server(s) ({', '.join(engines)})"

    def answers(self, contexts, missing, max_new_tokens, stop_token_ids, log):
        if max_new_tokens != self.request.max_new_tokens or frozenset(stop_token_ids) != self.request.stop_token_ids:
            raise ValueError("the store's budget and stop tokens are not the ones the servers were asked for")
        indices = [i for i, m in enumerate(missing) if m]
        for position, answer in write(self.servers, [contexts[i] for i in indices], self.tokenizer, self.request,
                                      self.concurrency, log):
            self.sources[answer.source] = self.sources.get(answer.source, 0) + 1
            yield indices[position], Continuation(answer.tokens, answer.finished)
        lossy = self.sources.get("text_lossy", 0)
        if self.sources.get("text", 0) or lossy:
            log(f"  {self.sources.get('text', 0) + lossy} answers came back as text and were tokenized; "
                f"{lossy} do not decode back to their text")
