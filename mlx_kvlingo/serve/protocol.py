"""The OpenAI chat-completions wire format: requests checked completely into a `ChatRequest`
before they reach the pair (every bad field an `APIError`: HTTP status + OpenAI error body),
responses, stream chunks and error bodies as plain dicts.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Any

#: The model ids this server answers to: the small model answers, the large one answers (from
#: the translated cache), or the cascade (the small answers, the large re-answers when unsure).
MODEL_IDS = ("small", "large", "auto")
#: OpenAI roles a request may carry ("developer" is the newer name of "system").
_SYSTEM_ROLES = ("system", "developer")


class APIError(Exception):
    """A request the server refuses: an HTTP status and an OpenAI-style error body."""

    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None) -> None:  # fmt: skip
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code  # fmt: skip
        self.headers = headers  # extra response headers (Retry-After)

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.code}}  # fmt: skip


def bad(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param=param, code=code)


@dataclass(frozen=True)
class Limits:
    """What one request may ask for."""

    max_tokens: int = 2048  # ceiling on max_tokens / max_completion_tokens
    default_max_tokens: int = 512  # when the request names none
    max_prompt_tokens: int = 4096  # the templated conversation, generation prompt included
    max_stop: int = 4  # stop sequences, as OpenAI allows


@dataclass
class ChatRequest:
    """A checked chat-completions request."""

    model: str
    messages: list[dict[str, str]]  # system first (optional), then user/assistant alternating
    send: dict[str, Any]  # keywords for Conversation.send: the sampling settings, max_tokens
    stop: list[str] = field(default_factory=list)
    stream: bool = False
    include_usage: bool = False
    logprobs: bool = False


def _value(body: dict, name: str, lo=None, hi=None, integer: bool = False) -> Any:
    """body[name], checked: a number (an integer if `integer`; no bool), finite, in [lo, hi]."""
    v, kind = body[name], "an integer" if integer else "a number"
    if isinstance(v, bool) or not isinstance(v, int if integer else (int, float)):
        raise bad(f"{name} must be {kind}, not {type(v).__name__}", name, "invalid_type")
    if not math.isfinite(v):
        raise bad(f"{name} must be finite", name, "invalid_value")
    if lo is not None and v < lo:
        raise bad(f"{name} must be at least {lo}, got {v}", name, "invalid_value")
    if hi is not None and v > hi:
        raise bad(f"{name} must be at most {hi}, got {v}", name, "invalid_value")
    return v if integer else float(v)


def _set(body: dict, name: str) -> bool:
    return body.get(name) is not None


#: OpenAI field -> (`Sampling` field, lo, hi, integer). Non-OpenAI fields that mlx_lm.server
#: also accepts (top_k, min_p, repetition_penalty, repetition_context_size) are read the same way.
_SAMPLING = {
    "temperature": ("temp", 0.0, 2.0),
    "top_p": ("top_p", 0.0, 1.0),
    "top_k": ("top_k", 0, None, True),
    "min_p": ("min_p", 0.0, 1.0),
    "repetition_penalty": ("repetition_penalty", 0.0),
    "repetition_context_size": ("repetition_context_size", 0, None, True),
    "seed": ("seed", None, None, True),
}


def sampling_kwargs(body: dict[str, Any], limits: Limits) -> dict[str, Any]:
    """The `Conversation.send` keywords: the `_SAMPLING` fields set, and `max_tokens`
    (max_completion_tokens, else max_tokens, else `limits.default_max_tokens`)."""
    for name in ("frequency_penalty", "presence_penalty"):
        if _set(body, name) and _value(body, name, -2.0, 2.0) != 0:
            raise bad(f"{name} is not supported by this server (repetition_penalty is mlx-lm's)",
                      name, "unsupported_field")  # fmt: skip
    sampling = {
        f: _value(body, n, *checks) for n, (f, *checks) in _SAMPLING.items() if _set(body, n)
    }
    name = "max_completion_tokens" if _set(body, "max_completion_tokens") else "max_tokens"
    max_tokens = limits.default_max_tokens
    if _set(body, name):
        max_tokens = _value(body, name, 1, limits.max_tokens, True)
    return {**sampling, "max_tokens": max_tokens}


def _content(m: dict, i: int) -> str:
    """A message's text: its string content, or its content parts joined (text parts only)."""
    c = m.get("content")
    if isinstance(c, str):
        return c
    if not isinstance(c, list):
        raise bad(f"messages[{i}] needs a string content", f"messages[{i}].content", "invalid_type")
    for part in c:
        kind = part.get("type") if isinstance(part, dict) else type(part).__name__
        if kind != "text" or not isinstance(part.get("text"), str):
            why = f"messages[{i}]: only text parts (a string 'text') are supported; got {kind!r}"
            raise bad(why, f"messages[{i}].content", "unsupported_content")
    return "".join(part["text"] for part in c)


