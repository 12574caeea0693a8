"""Session files. Invariant: a file loads only into the pair that wrote it (geometry and a weight
fingerprint per model), and a load that fails leaves the session as it was, with a one-line
`SessionFileError`. The file is an mlx-lm prompt cache (the source's layers, then the target's),
its metadata `kvlingo_session` the rest as JSON; a `.safetensors` suffix is added where missing."""

from __future__ import annotations

import json
from dataclasses import asdict, replace
from pathlib import Path

from mlx_kvlingo._platform.atomic import atomic_write
from mlx_kvlingo.config import PolicyError, ReaderPolicy
from mlx_kvlingo.conversation.stream import (
    Read,
    SessionError,
    SessionFileError,
    Switch,
    TurnStats,
)
from mlx_kvlingo.kv.cache import prefix_copy
from mlx_kvlingo.models.files import parse_json, read_header
from mlx_kvlingo.models.pair import ModelPair, model_fingerprint

import mlx.core as mx
from mlx_lm.models.cache import KVCache, load_prompt_cache, save_prompt_cache

MODELS = ("source", "target")
SCHEMA, SCHEMA_VERSION = "mlx-kvlingo/session", 1


def _local(s, what: str) -> None:
    if s.remote is not None:  # the large model's cache is spread over the ranks
        raise SessionError(f"{what} is not available when the large model is pipelined over ranks")


def save(path: str | Path, s) -> Path:
    _local(s, "saving")
    pair, t, models = s.pair, s, s.models
    path = Path(path)
    if path.suffix != ".safetensors":
        path = path.with_name(path.name + ".safetensors")
    state = {"schema": SCHEMA, "schema_version": SCHEMA_VERSION, **_identity(pair),
             "layers": [pair.source.geometry.layers, pair.target.geometry.layers],
             "held": {n: models[n].held for n in MODELS}, "tokens": t.tokens,
             "messages": t.messages, "system_prompt": t.system_prompt, "mode": s.mode,
             "policy": s.policy.to_dict(), "answer": list(t.answer) if t.answer else None,
             "user_start": t.user_start, "switches": [asdict(x) for x in s.switches],
             "turns": [{**asdict(x), "logprobs": []} for x in s.turns]}  # fmt: skip
    caches = [c for n in MODELS for c in prefix_copy(models[n].cache, models[n].held)]
    meta = {"kvlingo_session": json.dumps(state), "model": pair.target.name}
    with atomic_write(path) as tmp:
        save_prompt_cache(str(tmp), caches, meta)
    return path


def load(path: str | Path, s) -> ReaderPolicy:
    """Restore into session `s`, once every check has passed; returns the policy to use."""
    _local(s, "loading")
    path = Path(path)
    if not path.is_file() and path.with_name(path.name + ".safetensors").is_file():
        path = path.with_name(path.name + ".safetensors")
    if not path.is_file():
        raise SessionFileError(f"{path}: no such session file")
    read_header(path, SessionFileError, "session")  # well formed, before mlx reads it
    try:
        caches, meta = load_prompt_cache(str(path), return_metadata=True)
    except Exception as e:  # noqa: BLE001 - mlx raises plain RuntimeError/ValueError
        raise SessionFileError(f"{path}: not a readable prompt cache file ({e})") from None
    raw = meta.get("kvlingo_session") if isinstance(meta, dict) else None
    if raw is None:
        raise SessionFileError(
            f"{path}: an mlx-lm prompt cache without kvlingo session state "
            "(write session files with /save or Session.save)"
        )
    state = parse_json(raw, f"{path}: the kvlingo_session metadata", SessionFileError)
    if (state.get("schema"), state.get("schema_version")) != (SCHEMA, SCHEMA_VERSION):
        raise SessionFileError(
            f"{path}: unsupported session schema {state.get('schema')!r:.80} "
            f"v{state.get('schema_version')!r:.40}"
        )
    try:
        return _restore(path, s, caches, state)
    except SessionFileError:
        raise
    except (KeyError, TypeError, ValueError, AttributeError, IndexError) as e:
        what = f"missing {e}" if isinstance(e, KeyError) else str(e)[:300]
        raise SessionFileError(f"{path}: inconsistent session state: {what}") from None


def _identity(pair: ModelPair) -> dict:
    def side(m):
        return {"name": m.name, "geometry": m.geometry.as_dict(),
                "fingerprint": model_fingerprint(m)}  # fmt: skip

    return {"source": side(pair.source), "target": side(pair.target),
            "tokenizer": pair.tokenizer_fingerprint}  # fmt: skip


