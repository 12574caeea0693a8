"""Does what the small model read reach the large one? Each condition answers every task
(`content_tasks`) greedily: native (the target reading the prompt itself, the reference), each
<label> (the target on a cache of prompt[:-1] it did not read, then the last token: a `Chat`
hand-off, a `Peer`, a translator or a callable (pair, task, native K/V) -> (keys, values)) and
small (the source alone). Headline per kind and length: fact/copy retained = right where native
is right / native right; qa/summary content-word recall of the native answer (ROUGE-L beside).
"""

from __future__ import annotations

import math
import re
import statistics
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

from mlx_kvlingo.config import ReaderPolicy
from mlx_kvlingo.conversation.reader import ReadCosts
from mlx_kvlingo.conversation.session import READ_CHUNK, Session
from mlx_kvlingo.data.content_tasks import DEFAULT_KINDS, KINDS, ContentTask, build_tasks
from mlx_kvlingo.eval import report
from mlx_kvlingo.kv.cache import new_cache
from mlx_kvlingo.kv.capture import trace
from mlx_kvlingo.kv.sparse_prefill import positions_shifted, speculative_prefill

import mlx.core as mx
from rich.table import Table

SCHEMA = "mlx-kvlingo/content-eval"
#: greedy tokens each kind may answer with
MAX_TOKENS = {"fact": 20, "facts": 20, "copy": 40, "qa": 40, "summary": 40}
EXACT_KINDS = ("fact", "facts", "copy")

_NON_WORD = re.compile(r"[^a-z0-9]+")
STOPWORDS = frozenset(
    "a an and are as at be been but by can could did do does for from had has have he her his "
    "how i if in into is it its me my no not of on or our she so than that the their them then "
    "there these they this those to too us was we were what when where which who why will with "
    "would you your yes also just about some any all more most other such only own same very "
    "here text above sure sorry".split()
)


def normalize(s: str) -> str:
    return " ".join(_NON_WORD.sub(" ", s.lower()).split())


def contains(answer: str, reply: str) -> bool:
    """The answer's words appear in the reply, in order and adjacent (case and punctuation free)."""
    a = normalize(answer)
    return bool(a) and f" {a} " in f" {normalize(reply)} "


def content_words(s: str) -> list[str]:
    return [w for w in normalize(s).split() if w not in STOPWORDS and len(w) > 2]


def recall(reference: str, candidate: str) -> float:
    """Share of the reference's distinct content words found in the candidate (NaN: none)."""
    ref = set(content_words(reference))
    return len(ref & set(content_words(candidate))) / len(ref) if ref else float("nan")


def rouge_l(reference: str, candidate: str) -> float:
    """ROUGE-L F1 over normalized words (longest common subsequence)."""
    r, c = normalize(reference).split(), normalize(candidate).split()
    if not r or not c:
        return float(r == c)
    prev = [0] * (len(c) + 1)
    for x in r:
        cur = [0]
        for j, y in enumerate(c):
            cur.append(prev[j] + 1 if x == y else max(prev[j + 1], cur[j]))
        prev = cur
    lcs = prev[-1]
    if lcs == 0:
        return 0.0
    p, q = lcs / len(c), lcs / len(r)
    return 2 * p * q / (p + q)


def fitting_tasks(pair, texts: Sequence[str], lengths: Sequence[int], per_kind: int,
                  seed: int = 0, kinds: Sequence[str] = DEFAULT_KINDS) -> list[ContentTask]:  # fmt: skip
    """`build_tasks` whose prompts leave room for the longest answer in the pair's context: a
    length that overruns it is built shorter by the overrun and keeps the label asked for."""
    limit = min(m.context_length or 10**9 for m in (pair.source, pair.target))
    room = limit - max(MAX_TOKENS.values())
    asked = sorted(set(lengths))
    if asked[-1] > limit:
        raise ValueError(f"read lengths go up to the pair's context, {limit} tokens")
    built = [min(n, room - 32) for n in asked]
    if len(set(built)) < len(built):
        raise ValueError(f"read lengths within 32 tokens of the room for an answer in the "
                         f"context ({room}) are one length: give one of them")  # fmt: skip
    for _ in range(5):
        tasks = build_tasks(pair.tokenizer, texts, built, per_kind, kinds, seed=seed)
        over = {b: max([len(t.tokens) - room for t in tasks if t.length == b]) for b in built}
        if max(over.values()) <= 0:
            label = dict(zip(built, asked))
            return [replace(t, length=label[t.length]) for t in tasks]
        built = [b - over[b] - 8 if over[b] > 0 else b for b in built]
    raise ValueError(f"no prompts of these lengths fit the pair's {limit}-token context with "
                     f"room for an answer")  # fmt: skip


