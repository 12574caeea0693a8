"""Does what the small model read reach the large one? Content scored against the native answer.

For every task (`content_tasks`) each condition answers greedily:
  native      the target reading the whole prompt itself (the reference)
  <label>     the target on a cache a method (translator, raw, DroidSpeak, ...) built from the
              source's K/V of prompt[:-1]; it reads only the last prompt token itself
              (`Chat(translator, tail, share)`: the chat's own path, `Session.hand_off`;
              `NoisyNative(rel)`: the native cache with noise of `rel` times each layer's RMS)
  small       the source model alone
Scores, per kind and read length:
  fact, copy     accuracy (the stated value / the sentence appears in the reply) and *retained*
                 = right where the native answer is right / native right
  qa, summary    content-word recall of the native answer, and ROUGE-L F1 against it
The headline per cell is `retained` for fact and copy, `recall` for qa and summary. Teacher-forced
continuation KL is not used here: generic tokens dominate it (see weights/QUALITY.md).
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from mlx_kvlingo.config import ReaderPolicy
from mlx_kvlingo.conversation.session import Session
from mlx_kvlingo.conversation.timing import ReadCosts
from mlx_kvlingo.data.content_tasks import KINDS, ContentTask
from mlx_kvlingo.eval import report
from mlx_kvlingo.kv.cache import new_cache

import mlx.core as mx
from mlx_lm import stream_generate
from rich.progress import Progress
from rich.table import Table

SCHEMA = "mlx-kvlingo/content-eval"
#: greedy tokens each kind may answer with
MAX_TOKENS = {"fact": 20, "copy": 40, "qa": 40, "summary": 40}
EXACT_KINDS = ("fact", "copy")
#: goals for the default translator (issue 26): retained facts/copies by read length, and recall
GOAL_RETAINED_SHORT, GOAL_RETAINED_LONG, LONG_FROM, GOAL_RECALL = 0.8, 0.6, 1024, 0.7

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


# -- answering ---------------------------------------------------------------------------------


def greedy(model, tokenizer, tokens: Sequence[int], cache: list, max_tokens: int,
           until: str = "") -> str:  # fmt: skip
    """mlx-lm's greedy decoding from `cache` after reading `tokens`, stopping at end of turn
    (or once the reply `contains` `until`: a fact or copy task is decided then)."""
    pieces = stream_generate(model, tokenizer, mx.array(list(tokens)), max_tokens=max_tokens,
                             sampler=lambda logits: mx.argmax(logits, axis=-1),
                             prompt_cache=cache)  # fmt: skip
    text = ""
    for r in pieces:
        text += r.text
        if until and contains(until, text):
            break
    return text.strip()


def native_kv(model, tokens: Sequence[int]) -> tuple[list, list]:
    """The model's own cache contents (rotated keys, values) per layer for `tokens`."""
    cache = new_cache(model)
    model.model(mx.array(list(tokens))[None], cache=cache)
    keys = [c.keys[..., : c.offset, :] for c in cache]
    values = [c.values[..., : c.offset, :] for c in cache]
    mx.eval(keys, values)
    return keys, values


def translated_kv(pair, method, tokens: Sequence[int]) -> tuple[list, list]:
    """What `method` builds for the target from the source's K/V of `tokens`."""
    from mlx_kvlingo.eval.methods import capture_span

    cut = getattr(method, "key_cut", None) or method.config.key_cut
    span = capture_span(pair.source, tokens, cut, tuple(getattr(method, "needs_hidden", ())))
    keys, values = method.translate(span, pair.target)
    mx.eval(keys, values)
    return list(keys), list(values)


@dataclass(frozen=True)
class Chat:
    """A condition: the turn as `kvlingo chat` reads it when the small model reads for the
    large one, through the conversation's own hand-off (`Session.hand_off`): `translator`
    translates the turn, the large model reads its last `tail` tokens itself and recomputes
    `share` of the rest (the library's defaults: `ReaderPolicy`)."""

    translator: object
    tail: int = ReaderPolicy().large_reads_last
    share: float = ReaderPolicy().recompute_share


@dataclass(frozen=True)
class NoisyNative:
    """A reference condition: the target's own cache with Gaussian noise added to every K and
    V, `rel` times that layer's RMS (so ||noise|| / ||native|| is about `rel` per token, the
    measure the diagnosis gives translation errors in): how much cache error content survives,
    and how far greedy replies drift from the native ones under a small one."""

    rel: float
    seed: int = 0


