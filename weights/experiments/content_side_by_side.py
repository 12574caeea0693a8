"""The content benchmark for several translators side by side, in one run: the native and
small-alone answers are computed once and shared, so every translator meets the same tasks.

    python -m weights.experiments.content_side_by_side OUT.json A=FILE B=FILE+question C=FILE+32 ... \\
        [--per-kind 6] [--lengths 128,512,1024] [--seed 0] [--reuse EARLIER.json] [--source DIR]
        [--pair moe]

FILE+N: the chat's own reading (`content.Chat`, through `Session.hand_off`): the target
reads the turn's last N tokens itself, no recompute; FILE+N+rS: and then recomputes the share S
of the translated rest (the chat's rule; the suffix `sf24t` that names it is accepted);
native~REL: the target's own cache with noise of REL times each layer's RMS (`NoisyNative`), a
reference; LABEL=source: the source model alone (with `--source`, that source's own row beside a
reused "small" row of the demo's small model).

The tasks are `kvlingo eval --task content`'s (the demo's held-out documentation pages; seed 0
is the draw QUALITY.md's tables use, other seeds draw new tasks); OUT.json keeps every reply.
`--reuse` keeps the replies of an earlier run on the same tasks (native, small alone, its
translators) and computes only the translators named here; a `kvlingo eval --task content
--json` file on the same draw works too. One table per task kind is printed. `--pair moe` runs
the MoE demo pair, its prefills through `moe_cpu.per_expert_loop` on the CPU.
"""

from __future__ import annotations

import argparse
import json
import re
from collections.abc import Sequence
from dataclasses import dataclass

import mlx_kvlingo  # noqa: F401  (OpenBLAS before mlx)
from mlx_kvlingo._platform import moe_cpu
from mlx_kvlingo.data.content_tasks import KINDS, ContentTask, build_tasks
from mlx_kvlingo.data.examples import read_texts
from mlx_kvlingo.eval.content import Chat, ContentResult, evaluate_content, score, tables, to_json
from mlx_kvlingo.models.demo.pair import demo_content_texts, demo_models, load_demo
from mlx_kvlingo.models.files import load_translator
from mlx_kvlingo.models.pair import load_pair

import mlx.core as mx
from rich.console import Console


@dataclass(frozen=True)
class NoisyNative:
    """A reference condition: the target's own cache with Gaussian noise added to every K and
    V, `rel` times that layer's RMS (so ||noise|| / ||native|| is about `rel` per token, the
    measure the diagnosis gives translation errors in): how much cache error content survives,
    and how far greedy replies drift from the native ones under a small one."""

    rel: float
    seed: int = 0

    def __call__(self, pair, task, native):
        key = mx.random.key(self.seed)
        out = []
        for arrays in native:
            noisy = []
            for a in arrays:
                key, sub = mx.random.split(key)
                rms = mx.sqrt(mx.mean(mx.square(a.astype(mx.float32))))
                noise = mx.random.normal(a.shape, key=sub) * (self.rel * rms)
                noisy.append((a.astype(mx.float32) + noise).astype(a.dtype))
            out.append(noisy)
        mx.eval(out)
        return out[0], out[1]


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


def side_by_side(pair, tasks, specs: dict, known: list[dict] | None = None) -> ContentResult:
    """The content benchmark with a condition per {label: spec} (see `condition`), the source
    alone under each label whose spec is "source", and, from `known` (`known_replies`), the
    earlier run's other conditions and its "small" row (their replies kept, scored against
    this run's native replies, which greedy decoding repeats)."""
    conditions = {label: condition(s, pair) for label, s in specs.items() if s != "source"}
    alone = [label for label, s in specs.items() if s == "source"]
    earlier = [c for c in (known[0] if known else {}) if c not in ("native", "small", *specs)]
    keep_small = bool(known) and "small" in known[0]
    res = evaluate_content(pair, tasks, conditions, small=bool(alone) or not keep_small)
    out = ContentResult(conditions=["native", *earlier, *specs, "small"])
    for r in res.records:
        out.records += [{**r, "condition": label} for label in alone if r["condition"] == "small"]
        if not (r["condition"] == "small" and keep_small):
            out.records.append(r)
    native = {r["task"]: r for r in res.records if r["condition"] == "native"}
    for i, task in enumerate(tasks):
        for c in [*earlier, *(["small"] if keep_small else [])]:
            reply = known[i][c]
            out.records.append({**native[i], "condition": c, "reply": reply,
                                **score(task, native[i]["reply"], reply)})  # fmt: skip
    return out


def condition(spec: str, pair):
    """FILE, FILE+N, FILE+N+rS or native~REL (see the module's doc)."""
    if spec.startswith("native~"):
        return NoisyNative(float(spec.removeprefix("native~")))
    m = re.fullmatch(r"(.+)\+(\d+)(?:\+r([0-9.]+)(?:sf24t)?)?", spec)
    if m is None:
        return load_translator(spec, pair)
    return Chat(load_translator(m[1], pair), int(m[2]), float(m[3] or 0.0))


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out", help="JSON file to write")
    ap.add_argument("translators", nargs="+", metavar="LABEL=FILE")
    ap.add_argument("--per-kind", type=int, default=6)
    ap.add_argument("--lengths", default="128,512,1024")
    ap.add_argument("--seed", type=int, default=0, help="which tasks are drawn")
    ap.add_argument("--reuse", help="an earlier OUT.json on the same tasks")
    ap.add_argument("--source", help="another source model for the demo target (its translators "
                    "only; a reused 'small' row stays the demo's small model)")  # fmt: skip
    ap.add_argument("--pair", choices=("dense", "moe"), default="dense", help="the demo pair")
    ap.add_argument("--kinds", default=",".join(KINDS), help="task kinds to run (all)")
    a = ap.parse_args(argv)
    if a.source and a.pair != "dense":
        ap.error("--source replaces the dense demo pair's small model only")
    if any("=" not in t for t in a.translators):
        ap.error("each translator is LABEL=FILE")
    pair = load_pair(a.source, demo_models()[1]) if a.source else load_demo(pair=a.pair)[0]
    specs = dict(t.split("=", 1) for t in a.translators)
    lengths = [int(x) for x in a.lengths.split(",")]
    texts = [t for path in demo_content_texts() for t in read_texts(path)]
    tasks = build_tasks(pair.tokenizer, texts, lengths, a.per_kind, seed=a.seed)
    known = None
    if a.reuse:
        with open(a.reuse) as f:
            earlier = json.load(f)
    keep = [i for i, t in enumerate(tasks) if t.kind in a.kinds.split(",")]
    if a.reuse and len({r["task"] for r in earlier["records"]}) == len(keep):
        tasks = [tasks[i] for i in keep]  # an earlier run of these kinds only
    if a.reuse:
        known = known_replies(earlier, tasks)
    if len(tasks) != len(keep):
        tasks = [tasks[i] for i in keep]
        known = None if known is None else [known[i] for i in keep]
    with moe_cpu.per_expert_loop(a.pair == "moe"):
        scored = side_by_side(pair, tasks, specs, known)
    result = to_json(scored, pair, {"translators": a.translators, "seed": a.seed,
                                    "reused": a.reuse, "pair": a.pair})  # fmt: skip
    with open(a.out, "w") as f:
        json.dump(result, f, indent=1)
    console = Console(width=160)
    for t in tables(result):
        console.print(t)


if __name__ == "__main__":
    main()
