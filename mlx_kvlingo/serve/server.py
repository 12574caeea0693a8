"""The HTTP face: the standard library's `ThreadingHTTPServer`, as `mlx_lm.server` uses.

    GET  /v1/models, /v1/models/{id}, /health
    POST /v1/chat/completions     JSON, or server-sent events (`data: {json}` ... `data: [DONE]`)

A handler thread checks the request, submits it to the worker and copies its events to the
socket. Refused before the models, each with an OpenAI error body: 401 (API key), 404 (path,
model), 411/413 (Content-Length), 415 (not JSON), 400 (bad JSON or fields, prompt too long),
503 (queue full, Retry-After); an unexpected exception is a 500, never a dropped server. A client
that disconnects cancels its job; both caches stay consistent.
"""

from __future__ import annotations

import hmac
import json
import logging
import queue
import select
import socket
import threading
import time
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from mlx_kvlingo.api import AUTO_THRESHOLD, Pair
from mlx_kvlingo.serve import protocol as P
from mlx_kvlingo.serve.worker import Job, QueueFull, Result, Worker

log = logging.getLogger("mlx_kvlingo.serve")


@dataclass(frozen=True)
class ServeConfig:
    """How the server listens and what it accepts (the `kvlingo serve` options)."""

    host: str = "127.0.0.1"
    port: int = 8080  # 0: any free port
    api_key: str | None = None  # when set: `Authorization: Bearer <key>` on every request
    max_body_bytes: int = 1 << 20  # request body limit (413 beyond it)
    limits: P.Limits = P.Limits()
    queue_size: int = 8  # requests waiting behind the running one; 503 beyond
    max_conversations: int = 8  # held conversations (LRU) for prefix reuse; 0: off
    auto_threshold: float = AUTO_THRESHOLD  # `auto`: the large re-answers below this mean log-prob
    request_timeout: float = 600.0  # seconds a request may wait and run in all
    read_timeout: float = 30.0  # seconds to receive a request (slow clients are dropped)


class Server:
    """`kvlingo serve` over one pair. `start()` serves on a thread; `close()` stops it.

    server = Server(pair, ServeConfig(port=0)).start()
    print(server.url)  # http://127.0.0.1:PORT/v1
    ...
    server.close()
    """

    def __init__(self, pair: Pair, config: ServeConfig | None = None,
                 **conversation_kwargs: Any) -> None:  # fmt: skip
        self.pair = pair
        self.config = c = config or ServeConfig()
        self.worker = Worker(pair, limits=c.limits, queue_size=c.queue_size,
                             max_conversations=c.max_conversations, auto_threshold=c.auto_threshold,
                             conversation_kwargs=conversation_kwargs)  # fmt: skip
        handler = type("Handler", (_Handler,), {"app": self, "timeout": c.read_timeout})
        try:
            self.httpd = ThreadingHTTPServer((c.host, c.port), handler)
        except OSError:
            self.worker.close()
            raise
        self.httpd.daemon_threads = True
        self._thread: threading.Thread | None = None

    @property
    def address(self) -> tuple[str, int]:
        host, port = self.httpd.server_address[:2]
        return str(host), int(port)

    @property
    def url(self) -> str:
        host, port = self.address
        return f"http://{host}:{port}/v1"

    def start(self) -> Server:
        self._thread = threading.Thread(target=self.httpd.serve_forever, name="kvlingo-http",
                                        daemon=True)  # fmt: skip
        self._thread.start()
        return self

    def serve_forever(self) -> None:
        try:
            self.httpd.serve_forever()
        finally:
            self.close()

    def close(self) -> None:
        if self._thread is not None:
            self.httpd.shutdown()
            self._thread.join(10)
            self._thread = None
        self.httpd.server_close()
        self.worker.close()

    def __enter__(self) -> Server:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON number")