@dataclass(frozen=True)
class SourceAlone:
    """A reference condition: the pair's source model answers on its own reading of the prompt
    (the "small" row, under a label of its own, for a source other than the one a reused "small"
    row came from)."""


def noisy_kv(cond: NoisyNative, native: tuple[list, list]) -> tuple[list, list]:
    key = mx.random.key(cond.seed)
    out = []
    for arrays in native:
        noisy = []
        for a in arrays:
            key, sub = mx.random.split(key)
            rms = mx.sqrt(mx.mean(mx.square(a.astype(mx.float32))))
            noise = mx.random.normal(a.shape, key=sub) * (cond.rel * rms)
            noisy.append((a.astype(mx.float32) + noise).astype(a.dtype))
        out.append(noisy)
    mx.eval(out)
    return out[0], out[1]


def chat_kv(pair, cond: Chat, task: ContentTask) -> tuple[list, list]:
    """The large model's cache for prompt[:-1] exactly as the chat builds it: a conversation
    holding the prompt hands off to the large model (small reads, translate, tail, recompute;
    with fresh read rates, so no time budget trims the policy), then the large model reads the
    rest of the prompt but its last token, as mlx-lm's prefill does before the first step."""
    policy = ReaderPolicy(reader="small", large_reads_last=cond.tail, recompute_share=cond.share)
    session = Session(pair, cond.translator, policy=policy, read_costs=ReadCosts())
    session.add_tokens(task.tokens)
    session.hand_off("target")
    cache, held = session.cache("target"), session.held("target")
    rest = list(task.tokens[held:-1])
    if rest:
        pair.target.model(mx.array(rest)[None], cache=cache)
    keys = [c.keys[..., : c.offset, :] for c in cache]
    values = [c.values[..., : c.offset, :] for c in cache]
    mx.eval(keys, values)
    return keys, values


def answers_from(pair, kvs: Sequence[tuple[list, list]], last: int, max_tokens: int,
                 until: str = "") -> list[str]:  # fmt: skip
    """The target's greedy replies on several caches at once (one batch row per (keys,
    values)), each reading `last` itself; a row stops at end of turn or once it contains
    `until`. One batched decode costs about what one row does on a memory-bound backend."""
    dtype, B = pair.target.dtype, len(kvs)
    cache = new_cache(pair.target)
    for i, c in enumerate(cache):
        c.update_and_fetch(mx.concatenate([kv[0][i].astype(dtype) for kv in kvs], axis=0),
                           mx.concatenate([kv[1][i].astype(dtype) for kv in kvs], axis=0))  # fmt: skip
    eos = set(pair.tokenizer.eos_token_ids)
    rows: list[list[int]] = [[] for _ in range(B)]
    live = [True] * B
    y = mx.array([[last]] * B)
    for _ in range(max_tokens):
        logits = pair.target.model(y, cache=cache)[:, -1, :]
        nxt = mx.argmax(logits, axis=-1).tolist()
        for b, t in enumerate(nxt):
            if not live[b]:
                continue
            if t in eos:
                live[b] = False
                continue
            rows[b].append(t)
            if until and contains(until, pair.tokenizer.decode(rows[b])):
                live[b] = False
        if not any(live):
            break
        y = mx.array(nxt)[:, None]
    return [pair.tokenizer.decode(r).strip() for r in rows]


@dataclass
class Swap:
    """Diagnosis: translated cache with these target layers' K/V replaced by native ones."""

    label: str
    method: object
    native_layers: frozenset[int]