def parse_messages(raw: Any) -> list[dict[str, str]]:
    """Role/content dicts: an optional system (or developer) message first, then user and
    assistant messages alternating, from a user message to a final user message."""
    if not isinstance(raw, list) or not raw:
        raise bad("messages must be a non-empty list", "messages", "invalid_type")
    out: list[dict[str, str]] = []
    for i, m in enumerate(raw):
        if not isinstance(m, dict):
            raise bad(f"messages[{i}] must be an object", f"messages[{i}]", "invalid_type")
        role = m.get("role")
        want = ("user", "assistant")[(i - (bool(out) and out[0]["role"] == "system")) % 2]
        if i == 0 and role in _SYSTEM_ROLES:
            role = "system"
        elif role != want:
            raise bad(
                f"messages[{i}] should have role {want!r}, not {role!r}: an optional system "
                "message first, then user and assistant messages alternating",
                f"messages[{i}].role",
                "invalid_value",
            )
        if m.get("tool_calls"):
            raise bad("tool calls are not supported", f"messages[{i}].tool_calls")
        out.append({"role": role, "content": _content(m, i)})
    if out[-1]["role"] != "user":
        raise bad("the last message must be a user message", "messages", "invalid_value")
    return out


def parse_request(body: Any, limits: Limits) -> ChatRequest:
    """Check a decoded JSON body; raise `APIError` for anything this server cannot honour."""
    if not isinstance(body, dict):
        raise bad("the request body must be a JSON object")
    model = body.get("model")
    if not isinstance(model, str):
        raise bad("model is required: one of " + ", ".join(MODEL_IDS), "model", "invalid_type")
    if model not in MODEL_IDS:
        raise APIError(404, f"the model {model!r} does not exist; use one of "
                            f"{', '.join(MODEL_IDS)}", param="model", code="model_not_found")  # fmt: skip
    messages = parse_messages(body.get("messages"))
    if _set(body, "n") and _value(body, "n", 1, None, True) != 1:
        raise bad("n must be 1: one answer per request", "n", "unsupported_value")
    for name in ("tools", "functions", "logit_bias"):
        if body.get(name):
            raise bad(f"{name} is not supported by this server", name, "unsupported_field")
    fmt = body.get("response_format")
    if fmt is not None and (not isinstance(fmt, dict) or fmt.get("type") != "text"):
        raise bad("only response_format {'type': 'text'} is supported", "response_format")
    for name, kind in (("stream", bool), ("logprobs", bool), ("stream_options", dict)):
        if _set(body, name) and not isinstance(body[name], kind):
            what = "a boolean" if kind is bool else "an object"
            raise bad(f"{name} must be {what}", name, "invalid_type")
    if _set(body, "top_logprobs") and _value(body, "top_logprobs", 0, None, True) > 0:
        raise bad("top_logprobs is not supported (logprobs of the sampled tokens are)",
                  "top_logprobs", "unsupported_value")  # fmt: skip
    stop = body.get("stop")
    stop = [] if stop is None else [stop] if isinstance(stop, str) else stop
    if not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop):
        raise bad("stop must be a string or a list of non-empty strings", "stop", "invalid_type")
    if len(stop) > limits.max_stop:
        raise bad(f"at most {limits.max_stop} stop sequences", "stop", "invalid_value")
    include_usage = bool((body.get("stream_options") or {}).get("include_usage"))
    send = sampling_kwargs(body, limits)
    stream, logprobs = bool(body.get("stream")), bool(body.get("logprobs"))
    return ChatRequest(model, messages, send, stop, stream, include_usage, logprobs)


def _logprobs(pieces: list[tuple[str, float]] | None) -> dict | None:
    if pieces is None:
        return None
    content = [{"token": t, "logprob": lp, "bytes": list(t.encode()), "top_logprobs": []}
               for t, lp in pieces]  # fmt: skip
    return {"content": content, "refusal": None}


def _envelope(rid: str, model: str, kind: str, choices: list, **rest: Any) -> dict:
    return {"id": rid, "object": kind, "created": int(time.time()), "model": model,
            "system_fingerprint": None, "choices": choices, **rest}  # fmt: skip


def completion(rid: str, model: str, r: Any, logprobs: bool) -> dict:
    """A whole `chat.completion` object from a worker's `Result` `r`."""
    message = {"role": "assistant", "content": "".join(t for t, _ in r.pieces), "refusal": None}
    lp = _logprobs(r.pieces if logprobs else None)
    choice = {"index": 0, "message": message, "logprobs": lp, "finish_reason": r.finish_reason}
    return _envelope(rid, model, "chat.completion", [choice], usage=r.usage, kvlingo=r.extra)


def chunk(rid: str, model: str, delta: dict | None, reason: str | None = None, *,
          pieces: list[tuple[str, float]] | None = None, **rest: Any) -> dict:  # fmt: skip
    """One `chat.completion.chunk`; `delta` None: no choices (the usage chunk). `rest`: `usage`
    (None on every chunk when usage was asked for), `kvlingo`."""
    choice = {"index": 0, "delta": delta, "logprobs": _logprobs(pieces), "finish_reason": reason}
    return _envelope(
        rid, model, "chat.completion.chunk", [choice] if delta is not None else [], **rest
    )


def model_list(names: dict[str, str]) -> dict:
    """`GET /v1/models`: the three ids, each naming the model(s) behind it."""
    created = int(time.time())
    about = {"small": f"{names['small']} reads and answers",
             "large": f"{names['large']} answers from the KV cache translated from {names['small']}",
             "auto": f"{names['small']} answers; {names['large']} re-answers when it is unsure"}  # fmt: skip
    data = [{"id": m, "object": "model", "created": created, "owned_by": "kvlingo",
             "description": about[m]} for m in MODEL_IDS]  # fmt: skip
    return {"object": "list", "data": data}