def cache_kv(cache: list) -> tuple[list, list]:
    """What `cache` holds, per layer: (keys, values) up to its offset, evaluated."""
    keys = [c.keys[..., : c.offset, :] for c in cache]
    values = [c.values[..., : c.offset, :] for c in cache]
    mx.eval(keys, values)
    return keys, values


def read(model, tokens: Sequence[int]) -> list:
    """A new cache of `model` that read `tokens` itself, in the chat's chunks (`READ_CHUNK`)."""
    cache, x = new_cache(model), mx.array(list(tokens))
    for s in range(0, x.size, READ_CHUNK):
        model.model(x[s : s + READ_CHUNK][None], cache=cache)
        mx.eval([c.state for c in cache])
        mx.clear_cache()
    return cache


def native_kv(model, tokens: Sequence[int]) -> tuple[list, list]:
    """The model's own cache contents (rotated keys, values) per layer for `tokens`."""
    return cache_kv(read(model, tokens))


def translated_kv(pair, translator, tokens: Sequence[int]) -> tuple[list, list]:
    """What `translator` builds for the target from the source's K/V of `tokens`."""
    span = trace(pair.source, tokens, translator.config.key_cut)
    keys, values = translator.translate(span, pair.target)
    mx.eval(keys, values)
    return list(keys), list(values)


@dataclass(frozen=True)
class Chat:
    """A condition: the turn as `kvlingo chat` reads it when the small model reads for the large
    one (`Session.hand_off`): the large model reads the last `tail` tokens, recomputes `share`."""

    translator: object
    tail: int = ReaderPolicy().large_reads_last
    share: float = ReaderPolicy().recompute_share

    def hand_off(self, pair, tokens: Sequence[int]) -> tuple[Session, object]:
        """A session holding `tokens` after the chat's hand-off to the large model (fresh read
        rates); the hand-off's stats."""
        policy = ReaderPolicy(
            reader="small", large_reads_last=self.tail, recompute_share=self.share
        )
        session = Session(pair, self.translator, policy=policy, read_costs=ReadCosts())
        session.add_tokens(tokens)
        return session, session.hand_off("target")


def chat_kv(pair, cond: Chat, task: ContentTask) -> tuple[list, list]:
    """The large model's cache for prompt[:-1] as the chat builds it: the hand-off, then the
    rest of the prompt but its last token."""
    session, _ = cond.hand_off(pair, task.tokens)
    cache, held = session.cache("target"), session.held("target")
    rest = list(task.tokens[held:-1])
    if rest:
        pair.target.model(mx.array(rest)[None], cache=cache)
    return cache_kv(cache)


@dataclass(frozen=True)
class Peer:
    """A condition: speculative prefill (kv/sparse_prefill.py) keeping the `keep` share of the
    prompt, the look-ahead sampled with `seed`."""

    keep: float
    seed: int = 0


def condition_kv(pair, cond, task: ContentTask, native: tuple[list, list]) -> tuple[list, list]:
    """The target's cache for prompt[:-1] under `cond` (see the module's doc)."""
    if isinstance(cond, Chat):
        return chat_kv(pair, cond, task)
    if isinstance(cond, Peer):  # the kept tokens of prompt[:-1] only
        mx.random.seed(cond.seed)
        return cache_kv(speculative_prefill(pair, list(task.tokens), cond.keep)[0])
    if hasattr(cond, "translate"):
        return translated_kv(pair, cond, task.tokens[:-1])
    return cond(pair, task, native)


def answers_from(model, tokenizer, kvs: Sequence[tuple[list, list]], last: int, max_tokens: int,
                 until: str = "") -> list[str]:  # fmt: skip
    """`model`'s greedy replies on several caches at once (a batch row per (keys, values)), each
    reading `last` itself; a row stops at end of turn or once it contains `until`."""
    dtype, B = model.dtype, len(kvs)
    cache = new_cache(model)
    for i, c in enumerate(cache):
        c.update_and_fetch(mx.concatenate([kv[0][i].astype(dtype) for kv in kvs], axis=0),
                           mx.concatenate([kv[1][i].astype(dtype) for kv in kvs], axis=0))  # fmt: skip
    eos = set(tokenizer.eos_token_ids)
    rows: list[list[int]] = [[] for _ in range(B)]
    live = [True] * B
    y = mx.array([[last]] * B)
    for _ in range(max_tokens):
        nxt = mx.argmax(model.model(y, cache=cache)[:, -1, :], axis=-1).tolist()
        for b, t in enumerate(nxt):
            if live[b] and t in eos:
                live[b] = False
            elif live[b]:
                rows[b].append(t)
                live[b] = not (until and contains(until, tokenizer.decode(rows[b])))
        if not any(live):
            break
        y = mx.array(nxt)[:, None]
    return [tokenizer.decode(r).strip() for r in rows]