def _answers(pair, task: ContentTask, methods: dict, small: bool, swaps: Sequence[Swap],
             known: dict | None = None) -> dict:  # fmt: skip
    """Every condition's reply; the target's conditions decode together in one batch. Replies
    in `known` ({condition: reply}, from an earlier run on the same task) are not recomputed."""
    known = known or {}
    n, until = MAX_TOKENS[task.kind], task.answer
    toks = list(task.tokens)
    need_native = ("native" not in known or bool(swaps)
                   or any(isinstance(m, NoisyNative) for m in methods.values()))  # fmt: skip
    native = native_kv(pair.target, toks[:-1]) if need_native else None
    kvs = {"native": native} if "native" not in known else {}  # its reply, when not known
    cached, alone = {}, [label for label, m in methods.items() if isinstance(m, SourceAlone)]
    for label, m in methods.items():
        if isinstance(m, SourceAlone):
            continue
        if isinstance(m, Chat):
            kvs[label] = chat_kv(pair, m, task)
        elif isinstance(m, NoisyNative):
            kvs[label] = noisy_kv(m, native)
        else:
            kvs[label] = cached[id(m)] = translated_kv(pair, m, toks[:-1])
    for s in swaps:
        if id(s.method) not in cached:
            cached[id(s.method)] = translated_kv(pair, s.method, toks[:-1])
        k, v = cached[id(s.method)]
        kvs[s.label] = ([native[0][i] if i in s.native_layers else k[i] for i in range(len(k))],
                        [native[1][i] if i in s.native_layers else v[i] for i in range(len(v))])  # fmt: skip
    out = dict(known)
    if kvs:  # everything may be known already
        out.update(zip(kvs, answers_from(pair, list(kvs.values()), toks[-1], n, until)))
    for label in [*alone, *(["small"] if small and "small" not in known else [])]:
        out[label] = greedy(pair.source.model, pair.tokenizer, toks, new_cache(pair.source), n,
                            until)  # fmt: skip
    return out


def score(task: ContentTask, native: str, reply: str) -> dict:
    row = {"recall": recall(native, reply), "rouge_l": rouge_l(native, reply)}
    if task.kind in EXACT_KINDS:
        row["correct"] = contains(task.answer, reply)
    return row


# -- the benchmark -----------------------------------------------------------------------------


@dataclass
class ContentResult:
    records: list = field(default_factory=list)  # one per (task, condition)
    conditions: list = field(default_factory=list)

    def cells(self) -> dict:
        """{condition: {kind: {length: summary}}} (see `summarize`)."""
        out: dict = {}
        by_task: dict = {}
        for r in self.records:
            by_task.setdefault(r["task"], {})[r["condition"]] = r
        for c in self.conditions:
            for kind in KINDS:
                for length in sorted({r["length"] for r in self.records}):
                    rows = [t[c] for t in by_task.values()
                            if c in t and t[c]["kind"] == kind and t[c]["length"] == length]  # fmt: skip
                    if rows:
                        native = [by_task[r["task"]]["native"] for r in rows]
                        out.setdefault(c, {}).setdefault(kind, {})[length] = summarize(rows, native)
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


def evaluate_content(pair, tasks: Sequence[ContentTask], methods: dict, small: bool = True,
                     swaps: Sequence[Swap] = (), progress: bool = True,
                     known: Sequence[dict] | None = None) -> ContentResult:  # fmt: skip
    """Every condition's answer to every task, scored against the native answer. `known`:
    per task, {condition: reply} from an earlier run on the same tasks (`known_replies`),
    kept and not recomputed (greedy replies repeat exactly from run to run)."""
    earlier = [c for c in (known[0] if known else {}) if c not in ("native", "small")]
    conditions = ["native", *earlier, *methods, *(s.label for s in swaps)]
    conditions += ["small"] if small or (known and "small" in known[0]) else []
    res = ContentResult(conditions=conditions)
    with Progress(disable=not progress, transient=True) as bar:
        job = bar.add_task("content", total=len(tasks))
        for i, task in enumerate(tasks):
            answers = _answers(pair, task, methods, small, swaps, known[i] if known else None)
            for c, reply in answers.items():
                res.records.append({
                    "task": i, "condition": c, "kind": task.kind, "length": task.length,
                    "tokens": len(task.tokens), "depth": task.depth, "detail": task.detail,
                    "answer": task.answer, "question": task.question, "reply": reply,
                    **score(task, answers["native"], reply),
                })  # fmt: skip
            bar.advance(job)
    return res


