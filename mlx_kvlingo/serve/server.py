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

import contextlib
import functools
import hmac
import json
import logging
import queue
import select
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from mlx_kvlingo.api import Pair
from mlx_kvlingo.serve import protocol as P
from mlx_kvlingo.serve.worker import Job, ServeConfig, Worker

log = logging.getLogger("mlx_kvlingo.serve")


class Server:
    """`kvlingo serve` over one pair: `start()` serves on a thread (at `url`, .../v1),
    `serve_forever()` on this one; `close()` stops it."""

    def __init__(self, pair: Pair, config: ServeConfig | None = None,
                 **conversation_kwargs: Any) -> None:  # fmt: skip
        self.pair, self.config = pair, (c := config or ServeConfig())
        handler = type("Handler", (_Handler,), {"app": self, "timeout": c.read_timeout})
        self.httpd = ThreadingHTTPServer((c.host, c.port), handler)  # OSError: cannot listen
        self.httpd.daemon_threads = True
        self.worker = Worker(pair, c, conversation_kwargs)
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

    def _error(self, e: P.APIError) -> None:
        self._json(e.status, e.body(), e.headers)

    def _guarded(self, fn) -> None:
        self._sent = False
        try:
            fn(self.path.split("?", 1)[0].rstrip("/"))
        except P.APIError as e:  # a refusal, or the job's error before its answer began
            self._error(e)
        except (TimeoutError, ConnectionError):  # the client left or was too slow
            self.close_connection = True
        except Exception as e:  # the server never goes down with a request
            log.exception("request handler failed")
            self.close_connection = True
            if not self._sent:
                with contextlib.suppress(OSError):
                    self._error(P.APIError(500, f"internal error: {e}", type="server_error"))

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
            return bool(ready) and self.connection.recv(1, socket.MSG_PEEK) == b""
        except (OSError, ValueError):
            return True

    def do_GET(self) -> None:  # noqa: N802 (http.server's name)
        self._guarded(self._get)

    def _get(self, path: str) -> None:
        if path == "/health":
            return self._json(200, {"status": "ok"})
        self._authorize()
        models = P.model_list(self.app.pair.names)
        route = path.removeprefix("/v1")
        if route == "/models":
            return self._json(200, models)
        if route.startswith("/models/"):
            name = route.removeprefix("/models/")
            for m in models["data"]:
                if m["id"] == name:
                    return self._json(200, m)
            raise P.APIError(404, f"the model {name!r} does not exist", code="model_not_found")
        raise P.APIError(404, f"no route {path!r}", code="not_found")

    def do_POST(self) -> None:  # noqa: N802
        self._guarded(self._post)

    def _post(self, path: str) -> None:
        if path.removeprefix("/v1") != "/chat/completions":
            raise P.APIError(404, f"no route {path!r}", code="not_found")
        self._authorize()
        job = Job(P.parse_request(self._body(), self.app.config.limits))
        self.app.worker.submit(job)
        try:
            deadline = job.submitted + self.app.config.request_timeout
            if self._next(job, deadline) is not None:  # accepted
                (self._stream if job.request.stream else self._complete)(job, deadline)
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
        """The job's next event (its error raised); None (job cancelled) when the client left
        or time ran out."""
        while True:
            with contextlib.suppress(queue.Empty):
                ev = job.events.get(timeout=0.05)
                if ev[0] == "error":
                    raise ev[1]
                return ev
            gone = self._client_gone()
            if gone or time.monotonic() > deadline:
                job.cancel()
                self.close_connection = True
                if not (gone or self._sent):
                    raise P.APIError(504, "the request timed out (request_timeout)",
                                     type="server_error", code="timeout")  # fmt: skip
                return None

    def _complete(self, job: Job, deadline: float) -> None:
        while (ev := self._next(job, deadline)) is not None:
            if ev[0] == "done":  # its result holds its tokens
                body = P.completion(job.id, job.request.model, ev[1], job.request.logprobs)
                return self._json(200, body)

    def _stream(self, job: Job, deadline: float) -> None:
        """Server-sent events; a client that left raises ConnectionError (`_post` cancels)."""
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Cache-Control", "no-cache")
        self.send_header("Connection", "close")
        self.end_headers()
        self._sent = self.close_connection = True
        req, chunk = job.request, functools.partial(P.chunk, job.id, job.request.model)
        usage = {"usage": None} if req.include_usage else {}

        def send(obj: dict | str) -> None:
            data = obj if isinstance(obj, str) else json.dumps(obj)
            self.wfile.write(f"data: {data}\n\n".encode())
            self.wfile.flush()

        send(chunk({"role": "assistant", "content": ""}, **usage))
        try:
            while (ev := self._next(job, deadline)) is not None:
                if ev[0] == "token":
                    lp = [ev[1:]] if req.logprobs else None
                    send(chunk({"content": ev[1]}, pieces=lp, **usage))
                else:  # done
                    send(chunk({}, ev[1].finish_reason, **usage))
                    if req.include_usage:  # a last chunk: no choices, the usage
                        send(chunk(None, usage=ev[1].usage, kvlingo=ev[1].extra))
                    return send("[DONE]")
        except P.APIError as e:
            send(e.body())