def _answers(pair, task: ContentTask, conditions: dict, small: bool,
             only_native_right: bool = False) -> tuple[dict, dict]:  # fmt: skip
    """Every condition's reply and its seconds to read the prompt; one batched decode. With
    `only_native_right`, a task the native read gets wrong ends there (its native reply only)."""
    n, until, toks = MAX_TOKENS[task.kind], task.answer, list(task.tokens)
    t0 = time.perf_counter()
    native = native_kv(pair.target, toks[:-1])
    kvs, seconds = {"native": native}, {"native": time.perf_counter() - t0}
    if only_native_right:
        (reply,) = answers_from(pair.target, pair.tokenizer, [native], toks[-1], n, until)
        if not score(task, reply, reply).get("correct", True):
            return {"native": reply}, seconds
    for label, c in conditions.items():
        t0 = time.perf_counter()
        kvs[label] = condition_kv(pair, c, task, native)
        seconds[label] = time.perf_counter() - t0
    full = {c: kv for c, kv in kvs.items() if kv[0][0].shape[2] == len(toks) - 1}
    out = dict(zip(full, answers_from(pair.target, pair.tokenizer, list(full.values()), toks[-1],
                                      n, until)))  # fmt: skip
    for c, kv in kvs.items():  # a sparse read (a Peer's): positions go on after the whole prompt
        if c not in full:
            with positions_shifted(pair.target, len(toks) - 1 - kv[0][0].shape[2]):
                (out[c],) = answers_from(pair.target, pair.tokenizer, [kv], toks[-1], n, until)
    out = {c: out[c] for c in kvs}
    if small:
        alone = native_kv(pair.source, toks[:-1])
        (out["small"],) = answers_from(pair.source, pair.tokenizer, [alone], toks[-1], n, until)
    return out, seconds


def score(task: ContentTask, native: str, reply: str) -> dict:
    row = {"recall": recall(native, reply), "rouge_l": rouge_l(native, reply)}
    if task.kind in EXACT_KINDS:
        row["correct"] = contains(task.answer, reply)
    return row


@dataclass
class ContentResult:
    records: list = field(default_factory=list)  # one per (task, condition)
    conditions: list = field(default_factory=list)

    def cells(self) -> dict:
        """{condition: {kind: {length: summary}}} (see `summarize`), in the order of the
        conditions, the kinds and the lengths."""
        native = {r["task"]: r for r in self.records if r["condition"] == "native"}
        groups: dict = {}
        for r in self.records:
            groups.setdefault((r["condition"], r["kind"], r["length"]), []).append(r)
        order = lambda k: (self.conditions.index(k[0]), KINDS.index(k[1]), k[2])  # noqa: E731
        out: dict = {}
        for c, kind, length in sorted(groups, key=order):
            rows = groups[c, kind, length]
            cell = summarize(rows, [native[r["task"]] for r in rows])
            out.setdefault(c, {}).setdefault(kind, {})[length] = cell
        return out


def _mean(xs: Iterable[float]) -> float:
    xs = [x for x in xs if not math.isnan(x)]
    return sum(xs) / len(xs) if xs else float("nan")


def summarize(rows: list, native: list) -> dict:
    s = {"n": len(rows), "recall": _mean(r["recall"] for r in rows),
         "rouge_l": _mean(r["rouge_l"] for r in rows)}  # fmt: skip
    if "correct" in rows[0]:
        right = [n["correct"] for n in native]
        s["accuracy"] = sum(r["correct"] for r in rows) / len(rows)
        s["native_right"] = sum(right)
        both = sum(r["correct"] and ok for r, ok in zip(rows, right))
        s["retained"] = both / sum(right) if sum(right) else float("nan")
        s["score"] = s["retained"]
    else:
        s["score"] = s["recall"]
    return s


def evaluate_content(pair, tasks: Sequence[ContentTask], conditions: dict, small: bool = True,
                     progress=None, only_native_right: bool = False) -> ContentResult:  # fmt: skip
    """Every condition's answer to every task, native first and the source alone last
    (`small`), scored against native; `progress(done, total)` after each task; with
    `only_native_right`, the others answer only where native was right (what retention counts)."""
    res = ContentResult(conditions=["native", *conditions, *(["small"] if small else [])])
    for i, task in enumerate(tasks):
        answers, seconds = _answers(pair, task, conditions, small, only_native_right)
        for c, reply in answers.items():
            res.records.append({
                "task": i, "condition": c, "kind": task.kind, "length": task.length,
                "tokens": len(task.tokens), "depth": task.depth, "detail": task.detail,
                "answer": task.answer, "question": task.question, "reply": reply,
                "read_s": seconds.get(c), **score(task, answers["native"], reply),
            })  # fmt: skip
        if progress:
            progress(i + 1, len(tasks))
    return res


