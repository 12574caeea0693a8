"""Is a long turn's fact lost to the translated positions around it? Two ways to keep the
large model's reading of the fact off them, against the chat's own reading (`Chat`), on the
fact tasks of `kvlingo eval --task content --seed SEED`:

  clean   the recompute's chosen positions attend only to each other (and position 0), not to
          the translated rest: the fact's deep K/V computed over a sparse but native context
  oracle  the large model reads natively only position 0, the chat's chosen positions and the
          tail, at their true positions, and answers seeing only them (`oracle-fact`: the
          answer's tokens with 20 either side instead of the chosen ones): is the selection
          enough?
  retail  the tail read again after the recompute (`retailclean`: attending only to position 0,
          the chosen positions and itself)
  evictL  the answer's layers >= L attend only to position 0, the recomputed positions and
          the tail (the translated rest is still in the cache; those layers do not see it)

    python -m weights.experiments.sparse_context 4096 [PER_KIND] [SEED] [VARIANTS]

VARIANTS (comma-separated; default `chat,clean,evict8,clean-evict8`). One JSON line per task
and condition, then each condition's retention.
"""

import json
import sys

import mlx_kvlingo.kv.recompute as recompute
from mlx_kvlingo import load
from mlx_kvlingo.cli._common import content_texts
from mlx_kvlingo.eval.content import MAX_TOKENS, Chat, chat_kv, contains, fitting_tasks, native_kv
from mlx_kvlingo.kv.cache import append_kv, new_cache

import mlx.core as mx
from mlx_lm.models.cache import KVCache

_read = recompute.read_positions
LAST: dict = {}


def read_positions(model, cache, tokens, positions, attention=False):
    """The recompute's reading; its second call (the chosen positions) remembered, and under
    `clean` read with each chosen position attending only to chosen positions before it."""
    if attention:
        LAST["tail_from"] = min(positions)
        return _read(model, cache, tokens, positions, attention=True)
    pos = sorted(set(int(p) for p in positions))
    LAST.setdefault("chosen", []).extend(pos)  # the reading recurses a chunk at a time
    if not LAST.get("clean"):
        return _read(model, cache, tokens, pos)
    T = len(tokens)
    keep = mx.zeros((T,), dtype=mx.bool_)
    keep[mx.array(sorted({0, *pos, *LAST.get("keep", ())}))] = True
    p = mx.array(pos)
    mask = ((mx.arange(T)[None] <= p[:, None]) & keep[None])[None, None]
    h = model.model.embed_tokens(mx.array([tokens[i] for i in pos])[None])
    for layer, c in zip(model.model.layers, cache):
        shim = recompute._ScatterCache(c, p, T)
        with recompute._rope_swapped(layer, recompute._RowPositions(layer.self_attn.rope, p, None)):
            h = layer(h, mask, shim)
    mx.eval(h, [(c.keys, c.values) for c in cache])
    return None


recompute.read_positions = read_positions


def frozen_last() -> dict:
    """What the chat's reading recorded, copied (later readings extend `LAST`)."""
    return {"chosen": sorted(set(LAST["chosen"])), "tail_from": LAST["tail_from"]}


class Seen(KVCache):
    """A layer's cache that keeps every position but lets attention see only `visible` ones
    (and every position written after the turn)."""

    def __init__(self, keys, values, visible):
        super().__init__()
        super().update_and_fetch(keys, values)
        self.visible, self.base = visible, keys.shape[2]

    def update_and_fetch(self, keys, values):
        k, v = super().update_and_fetch(keys, values)
        if self.visible is None:
            return k, v
        idx = mx.concatenate([self.visible, mx.arange(self.base, self.offset)])
        return k[..., idx, :], v[..., idx, :]


def answer(loaded, tok, kv, last, visible_from, visible, n, until):
    keys, values = kv
    model, dtype = loaded.model, loaded.dtype
    cache = []
    for i, (k, v) in enumerate(zip(keys, values)):
        seen = visible if i >= visible_from else None
        cache.append(Seen(k.astype(dtype), v.astype(dtype), seen))
    out, y = [], mx.array([[last]])
    eos = set(tok.eos_token_ids)
    for _ in range(n):
        t = mx.argmax(model(y, cache=cache)[:, -1, :], axis=-1).item()
        if t in eos:
            break
        out.append(t)
        if contains(until, tok.decode(out)):
            break
        y = mx.array([[t]])
    return tok.decode(out).strip()