def _restore(path: Path, s, caches: list, state: dict) -> ReaderPolicy:
    pair = s.pair

    def need(ok, what: str) -> None:
        if not ok:
            raise SessionFileError(f"{path}: {what}")

    mine = _identity(pair)
    for side in MODELS:
        theirs, ours = state[side], mine[side]
        src, tgt = (str(state[n].get("name"))[:200] for n in MODELS)
        need(all(theirs[k] == ours[k] for k in ("geometry", "fingerprint")),
             f"saved with {side} model {str(theirs.get('name'))[:200]} ({src} -> {tgt}); this "
             f"session's {side} is {ours['name']}: a session file only loads into the pair that "
             "wrote it")  # fmt: skip
    need(not state.get("tokenizer") or state["tokenizer"] == mine["tokenizer"],
         "saved with a different tokenizer")  # fmt: skip
    tokens, messages = state["tokens"], state["messages"]
    vocab = min(int(m.model.model.embed_tokens.weight.shape[0]) for m in (pair.source, pair.target))
    need(isinstance(tokens, list) and all(_is_int(t) and 0 <= t < vocab for t in tokens),
         f"tokens must be a list of token ids below {vocab}")  # fmt: skip
    need(isinstance(messages, list) and all(isinstance(m, dict) and isinstance(m.get("role"), str)
         and isinstance(m.get("content"), str) for m in messages),
         "messages must be role/content objects")  # fmt: skip
    need(messages or not tokens, f"{len(tokens)} tokens but no messages: inconsistent")
    layers = state["layers"]
    need(isinstance(layers, list) and len(layers) == 2 and all(map(_is_int, layers)),
         "layers must be two layer counts")  # fmt: skip
    ls, lt = layers
    want = (pair.source.geometry.layers, pair.target.geometry.layers)
    need((ls, lt) == want and len(caches) == ls + lt, f"holds {len(caches)} cache layers "
         f"(says {ls} + {lt}), expected {want[0]} + {want[1]}")  # fmt: skip
    restored = {}
    for name, part in (("source", caches[:ls]), ("target", caches[ls:])):
        n = state["held"][name]
        need(_is_int(n) and 0 <= n <= len(tokens),
             f"{name} holds {str(n)[:40]} of {len(tokens)} tokens")  # fmt: skip
        _check_cache(need, name, getattr(pair, name).geometry, part, n)
        restored[name] = (part, n)
    answer, user_start, system = (state.get(k) for k in ("answer", "user_start", "system_prompt"))
    need(answer is None or (isinstance(answer, list) and len(answer) == 2 and _is_int(answer[0])
         and 0 <= answer[0] <= len(tokens) and answer[1] in MODELS),
         "answer must be [start token, model]")  # fmt: skip
    need(user_start is None or (_is_int(user_start) and 0 <= user_start <= len(tokens)),
         "user_start must be a token position")  # fmt: skip
    need(system is None or isinstance(system, str), "system_prompt must be a string")
    # the policy whole; older files kept its settings flat, and a setting a file lacks
    # keeps the session's own
    saved = state.get("policy")
    if saved is None:
        saved = {k: state[k] for k in LEGACY_POLICY_KEYS if k in state}
    need(isinstance(saved, dict), "policy must be an object")
    try:
        policy = ReaderPolicy.from_dict(saved, s.policy)  # names and values checked
    except (PolicyError, TypeError) as e:
        raise SessionFileError(f"{path}: {e}") from None
    if policy.reader != "self" and s.forward is None:
        policy = replace(policy, reader="self")  # saved with a translator this pair lacks
    saved_turns = [TurnStats(**{**t, "switch": _switch(t.get("switch")),
                                "ahead": _switch(t.get("ahead")), "read": _read(t.get("read"))})
                   for t in state.get("turns", [])]  # fmt: skip
    s.switches[:] = [Switch(**x) for x in state.get("switches", [])]  # the last that may fail
    s.turns[:] = saved_turns
    t = s
    t.tokens, t.messages = list(tokens), [dict(m) for m in messages]
    t.system_prompt, t.user_start = system, user_start
    t.answer = tuple(answer) if answer else None
    for name, (part, n) in restored.items():
        s.models[name].cache, s.models[name].held = part, n
    return policy


#: reader settings that files before the policy value kept at the top level
LEGACY_POLICY_KEYS = ("reader", "reader_min_tokens", "reader_margin", "large_reads_last",
                      "recompute_share")  # fmt: skip


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _check_cache(need, name: str, g, cache: list, held: int) -> None:
    """Each layer a plain KVCache holding exactly `held` tokens in geometry `g`."""
    for i, c in enumerate(cache):
        need(type(c) is KVCache, f"{name} layer {i} is a {type(c).__name__}, not a KVCache")
        need(c.offset == held, f"{name} cache disagrees with its sync state")
        kv = (("keys", c.keys, g.head_dim), ("values", c.values, g.value_dim)) if held else ()
        for what, a, dim in kv:
            want = (1, g.kv_heads, held, dim)
            shape = tuple(a.shape) if isinstance(a, mx.array) else type(a).__name__
            need(shape == want, f"{name} layer {i} {what} are {shape}, expected {want}")
            floating = mx.issubdtype(a.dtype, mx.floating)
            need(floating, f"{name} layer {i} {what} are {a.dtype}")


def _switch(d: dict | None) -> Switch | None:
    return Switch(**d) if d else None


def _read(d: dict | None) -> Read | None:
    return Read(**{**d, "catch_up": _switch(d.get("catch_up"))}) if d else None
