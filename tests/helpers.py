"""Shared test helpers: the known-answer pair (a target whose cache layout is a
function-preserving rewrite of its source's) and its exact translators."""

import json
import shutil
from pathlib import Path

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


def translated_spans(s, into: str | None = None) -> list[tuple[str, int, int]]:
    """Every span a session translated so far as (into, start, end), in order."""
    out = [(x.into, x.end - x.translated, x.end) for x in s.switches if x.translated]
    return [t for t in out if into is None or t[0] == into]


def build_module(name: str, folder: str = "build"):
    """A module of the demo's build (`weights/build/`, run from the repo root, not installed),
    e.g. "compose_moe" for `weights.build.compose_moe` (`folder="experiments"`: of
    `weights/experiments/`)."""
    import importlib
    import sys
    from pathlib import Path

    root = str(Path(__file__).resolve().parents[1])
    if root not in sys.path:
        sys.path.insert(0, root)
    return importlib.import_module(f"weights.{folder}.{name}")


def handoff(pair, tr, tokens):
    """The plain hand-off through the conversation's own (`Session.hand_off`): the small model
    reads tokens[:-1], that span is translated, the large model reads only the last token.
    `.target_cache` holds tokens[:-1]; `.source_cache` likewise; `.translated_tokens`."""
    from types import SimpleNamespace

    from mlx_kvlingo.config import ReaderPolicy
    from mlx_kvlingo.conversation.reader import ReadCosts
    from mlx_kvlingo.conversation.session import Session

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


def known_answer_target(
    source_dir: str | Path, out_dir: str | Path, seed: int = 1, permute: bool = True
) -> dict:
    """Rewrite a source model's cache layout without changing what it computes.

    KV heads are permuted together with their query groups and output columns, and each
    head's values are multiplied by a random orthogonal matrix that `o_proj` undoes. The
    exact translator is returned: `key_maps[l]`, `value_maps[l]` as (H*D, H*D) matrices in
    `x @ W` orientation (source features -> target features), with the head permutation.
    """
    source_dir, out_dir = Path(source_dir), Path(out_dir)
    cfg = json.loads((source_dir / "config.json").read_text())
    H = cfg["num_key_value_heads"]
    heads = cfg["num_attention_heads"]
    D = cfg.get("head_dim") or cfg["hidden_size"] // heads
    G = heads // H
    rng = np.random.default_rng(seed)
    weights = {k: np.array(v) for k, v in mx.load(str(source_dir / "model.safetensors")).items()}
    key_maps, value_maps = [], []
    for layer in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{layer}.self_attn."
        perm = rng.permutation(H) if permute else np.arange(H)  # target head h = source perm[h]
        Q = [np.linalg.qr(rng.standard_normal((D, D)))[0].astype(np.float32) for _ in range(H)]
        wk = weights[p + "k_proj.weight"].reshape(H, D, -1)
        wv = weights[p + "v_proj.weight"].reshape(H, D, -1)
        wq = weights[p + "q_proj.weight"].reshape(H, G * D, -1)
        wo = weights[p + "o_proj.weight"].reshape(-1, H, G * D)
        weights[p + "k_proj.weight"] = wk[perm].reshape(H * D, -1)
        weights[p + "v_proj.weight"] = np.stack([Q[h] @ wv[perm[h]] for h in range(H)]).reshape(
            H * D, -1
        )
        weights[p + "q_proj.weight"] = wq[perm].reshape(H * G * D, -1)
        wo = wo[:, perm]  # (out, H, G*D): columns follow the permuted heads
        for h in range(H):  # o_proj sees Q v: undo it with Q^T per query head in the group
            block = wo[:, h].reshape(-1, G, D)
            wo[:, h] = np.einsum("ogd,ed->oge", block, Q[h]).reshape(-1, G * D)
        weights[p + "o_proj.weight"] = wo.reshape(wo.shape[0], -1)
        for b in ("k_proj.bias", "v_proj.bias", "q_proj.bias"):
            if p + b in weights:
                w = weights[p + b]
                if b == "k_proj.bias":
                    weights[p + b] = w.reshape(H, D)[perm].reshape(-1)
                elif b == "v_proj.bias":
                    vb = w.reshape(H, D)
                    weights[p + b] = np.stack([Q[h] @ vb[perm[h]] for h in range(H)]).reshape(-1)
                else:
                    weights[p + b] = w.reshape(H, G * D)[perm].reshape(-1)
        K = np.zeros((H * D, H * D), np.float32)
        V = np.zeros((H * D, H * D), np.float32)
        for h in range(H):
            s = perm[h]
            K[s * D : (s + 1) * D, h * D : (h + 1) * D] = np.eye(D)
            V[s * D : (s + 1) * D, h * D : (h + 1) * D] = Q[h].T  # row-vector form: v' = v Q^T
        key_maps.append(K)
        value_maps.append(V)
    out_dir.mkdir(parents=True, exist_ok=True)
    mx.save_safetensors(
        str(out_dir / "model.safetensors"), {k: mx.array(v) for k, v in weights.items()}
    )
    for f in source_dir.iterdir():
        if f.name != "model.safetensors" and f.is_file():
            shutil.copy(f, out_dir / f.name)
    return {"key_maps": key_maps, "value_maps": value_maps, "permuted": permute}


def with_new_head(
    source_dir: str | Path, out_dir: str | Path, seed: int = 5, scale: float = 0.5
) -> Path:
    """A copy whose output head is perturbed: same KV cache as the source, different predictions.

    Paired with `known_answer_target(source_dir)`, the exact translator still applies, while
    the model alone scores worse than the target: gap recovered is known to be exactly 1.
    """
    source_dir, out_dir = Path(source_dir), Path(out_dir)
    weights = dict(mx.load(str(source_dir / "model.safetensors")))
    head = weights["lm_head.weight"]
    mx.random.seed(seed)
    weights["lm_head.weight"] = head + scale * mx.random.normal(head.shape) * head.std()
    out_dir.mkdir(parents=True, exist_ok=True)
    mx.save_safetensors(str(out_dir / "model.safetensors"), weights)
    for f in source_dir.iterdir():
        if f.name != "model.safetensors" and f.is_file():
            shutil.copy(f, out_dir / f.name)
    return out_dir


def fixed_costs(**rates):
    """Exact read costs no measurement changes (`reader.ReadCosts`, every cost frozen): (a, b) or
    (a, b, c) per name given; the others stay unmeasured, but `target_step` defaults to
    target_read(1)."""
    from mlx_kvlingo.conversation.reader import NAMES, ReadCosts

    out = ReadCosts()
    if "target_read" in rates and "target_step" not in rates:
        a, b, *c = rates["target_read"]
        rates = {**rates, "target_step": (a + b + sum(c) / 2, 0.0)}
    for name in NAMES:
        cost = getattr(out, name)
        if name in rates:
            a, b, c = (*rates[name], 0.0)[:3]
            assert cost.attention or not c, f"{name} has no attention term"
            points = [(1, 0), (1001, 0), (1, 4000)][: 3 if cost.attention else 2]
            cost.samples.extend((n, a + b * n + c * n * (at + n / 2), at) for n, at in points)
        cost.frozen = True
    return out