def report(t, v, until, nat_reply, reply, chosen):
    ok_nat, ok = contains(until, nat_reply), contains(until, reply)
    if ok_nat:
        a, b = tally.get((v, t.length), (0, 0))
        tally[(v, t.length)] = (a + ok, b + 1)
    row = {"len": t.length, "v": v, "answer": until, "native": ok_nat, "right": ok,
           "chosen": chosen, "reply": reply[:50]}  # fmt: skip
    print(json.dumps(row), flush=True)


lengths = [int(x) for x in sys.argv[1].split(",")]
per_kind = int(sys.argv[2]) if len(sys.argv) > 2 else 3
seed = int(sys.argv[3]) if len(sys.argv) > 3 else 5
variants = (sys.argv[4] if len(sys.argv) > 4 else "chat,clean,evict8,clean-evict8").split(",")
loaded = load(warmup=False)
pair, tr = loaded.models, loaded.forward
# the draw of `kvlingo eval --task content --kinds fact,copy --lengths 1024,2048,4096`
drawn = sorted({1024, 2048, 4096, *lengths})
tasks = fitting_tasks(pair, content_texts(None), drawn, per_kind, seed=seed, kinds=("fact", "copy"))
tasks = [t for t in tasks if t.length in lengths and t.kind == "fact"]
tally: dict = {}
for t in tasks:
    toks = list(t.tokens)
    nat = native_kv(pair.target, toks[:-1])
    n, until = MAX_TOKENS[t.kind], t.answer
    nat_reply = answer(pair.target, pair.tokenizer, nat, toks[-1], 99, None, n, until)
    built = {}
    for v in variants:
        clean = v.startswith("clean")
        if v.startswith("oracle"):  # the large model reads only the tokens it sees, natively
            if False not in built:
                LAST.clear()
                built[False] = (chat_kv(pair, Chat(tr), t), frozen_last())
            last = dict(built[False][1])
            if v == "oracle-fact":  # the answer's tokens with 20 either side, and the tail
                ans = pair.tokenizer.encode(" " + until, add_special_tokens=False)
                at = [i for i in range(len(toks) - len(ans)) if toks[i : i + len(ans)] == ans]
                last["chosen"] = [q for i in at[:1] for q in range(i - 20, i + len(ans) + 20)]
            seen = sorted({0, *last["chosen"], *range(last["tail_from"], len(toks) - 1)})
            cache = new_cache(pair.target)
            g = pair.target.geometry
            zero = mx.zeros((1, g.kv_heads, len(toks) - 1, g.head_dim), dtype=pair.target.dtype)
            append_kv(cache, [zero] * len(cache), [zero] * len(cache))
            LAST["clean"] = True
            read_positions(pair.target.model, cache, toks[:-1], seen)
            kv = ([c.keys[..., : c.offset, :] for c in cache],
                  [c.values[..., : c.offset, :] for c in cache])  # fmt: skip
            reply = answer(pair.target, pair.tokenizer, kv, toks[-1], 0, mx.array(seen), n, until)
            report(t, v, until, nat_reply, reply, len(seen))
            continue
        if clean not in built:
            LAST.clear()
            LAST["clean"] = clean
            built[clean] = (chat_kv(pair, Chat(tr), t), frozen_last())
        kv, last = built[clean]
        if "retail" in v:  # the tail read again after the recompute, into a copy of the cache
            cache = new_cache(pair.target)
            append_kv(cache, [k for k in kv[0]], [x for x in kv[1]])
            tail = list(range(last["tail_from"], len(toks) - 1))
            LAST["clean"], LAST["keep"] = "retailclean" in v, {0, *last["chosen"]}
            read_positions(pair.target.model, cache, toks[:-1], tail)
            LAST.pop("keep")
            kv = ([c.keys[..., : c.offset, :] for c in cache],
                  [c.values[..., : c.offset, :] for c in cache])  # fmt: skip
        L = int(v.split("evict")[1]) if "evict" in v else 99
        vis = mx.array(sorted({0, *last["chosen"]}) + list(range(last["tail_from"], len(toks) - 1)))
        reply = answer(pair.target, pair.tokenizer, kv, toks[-1], L, vis, n, until)
        ans = pair.tokenizer.encode(" " + until, add_special_tokens=False)
        at = [i for i in range(len(toks) - len(ans)) if toks[i : i + len(ans)] == ans]
        found = bool(at) and set(range(at[0], at[0] + len(ans))) <= set(last["chosen"])
        report(t, v, until, nat_reply, reply, (len(set(last["chosen"])), found))
for (v, n_), (a, b) in sorted(tally.items()):
    print(f"{v} {n_}: {a}/{b}")
