"""The content benchmark for several translators side by side, in one run: the native and
small-alone answers are computed once and shared, so every translator meets the same tasks.

    python -m weights.experiments.content_side_by_side OUT.json A=FILE B=FILE+question C=FILE+32 ... \\
        [--per-kind 6] [--lengths 128,512,1024] [--seed 0] [--reuse EARLIER.json] [--source DIR]
        [--pair moe]

FILE+N: the chat's own reading (`content.Chat`, through `Session.hand_off`): the target
reads the turn's last N tokens itself, no recompute; FILE+N+rS: and then recomputes the share S
of the translated rest (the chat's rule; the suffix `sf24t` that names it is accepted);
native~REL: the target's own cache with noise of REL times each layer's RMS
(`content.NoisyNative`), a reference; LABEL=source: the source model alone (`content.SourceAlone`; with `--source`, that source's own
row beside a reused "small" row of the demo's small model).

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

import mlx_kvlingo  # noqa: F401  (OpenBLAS before mlx)
from mlx_kvlingo._platform import moe_cpu
from mlx_kvlingo.data.content_tasks import KINDS, build_tasks
from mlx_kvlingo.data.examples import read_texts
from mlx_kvlingo.eval.content import (
    Chat,
    NoisyNative,
    SourceAlone,
    evaluate_content,
    known_replies,
    tables,
    to_json,
)
from mlx_kvlingo.models.demo.pair import demo_content_texts, demo_models, load_demo
from mlx_kvlingo.models.files import load_translator
from mlx_kvlingo.models.pair import load_pair

from rich.console import Console


def condition(spec: str, pair):
    """FILE, FILE+N, FILE+N+rS, native~REL or source (see the module's doc)."""
    if spec == "source":
        return SourceAlone()
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
    methods = {label: condition(spec, pair)
               for label, spec in (t.split("=", 1) for t in a.translators)}  # fmt: skip
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
        scored = evaluate_content(pair, tasks, methods, known=known)
    result = to_json(scored, pair, {"translators": a.translators, "seed": a.seed,
                                    "reused": a.reuse, "pair": a.pair})  # fmt: skip
    with open(a.out, "w") as f:
        json.dump(result, f, indent=1)
    console = Console(width=160)
    for t in tables(result):
        console.print(t)


if __name__ == "__main__":
    main()
