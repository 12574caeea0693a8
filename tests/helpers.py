"""Shared test helpers: exact translators for the known-answer pair."""

from mlx_kvlingo.kv.translator import Side, Translator, TranslatorConfig

import mlx.core as mx
import numpy as np


def exact_translator(pair, answer, key_cut="post_norm", dtype=mx.float32) -> Translator:
    src, tgt = pair.source.geometry, pair.target.geometry
    L = tgt.layers
    rows = tuple((layer,) for layer in range(L))
    config = TranslatorConfig(
        "mixing", Side.of(src), Side.of(tgt), rows, rows, key_cut=key_cut, bias=False
    )
    tr = Translator(config, dtype=dtype)
    tr.key["weight"] = mx.array(np.stack(answer["key_maps"])).astype(dtype)
    tr.value["weight"] = mx.array(np.stack(answer["value_maps"])).astype(dtype)
    return tr


def inverse(answer) -> dict:
    """The known pair's maps are orthogonal: the way back (large -> small) is the transpose."""
    return {
        "key_maps": [k.T for k in answer["key_maps"]],
        "value_maps": [v.T for v in answer["value_maps"]],
    }


def native_tokens(model, tokenizer, tokens, n: int) -> list[int]:
    """What `model` says (greedy, `n` tokens) after reading `tokens` itself: the reference."""
    from mlx_lm import stream_generate

    out = stream_generate(model, tokenizer, mx.array(tokens), max_tokens=n)
    return [r.token for r in out]


def assert_session_consistent(s) -> None:
    """Each model's cache holds exactly the tokens it says it holds, within the conversation."""
    for name in ("source", "target"):
        assert all(c.offset == s.held(name) for c in s.cache(name))
        assert s.held(name) <= len(s.tokens)


def build_module(name: str):
    """A module of the demo's build (`weights/build/`, run from the repo root, not installed),
    e.g. "compose_moe" for `weights.build.compose_moe`."""
    import importlib
    import sys
    from pathlib import Path

    root = str(Path(__file__).resolve().parents[1])
    if root not in sys.path:
        sys.path.insert(0, root)
    return importlib.import_module(f"weights.build.{name}")


def handoff(pair, tr, tokens):
    """The plain hand-off through the conversation's own (`Session.hand_off`): the small model
    reads tokens[:-1], that span is translated, the large model reads only the last token.
    `.target_cache` holds tokens[:-1]; `.source_cache` likewise; `.translated_tokens`."""
    from types import SimpleNamespace

    from mlx_kvlingo.config import ReaderPolicy
    from mlx_kvlingo.conversation.session import Session
    from mlx_kvlingo.conversation.timing import ReadCosts

    plain = ReaderPolicy(reader="small", large_reads_last=1, recompute_share=0.0)
    s = Session(pair, tr, policy=plain, read_costs=ReadCosts())
    s.add_tokens(tokens)
    stats = s.hand_off("target")
    return SimpleNamespace(source_cache=s.cache("source"), target_cache=s.cache("target"),
                           translated_tokens=stats.switch.translated)  # fmt: skip


def _plain_policy():
    from mlx_kvlingo.config import ReaderPolicy

    return ReaderPolicy(large_reads_last=1, recompute_share=0.0)


#: the plain hand-off: the large model reads only the last token, no recompute (what the
#: known-answer and alternation tests check exactly)
PLAIN = _plain_policy()


def plain(**changes):
    """`PLAIN` with `changes` (dataclasses.replace)."""
    from dataclasses import replace

    return replace(PLAIN, **changes)
