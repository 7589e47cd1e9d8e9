"""One HTTP/1.1 request at a time to a serving engine, with one deadline for the whole exchange.

The standard library's sockets, so that a stalled or trickling server is cut at the deadline,
and a response that is not JSON, too large or cut short is a `RequestFailed` saying what was
wrong. docs/reference/ENGINES.md sets out what each engine answers.
"""

from __future__ import annotations

import json
import socket
import ssl
import time
import urllib.parse

MAX_RESPONSE_BYTES = 64 << 20  # a completion of a few thousand tokens with logprobs is well under 1 MiB
RECV_BYTES = 1 << 16


class RequestFailed(Exception):
    def __init__(self, kind: str, message: str, status: int | None = None):
        super().__init__(message)
        self.kind = kind  # "transport", "http" or "malformed"
        self.status = status  # the HTTP status of an "http" failure
        self.tries = 1  # how many times the request was sent (`engines._completion` counts its retries)

class _Deadline:
    """Seconds left of one request; raises a transport failure once they are spent."""

    def __init__(self, seconds: float, what: str):
        self.seconds, self.what = seconds, what
        self.end = time.monotonic() + seconds

    def left(self, received: int = 0) -> float:
        left = self.end - time.monotonic()
        if left <= 0:
            raise self.expired(received)
        return left

    def expired(self, received: int) -> RequestFailed:
        return RequestFailed("transport", f"{self.what}: no complete response within the {self.seconds:g} s timeout "
                                          f"(whole request, {received} bytes received)")

def request_bytes(method: str, url: str, body: bytes | None, timeout_seconds: float) -> tuple[int, bytes]:
    """One HTTP/1.1 request (Connection: close); (status, body). The timeout bounds the whole
    exchange: every socket operation waits at most for what is left of it."""
    parts = urllib.parse.urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise RequestFailed("transport", f"not an http(s) URL: {url!r}")
    target = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
    deadline = _Deadline(timeout_seconds, f"{method} {target}")
    port = parts.port or (443 if parts.scheme == "https" else 80)
    head = [f"{method} {target} HTTP/1.1", f"Host: {parts.netloc}", "Connection: close", "Accept: application/json, text/plain"]
    if body is not None:
        head += ["Content-Type: application/json", f"Content-Length: {len(body)}"]
    payload = ("\r\n".join(head) + "\r\n\r\n").encode("ascii") + (body or b"")
    received = bytearray()
    try:
        sock = socket.create_connection((parts.hostname, port), timeout=deadline.left())
        try:
            if parts.scheme == "https":
                sock = ssl.create_default_context().wrap_socket(sock, server_hostname=parts.hostname)
            sock.settimeout(deadline.left())
            sock.sendall(payload)
            expected = None  # header bytes + Content-Length, once the headers are in
            while expected is None or len(received) < expected:
                sock.settimeout(deadline.left(len(received)))
                chunk = sock.recv(RECV_BYTES)
                if not chunk:
                    break
                received += chunk
                if len(received) > MAX_RESPONSE_BYTES:
                    raise RequestFailed("malformed", f"{method} {target}: response larger than {MAX_RESPONSE_BYTES} bytes")
                if expected is None and b"\r\n\r\n" in received:
                    expected = _expected_length(bytes(received))
        finally:
            sock.close()
    except (socket.timeout, TimeoutError):  # a socket wait ran into the deadline
        raise deadline.expired(len(received)) from None
    except (ConnectionError, ssl.SSLError, OSError) as err:
        raise RequestFailed("transport", f"{method} {target}: {type(err).__name__}: {err}") from None
    return _parse_http(bytes(received), f"{method} {target}")

def _split_head(raw: bytes) -> tuple[list[str], bytes]:
    head, _, rest = raw.partition(b"\r\n\r\n")
    return head.decode("iso-8859-1").split("\r\n"), rest

def _headers(lines: list[str]) -> dict[str, str]:
    out = {}
    for line in lines[1:]:
        name, _, value = line.partition(":")
        out[name.strip().lower()] = value.strip()
    return out

def _expected_length(raw: bytes) -> int | None:
    """Total bytes of the response when it declares a Content-Length (else read to EOF)."""
    lines, _ = _split_head(raw)
    length = _headers(lines).get("content-length")
    if length is None or not length.isdigit():
        return None
    return raw.index(b"\r\n\r\n") + 4 + int(length)