class _Handler(BaseHTTPRequestHandler):
    app: Server
    protocol_version = "HTTP/1.1"  # keep-alive for JSON answers; event streams close
    server_version = "kvlingo"

    def log_message(self, format: str, *args: Any) -> None:
        log.info("%s %s", self.address_string(), format % args)

    def _json(self, status: int, body: dict, headers: dict[str, str] | None = None) -> None:
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        for k, v in (headers or {}).items():
            self.send_header(k, v)
        if status >= 400:
            self.send_header("Connection", "close")  # the body may be unread: start afresh
            self.close_connection = True
        self.end_headers()
        self._sent = True
        self.wfile.write(data)
        self.wfile.flush()

    def _error(self, e: P.APIError, headers: dict[str, str] | None = None) -> None:
        self._json(e.status, e.body(), headers)

    def _guarded(self, fn) -> None:
        self._sent = False
        try:
            fn()
        except P.APIError as e:  # a refusal, before anything reached the models
            self._error(e, e.headers)
        except (TimeoutError, BrokenPipeError, ConnectionResetError):
            self.close_connection = True
        except Exception as e:  # the server never goes down with a request
            log.exception("request handler failed")
            self.close_connection = True
            if not self._sent:
                try:
                    self._error(P.APIError(500, f"internal error: {e}", type="server_error"))
                except OSError:
                    pass

    def _authorize(self) -> None:
        key = self.app.config.api_key
        scheme, _, token = self.headers.get("Authorization", "").partition(" ")
        if key and not (scheme.lower() == "bearer"
                        and hmac.compare_digest(token.strip().encode(), key.encode())):  # fmt: skip
            raise P.APIError(401, "invalid or missing API key (Authorization: Bearer ...)",
                             code="invalid_api_key")  # fmt: skip

    def _client_gone(self) -> bool:
        """True when the client closed its end (end-of-file is readable on the socket)."""
        try:
            ready, _, _ = select.select([self.connection], [], [], 0)
            if not ready:
                return False
            return self.connection.recv(1, socket.MSG_PEEK) == b""
        except (OSError, ValueError):
            return True

    def do_GET(self) -> None:  # noqa: N802 (http.server's name)
        self._guarded(self._get)

    def _get(self) -> None:
        path = self.path.split("?", 1)[0].rstrip("/")
        if path == "/health":
            return self._json(200, {"status": "ok"})
        self._authorize()
        models = P.model_list(self.app.pair.names)
        if path in ("/v1/models", "/models"):
            return self._json(200, models)
        for prefix in ("/v1/models/", "/models/"):
            if path.startswith(prefix):
                for m in models["data"]:
                    if m["id"] == path[len(prefix) :]:
                        return self._json(200, m)
                raise P.APIError(404, f"the model {path[len(prefix) :]!r} does not exist",
                                 code="model_not_found")  # fmt: skip
        raise P.APIError(404, f"no route {path!r}", code="not_found")

    def do_POST(self) -> None:  # noqa: N802
        self._guarded(self._post)

    def _post(self) -> None:
        path = self.path.split("?", 1)[0].rstrip("/")
        if path not in ("/v1/chat/completions", "/chat/completions"):
            raise P.APIError(404, f"no route {path!r}", code="not_found")
        self._authorize()
        app = self.app
        req = P.parse_request(self._body(), app.config.limits)
        job = Job(req)
        try:
            app.worker.submit(job)
        except QueueFull:
            raise P.APIError(503, f"the server is busy: one request runs and "
                             f"{app.config.queue_size} wait; retry later", type="server_error",
                             code="queue_full", headers={"Retry-After": "1"}) from None  # fmt: skip
        try:
            deadline = job.submitted + app.config.request_timeout
            first = self._next(job, deadline)
            if first is None:
                return
            if first[0] == "error":
                return self._error(first[1])
            rid, model = P.new_id(), req.model
            if req.stream:
                self._stream(job, rid, model, deadline)
            else:
                self._complete(job, rid, model, deadline)
        finally:
            job.cancel()  # a no-op once the job is done; else (handler failed) stop it

    def _body(self) -> Any:
        """The request's JSON body, or an `APIError` saying what is wrong with it."""
        length = self.headers.get("Content-Length")
        if length is None:
            raise P.APIError(411, "a Content-Length header is required")
        if not length.strip().isdigit():
            raise P.APIError(400, f"invalid Content-Length {length!r}")
        n, limit = int(length), self.app.config.max_body_bytes
        if n > limit:
            raise P.APIError(413, f"the request is {n} bytes; at most {limit}",
                             code="request_too_large")  # fmt: skip
        ctype = self.headers.get("Content-Type", "application/json").split(";")[0].strip()
        if ctype.lower() != "application/json":
            raise P.APIError(415, f"Content-Type must be application/json, not {ctype!r}")
        try:
            return json.loads(self.rfile.read(n).decode("utf-8"), parse_constant=_no_constant)
        except (UnicodeDecodeError, ValueError, RecursionError) as e:
            raise P.APIError(400, f"the body is not valid JSON: {e}", code="invalid_json") from None

    def _next(self, job: Job, deadline: float) -> tuple | None:
        """The job's next event; None (job cancelled) when the client left or time ran out."""
        while True:
            try:
                return job.events.get(timeout=0.05)
            except queue.Empty:
                pass
            if self._client_gone():
                job.cancel()
                self.close_connection = True
                return None
            if time.monotonic() > deadline:
                job.cancel()
                if not self._sent:
                    self._error(P.APIError(504, "the request timed out (request_timeout)",
                                           type="server_error", code="timeout"))  # fmt: skip
                self.close_connection = True
                return None

    def _complete(self, job: Job, rid: str, model: str, deadline: float) -> None:
        pieces: list[tuple[str, float]] = []
        while (ev := self._next(job, deadline)) is not None:
            if ev[0] == "token":
                pieces.append((ev[1], ev[2]))
            elif ev[0] == "error":
                return self._error(ev[1])
            elif ev[0] == "done":
                res: Result = ev[1]
                body = P.completion(rid, model, res.text, P.finish_reason(res.finish_reason),
                                    res.usage, res.extra,
                                    pieces if job.request.logprobs else None)  # fmt: skip
                self._sent = True
                return self._json(200, body)

    def _stream(self, job: Job, rid: str, model: str, deadline: float) -> None:
        req = job.request
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Cache-Control", "no-cache")
        self.send_header("Connection", "close")
        self.end_headers()
        self._sent = True
        self.close_connection = True

        def send(obj: dict | str) -> bool:
            data = obj if isinstance(obj, str) else json.dumps(obj)
            try:
                self.wfile.write(f"data: {data}\n\n".encode())
                self.wfile.flush()
                return True
            except OSError:  # the client went away: stop its generation
                job.cancel()
                return False

        usage = req.include_usage
        if not send(P.chunk(rid, model, {"role": "assistant", "content": ""}, usage=usage)):
            return
        while (ev := self._next(job, deadline)) is not None:
            if ev[0] == "token":
                lp = [(ev[1], ev[2])] if req.logprobs else None
                if not send(P.chunk(rid, model, {"content": ev[1]}, pieces=lp, usage=usage)):
                    return
            elif ev[0] == "error":
                send(ev[1].body())
                return
            elif ev[0] == "done":
                res: Result = ev[1]
                end = [P.chunk(rid, model, {}, P.finish_reason(res.finish_reason), usage=usage)]
                end += [P.usage_chunk(rid, model, res.usage, res.extra)] if usage else []
                all(send(x) for x in [*end, "[DONE]"])  # each only while the client is there
                return
