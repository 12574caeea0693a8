"""Session files: both caches, the conversation and the sync state in one mlx-lm prompt cache.

The file is what `mlx_lm.models.cache.save_prompt_cache` writes (the source's layers, then
the target's); metadata `kvlingo_session` holds the rest as JSON. A file loads only into the
pair that wrote it (geometry and a weight fingerprint per model). Mixed into `Session`."""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict
from pathlib import Path

import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten
from mlx_lm.models.cache import load_prompt_cache, save_prompt_cache

from .._atomic import atomic_write
from ..kvcache import prefix_copy
from ..pair import LoadedModel
from .catchup import _Model
from .records import Read, SessionFileError, Switch, TurnStats

MODELS = ("source", "target")
SESSION_SCHEMA = "mlx-kvlingo/session"
SESSION_SCHEMA_VERSION = 1


def model_fingerprint(loaded: LoadedModel) -> str:
    """Identify a model's weights across dtypes: signs of the clearly non-zero entries of its
    embedding and K/V projections (dtype casts and 4-bit rounding keep those signs)."""
    h = hashlib.sha256(json.dumps(loaded.geometry.as_dict(), sort_keys=True).encode())
    for name, w in sorted(tree_flatten(loaded.model.parameters())):
        if not any(s in name for s in ("embed_tokens", "k_proj", "v_proj")):
            continue
        if not mx.issubdtype(w.dtype, mx.floating):
            continue
        x = np.array(w.reshape(-1)[:256].astype(mx.float32))
        big = np.abs(x) > 0.5 * (x.std() + 1e-12)
        h.update(name.encode())
        h.update(np.packbits(big).tobytes() + np.packbits((x > 0) & big).tobytes())
    return h.hexdigest()[:16]


class Persistence:
    """`save` and `load` (state lives on `Session`)."""

    def _identity(self) -> dict:
        def side(loaded):
            return {
                "name": loaded.name,
                "geometry": loaded.geometry.as_dict(),
                "fingerprint": model_fingerprint(loaded),
            }

        return {
            "source": side(self.pair.source),
            "target": side(self.pair.target),
            "tokenizer": self.pair.tokenizer_fingerprint,
        }

    def save(self, path: str | Path) -> Path:
        """Write both caches, the conversation and the sync state to one prompt cache file.

        The file is an mlx-lm prompt cache (`mlx_lm.models.cache.load_prompt_cache` reads it):
        the source's layers, then the target's; metadata `kvlingo_session` holds the rest.
        A `.safetensors` suffix is added when missing.
        """
        self._claim()
        path = Path(path)
        if path.suffix != ".safetensors":
            path = path.with_name(path.name + ".safetensors")
        state = {
            "schema": SESSION_SCHEMA,
            "schema_version": SESSION_SCHEMA_VERSION,
            **self._identity(),
            "layers": [self.pair.source.geometry.layers, self.pair.target.geometry.layers],
            "held": {n: m.held for n, m in self._models.items()},
            "tokens": self.tokens,
            "messages": self.messages,
            "system_prompt": self.system_prompt,
            "mode": self.mode,
            "reader": self.reader,
            "answer": list(self._answer) if self._answer else None,
            "user_start": self._user_start,
            "switches": [asdict(s) for s in self.switches],
            "turns": [{**asdict(t), "logprobs": []} for t in self.turns],
        }
        caches = []
        for name in MODELS:
            m = self._models[name]
            caches += prefix_copy(m.cache, m.held)
        meta = {"kvlingo_session": json.dumps(state), "model": self.pair.target.name}
        with atomic_write(path) as tmp:
            save_prompt_cache(str(tmp), caches, meta)
        return path

    def load(self, path: str | Path) -> None:
        """Restore a session saved by `save` for this same pair (refuses any other pair)."""
        self._claim()
        path = Path(path)
        if not path.is_file() and path.with_name(path.name + ".safetensors").is_file():
            path = path.with_name(path.name + ".safetensors")
        if not path.is_file():
            raise SessionFileError(f"{path}: no such session file")
        try:
            caches, meta = load_prompt_cache(str(path), return_metadata=True)
        except Exception as e:  # noqa: BLE001 - mlx raises plain RuntimeError/ValueError
            raise SessionFileError(f"{path}: not a readable prompt cache file ({e})") from None
        raw = meta.get("kvlingo_session")
        if raw is None:
            raise SessionFileError(
                f"{path}: an mlx-lm prompt cache without kvlingo session state "
                "(write session files with /save or Session.save)"
            )
        state = json.loads(raw)
        if state.get("schema") != SESSION_SCHEMA or state.get("schema_version") != (
            SESSION_SCHEMA_VERSION
        ):
            raise SessionFileError(
                f"{path}: unsupported session schema {state.get('schema')!r} "
                f"v{state.get('schema_version')!r}"
            )
        mine = self._identity()
        for side in MODELS:
            theirs = state[side]
            ours = mine[side]
            if (
                theirs["geometry"] != ours["geometry"]
                or theirs["fingerprint"] != (ours["fingerprint"])
            ):
                raise SessionFileError(
                    f"{path}: saved with {side} model {theirs['name']} "
                    f"({state['source']['name']} -> {state['target']['name']}); this session's "
                    f"{side} is {ours['name']}: a session file only loads into the pair that "
                    "wrote it"
                )
        if state.get("tokenizer") and state["tokenizer"] != mine["tokenizer"]:
            raise SessionFileError(f"{path}: saved with a different tokenizer")
        ls, lt = state["layers"]
        if len(caches) != ls + lt:
            raise SessionFileError(f"{path}: holds {len(caches)} cache layers, expected {ls + lt}")
        models = {
            "source": _Model("source", self.pair.source, caches[:ls], state["held"]["source"]),
            "target": _Model("target", self.pair.target, caches[ls:], state["held"]["target"]),
        }
        for m in models.values():
            if any(c.offset != m.held for c in m.cache) or m.held > len(state["tokens"]):
                raise SessionFileError(f"{path}: {m.name} cache disagrees with its sync state")
        self._models = models
        self.tokens = list(state["tokens"])
        self.messages = list(state["messages"])
        self.system_prompt = state.get("system_prompt")
        self._answer = tuple(state["answer"]) if state.get("answer") else None
        self._user_start = state.get("user_start")
        self.switches = [Switch(**s) for s in state.get("switches", [])]
        if state.get("reader") in ("small", "self") and (state["reader"] == "self" or self.forward):
            self.reader = state["reader"]
        self.turns = [
            TurnStats(**{**t, "switch": _switch(t.get("switch")), "read": _read(t.get("read"))})
            for t in state.get("turns", [])
        ]


def _switch(d: dict | None) -> Switch | None:
    return Switch(**d) if d else None


def _read(d: dict | None) -> Read | None:
    return Read(**{**d, "catch_up": _switch(d.get("catch_up"))}) if d else None