def _parse_http(raw: bytes, what: str) -> tuple[int, bytes]:
    if b"\r\n\r\n" not in raw:
        raise RequestFailed("transport", f"{what}: connection closed before a complete HTTP header ({len(raw)} bytes)")
    lines, body = _split_head(raw)
    status = lines[0].split(" ", 2)
    if len(status) < 2 or not status[0].startswith("HTTP/") or not status[1].isdigit():
        raise RequestFailed("malformed", f"{what}: not an HTTP status line: {lines[0][:80]!r}")
    headers = _headers(lines)
    if "chunked" in headers.get("transfer-encoding", "").lower():
        body = _dechunk(body, what)
    elif headers.get("content-length", "").isdigit() and len(body) < int(headers["content-length"]):
        raise RequestFailed("transport", f"{what}: connection closed after {len(body)} of {headers['content-length']} body bytes")
    return int(status[1]), body

def _dechunk(body: bytes, what: str) -> bytes:
    out, at = bytearray(), 0
    while True:
        end = body.find(b"\r\n", at)
        size_text = body[at:end].split(b";")[0].strip() if end >= 0 else b""
        try:
            size = int(size_text, 16)
        except ValueError:
            raise RequestFailed("malformed", f"{what}: bad chunked encoding") from None
        if size == 0:
            return bytes(out)
        if end + 2 + size > len(body):
            raise RequestFailed("transport", f"{what}: connection closed inside a chunk")
        out += body[end + 2 : end + 2 + size]
        at = end + 2 + size + 2

def _reject_constant(name: str):
    raise ValueError(f"{name} is not a JSON number")

def _json(raw: bytes, what: str):
    """Parse a JSON body; NaN/Infinity literals, bad UTF-8 and nesting too deep to parse are malformed."""
    try:
        return json.loads(raw.decode("utf-8"), parse_constant=_reject_constant)
    except RecursionError:
        raise RequestFailed("malformed", f"{what}: JSON nested too deeply to parse") from None
    except (ValueError, UnicodeDecodeError) as err:  # JSONDecodeError is a ValueError
        raise RequestFailed("malformed", f"{what}: response is not JSON ({err}); first bytes {raw[:80]!r}") from None

def _request_json(method: str, url: str, body: dict | None, timeout: float) -> dict:
    status, raw = request_bytes(method, url, None if body is None else json.dumps(body).encode("utf-8"), timeout)
    what = f"{method} {urllib.parse.urlsplit(url).path}"
    if not 200 <= status < 300:
        raise RequestFailed("http", f"{what}: HTTP {status}: {raw[:300].decode('utf-8', 'replace')}", status)
    parsed = _json(raw, what)
    if not isinstance(parsed, dict):
        raise RequestFailed("malformed", f"{what}: response is a JSON {type(parsed).__name__}, not an object")
    return parsed

def post_json(url: str, body: dict, timeout: float) -> dict:
    return _request_json("POST", url, body, timeout)

def get_json(url: str, timeout: float) -> dict:
    return _request_json("GET", url, None, timeout)

def server_identity(base_url: str, timeout: float) -> dict:
    """{"model": first /v1/models id, "engine": owned_by ("vllm", "sglang", ...), "version": ...}.

    vLLM's and SGLang's model cards name the engine in `owned_by`; the version comes
    from vLLM's GET /version or SGLang's GET /server_info (absent: None)."""
    listing = get_json(base_url.rstrip("/") + "/v1/models", timeout)
    data = listing.get("data")
    card = data[0] if isinstance(data, list) and data and isinstance(data[0], dict) else None
    if card is None or not isinstance(card.get("id"), str):
        raise RequestFailed("malformed", "GET /v1/models: no data[0].id")
    engine = card.get("owned_by") if isinstance(card.get("owned_by"), str) else None
    version = None
    path = {"vllm": "/version", "sglang": "/server_info"}.get(engine)
    if path is not None:
        try:
            version = get_json(base_url.rstrip("/") + path, timeout).get("version")
        except RequestFailed:
            pass  # the version is a label only
    return {"model": card["id"], "engine": engine, "version": version if isinstance(version, str) else None}