def known_replies(result: dict, tasks: Sequence[ContentTask]) -> list[dict]:
    """Per task, {condition: reply} from an earlier run's JSON (`to_json`), checked to be the
    same tasks (kind, length, question, answer); a ValueError where they differ."""
    by_task: dict[int, dict] = {}
    for r in result["records"]:
        by_task.setdefault(r["task"], {})[r["condition"]] = r
    if len(by_task) != len(tasks):
        raise ValueError(f"the earlier run has {len(by_task)} tasks, this one {len(tasks)}")
    out = []
    for i, task in enumerate(tasks):
        rows = by_task[i]
        first = next(iter(rows.values()))
        same = (first["kind"], first["length"], first["question"], first["answer"])
        if same != (task.kind, task.length, task.question, task.answer):
            raise ValueError(f"task {i} differs from the earlier run's: {same[:3]} vs "
                             f"{(task.kind, task.length, task.question)}")  # fmt: skip
        out.append({c: r["reply"] for c, r in rows.items()})
    return out


def goals(cells: dict, label: str = "translated") -> list[dict]:
    """Issue 26's goals for `label`: met or not, with the distance."""
    out = []
    tr, small = cells.get(label, {}), cells.get("small", {})
    for kind, by_len in tr.items():
        for length, s in by_len.items():
            if kind in EXACT_KINDS:
                goal = GOAL_RETAINED_LONG if length >= LONG_FROM else GOAL_RETAINED_SHORT
                what = "retained"
            else:
                goal, what = GOAL_RECALL, "recall"
            out.append({"goal": f"{kind} @{length}: {what} >= {goal}", "value": s["score"],
                        "met": s["score"] >= goal})  # fmt: skip
            sm = small.get(kind, {}).get(length)
            if sm is not None:
                out.append({"goal": f"{kind} @{length}: above small ({sm['score']:.2f})",
                            "value": s["score"], "met": s["score"] > sm["score"]})  # fmt: skip
    return out


def to_json(res: ContentResult, pair, extra: dict | None = None) -> dict:
    cells = res.cells()
    return {"schema": SCHEMA, "pair": {"source": pair.source.name, "target": pair.target.name},
            "conditions": res.conditions, "cells": cells,
            "goals": goals(cells) if "translated" in cells else [],
            "records": res.records, **(extra or {})}  # fmt: skip


def _fmt(x: float) -> str:
    return "n/a" if x != x else f"{x:.2f}"


def tables(result: dict) -> list[Table]:
    """One table per kind: conditions x read lengths, the headline score (accuracy beside it)."""
    out = []
    cells = result["cells"]
    lengths = sorted({int(n) for c in cells.values() for k in c.values() for n in k})
    for kind in KINDS:
        if not any(kind in cells[c] for c in cells):
            continue
        head = "retained (accuracy)" if kind in EXACT_KINDS else "recall (ROUGE-L)"
        t = Table("condition", *[f"{n} tok" for n in lengths], title=f"{kind}: {head}")
        for c in result["conditions"]:
            row = []
            for n in lengths:
                s = cells.get(c, {}).get(kind, {}).get(n) or cells.get(c, {}).get(kind, {}).get(
                    str(n)
                )
                if s is None:
                    row.append("")
                elif kind in EXACT_KINDS:
                    row.append(f"{_fmt(s['retained'])} ({s['accuracy']:.2f}, n={s['n']})")
                else:
                    row.append(f"{_fmt(s['recall'])} ({_fmt(s['rouge_l'])})")
            t.add_row(c, *row)
        out.append(t)
    return out


def plot(result: dict, path: str | Path) -> Path:
    """Headline score per kind against read length, one line per condition (PNG)."""
    plt = report.pyplot()
    cells = result["cells"]
    fig, axes = plt.subplots(1, len(KINDS), figsize=(4 * len(KINDS), 3.4), sharey=True)
    for ax, kind in zip(axes, KINDS):
        for c in result["conditions"]:
            if c == "native" or kind not in cells.get(c, {}):
                continue
            pts = sorted((int(n), s["score"]) for n, s in cells[c][kind].items())
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=c)
        ax.set_xscale("log", base=2)
        ax.set_title(f"{kind} ({'retained' if kind in EXACT_KINDS else 'recall'})")
        ax.set_xlabel("read tokens")
        ax.set_ylim(0, 1.05)
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("vs the native answer")
    axes[-1].legend(fontsize=8)
    fig.suptitle(f"content: {Path(result['pair']['source']).name} -> "
                 f"{Path(result['pair']['target']).name}")  # fmt: skip
    return report.save_figure(fig, path, dpi=110)


def write_json(result: dict, path: str | Path) -> None:
    Path(path).write_text(json.dumps(result, indent=1))