def to_json(res: ContentResult, pair, extra: dict | None = None) -> dict:
    return {"schema": SCHEMA, "pair": {"source": pair.source.name, "target": pair.target.name},
            "conditions": res.conditions, "cells": res.cells(), "records": res.records,
            **(extra or {})}  # fmt: skip


def retention(result: dict, condition: str = "chat") -> list[tuple[int, int, int]]:
    """(read length, kept, right) of `condition` per length, facts and copies pooled: right =
    native right, kept = `condition` right too (conversation/reader.py weighs them)."""
    native = {r["task"]: r for r in result["records"] if r["condition"] == "native"}
    right: dict = {}  # read length -> whether `condition` was right too, per native-right task
    for r in result["records"]:
        nat = native.get(r["task"])
        if r["condition"] == condition and nat and nat["kind"] in EXACT_KINDS and nat["correct"]:
            right.setdefault(nat["length"], []).append(bool(r["correct"]))
    return [(n, sum(kept), len(kept)) for n, kept in sorted(right.items())]


def read_times(result: dict) -> dict:
    """{condition: {length: median seconds to read the prompt}} (conditions with a read)."""
    out: dict = {}
    for r in result["records"]:
        if r.get("read_s") is not None:
            out.setdefault(r["condition"], {}).setdefault(r["length"], []).append(r["read_s"])
    return {c: {n: statistics.median(v) for n, v in sorted(by.items())} for c, by in out.items()}


def tables(result: dict) -> list[Table]:
    """One table per kind: conditions x read lengths, the headline score (accuracy beside it)."""
    out = []
    # read lengths as numbers (they are the keys of a JSON object in a result read back)
    cells = {c: {k: {int(n): s for n, s in by.items()} for k, by in ks.items()}
             for c, ks in result["cells"].items()}  # fmt: skip
    lengths = sorted({n for c in cells.values() for k in c.values() for n in k})
    for kind in KINDS:
        if not any(kind in cells[c] for c in cells):
            continue
        head = "retained (accuracy)" if kind in EXACT_KINDS else "recall (ROUGE-L)"
        t = Table("condition", *[f"{n} tok" for n in lengths], title=f"{kind}: {head}")
        for c in result["conditions"]:
            row = []
            for n in lengths:
                s = cells.get(c, {}).get(kind, {}).get(n)
                if s is None:
                    row.append("")
                elif kind in EXACT_KINDS:
                    retained = report.number(s["retained"], none="n/a")
                    row.append(f"{retained} ({s['accuracy']:.2f}, n={s['n']})")
                else:
                    recall, rouge = (report.number(s[k], none="n/a") for k in ("recall", "rouge_l"))
                    row.append(f"{recall} ({rouge})")
            t.add_row(c, *row)
        out.append(t)
    times = read_times(result)
    if times:
        t = Table("condition", *[f"{n} tok" for n in lengths],
                  title="reading the prompt: median seconds (x the native read)")  # fmt: skip
        for c, by in times.items():
            base = times.get("native", {})
            t.add_row(c, *[f"{by[n]:.2f} ({by[n] / base[n]:.2f}x)" if n in by and base.get(n)
                           else "" for n in lengths])  # fmt: skip
        out.append(t)
    return out


def plot(result: dict, path: str | Path) -> Path:
    """Headline score per kind against read length, one line per condition (PNG)."""
    plt = report.pyplot()
    cells = result["cells"]
    kinds = [k for k in KINDS if any(k in by for by in cells.values())]
    fig, (axes,) = plt.subplots(1, len(kinds), figsize=(4 * len(kinds), 3.4), sharey=True,
                                squeeze=False)  # fmt: skip
    for ax, kind in zip(axes, kinds):
        for c in result["conditions"]:
            if c == "native" or kind not in cells.get(c, {}):
                continue
            pts = sorted((int(n), s["score"]) for n, s in cells[c][kind].items())
            ax.plot(*zip(*pts), marker="o", label=c)
        ax.set_xscale("log", base=2)
        head = "retained" if kind in EXACT_KINDS else "recall"
        ax.set(title=f"{kind} ({head})", xlabel="read tokens", ylim=(0, 1.05))
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("vs the native answer")
    axes[-1].legend(fontsize=8)
    fig.suptitle(f"content: {Path(result['pair']['source']).name} -> "
                 f"{Path(result['pair']['target']).name}")  # fmt: skip
    return report.save_figure(fig, path, dpi=110)
