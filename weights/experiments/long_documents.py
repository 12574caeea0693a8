"""Facts kept from long documents, path by path, until each length has enough native-right items.

    python -m weights.experiments.long_documents OUT.jsonl [--lengths 1024,2048,4096]
        [--kinds fact,facts] [--right 20] [--seed 100] [--pair dense] [--keep 0.3]
        [--shares 0.2] [--no-chat] [--limit-s SECONDS]

Each step draws one task of each kind at one length (`fitting_tasks`, the demo's held-out
documentation pages, seed `--seed` + step) and answers it greedily under every condition of
`kvlingo eval --task content` side by side: the large model's own read ("native"), the chat's
reading through the product's hand-off ("chat": `content.Chat`, the shipped translator and
`ReaderPolicy`'s defaults; "chat rS": recompute share S), and speculative prefill keeping
`--keep` ("specprefill K"); with `--target-peaks`, also the chat with the large model's
attention alone choosing what it recomputes ("chat target-peaks"); `--no-chat` drops the
chat's default reading (its records from an earlier run on the same seeds stand in). The
"reread 0.2" records (`runs/long_documents_reread_*.jsonl`) came from commit `1c15239`, where
the product had that reading (`--reread 0.2 --no-chat` there); it was measured no better than
the chat's and taken out (eval/RESULTS.md). Every record is appended to OUT.jsonl as soon as
its task is done, so a killed run loses one task; run it again to go on. A length is done when
its native read got `--right` items of every kind right (`qa`, questions about a passage, has no right answer:
every item counts, scored by the recall of the native answer's content words); lengths take
turns, shortest first.
`python -m weights.experiments.long_documents_report OUT.jsonl` tabulates and plots it.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import time
from dataclasses import dataclass, replace
from pathlib import Path

import mlx_kvlingo  # noqa: F401  (OpenBLAS before mlx)
from mlx_kvlingo._platform import moe_cpu
from mlx_kvlingo.conversation import reader
from mlx_kvlingo.data.examples import read_texts
from mlx_kvlingo.eval.content import (
    Chat,
    Peer,
    chat_kv,
    evaluate_content,
    fitting_tasks,
)
from mlx_kvlingo.models.demo.pair import demo_content_texts, load_demo


@dataclass(frozen=True)
class TargetPeaks:
    """The chat's reading with the recompute chosen by the large model's peaks alone, as before
    the small model voted (`Selection.votes` off)."""

    chat: Chat

    def __call__(self, pair, task, native):
        saved = reader.RECOMPUTE_SELECTION
        reader.RECOMPUTE_SELECTION = replace(saved, votes=False)
        try:
            return chat_kv(pair, self.chat, task)
        finally:
            reader.RECOMPUTE_SELECTION = saved


def native_right(path: Path) -> tuple[dict, set]:
    """({(kind, length): native-right count}, the steps done) of an earlier run's records."""
    right, done = {}, set()
    if path.exists():
        for line in path.read_text().splitlines():
            r = json.loads(line)
            done.add((r["kind"], r["length"], r["step"]))
            if r["condition"] == "native":
                key = (r["kind"], r["length"])
                right[key] = right.get(key, 0) + bool(r.get("correct", True))
    return right, done


def _mark(r: dict) -> str:
    return ("ok" if r["correct"] else "--") if "correct" in r else f"recall {r['recall']:.2f}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("--lengths", default="1024,2048,4096")
    ap.add_argument("--kinds", default="fact,facts")
    ap.add_argument("--right", type=int, default=20)
    ap.add_argument("--seed", type=int, default=100)
    ap.add_argument("--pair", default="dense")
    ap.add_argument("--keep", default="0.3", help="speculative prefill's kept shares")
    ap.add_argument("--shares", default="0.2", help="extra recompute shares beside the chat's")
    ap.add_argument("--limit-s", type=float, default=float("inf"))
    ap.add_argument("--target-peaks", action="store_true",
                    help="also the chat with the large model's peaks alone choosing")  # fmt: skip
    ap.add_argument("--only-native-right", action="store_true",
                    help="the other paths answer only what the native read got right")  # fmt: skip
    ap.add_argument("--no-chat", action="store_true", help="not the chat's default reading")
    args = ap.parse_args()
    lengths = [int(x) for x in args.lengths.split(",")]
    kinds = args.kinds.split(",")
    pair, tr = load_demo(pair=args.pair)
    if args.pair == "moe":
        moe_cpu.per_expert_loop(pair.target.model)
    texts = [t for p in demo_content_texts() for t in read_texts(p)]
    chat = Chat(tr)
    conditions = {"chat": chat,
                  **{f"chat r{s:g}": Chat(tr, chat.tail, s) for s in map(float, args.shares.split(",") if args.shares else [])},
                  **{f"specprefill {k:g}": Peer(k) for k in map(float, args.keep.split(",") if args.keep else [])}}  # fmt: skip
    if args.target_peaks:
        conditions["chat target-peaks"] = TargetPeaks(chat)
    if args.no_chat:
        del conditions["chat"]
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True).stdout.strip()  # fmt: skip
    start = time.monotonic()
    step = 0
    while time.monotonic() - start < args.limit_s:
        right, done = native_right(args.out)
        todo = [(k, n) for n in lengths for k in kinds if right.get((k, n), 0) < args.right]
        if not todo:
            break
        for n in lengths:
            for kind in kinds:
                if (kind, n) not in todo or (kind, n, step) in done:
                    continue
                (task,) = fitting_tasks(pair, texts, [n], 1, seed=args.seed + step, kinds=[kind])
                res = evaluate_content(pair, [task], conditions, small=False,
                                       only_native_right=args.only_native_right)  # fmt: skip
                with args.out.open("a") as f:
                    for r in res.records:
                        f.write(json.dumps({**r, "step": step, "seed": args.seed + step,
                                            "commit": commit, "pair": args.pair}) + "\n")  # fmt: skip
                by = {r["condition"]: r for r in res.records}
                print(f"step {step} {kind} {n} tok: " + ", ".join(
                    f"{c} {_mark(r)} {r['read_s']:.1f}s" for c, r in by.items()),
                    flush=True)  # fmt: skip
        step += 1


if __name__ == "__main__":
    main()
