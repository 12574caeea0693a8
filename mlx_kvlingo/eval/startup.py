"""`kvlingo bench --startup`: spawn of a fresh process to its first token of a one-word answer,
`SIDES` alternating for `trials` rounds after one untimed start each: mlx-lm's `load` +
`stream_generate` of the target; kvlingo's `load()` (warm-up included) + `stream_generate`, on
the cache folder in use (rates reused) and on a new one (rates measured). Both sides preload
the same BLAS.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from mlx_kvlingo.conversation.reader import RATES
from mlx_kvlingo.eval import report

PROMPT = "Answer in one word: what is the capital of France?"

#: one start, in a fresh process (argv: side, args as JSON): its parts and the wall clock at its
#: first token, as one JSON line
_CHILD = """
import json, sys, time
t0 = time.perf_counter()
side, args = sys.argv[1], json.loads(sys.argv[2])
import mlx_kvlingo._platform.blas  # no MLX yet
if side == "mlx-lm":
    from mlx_lm import load, stream_generate
    t1 = time.perf_counter()
    model, tokenizer = load(args["target_folder"])
    messages = [{"role": "user", "content": args["prompt"]}]
    answer = lambda: stream_generate(model, tokenizer, tokenizer.apply_chat_template(
        messages, add_generation_prompt=True), max_tokens=1)
    warmup, rates = None, None
else:
    from mlx_kvlingo import load, stream_generate
    t1 = time.perf_counter()
    rt = load(args["source"], args["target"], args["translator"], pair=args["pair"])
    answer = lambda: stream_generate(rt, args["prompt"], model="large", max_tokens=1)
    warmup, rates = rt.warmup_s, rt.rates
t2 = time.perf_counter()

def first_token():
    t = time.perf_counter()
    for _ in answer():
        return time.time(), time.perf_counter() - t

at, ttft = first_token()
_, later = first_token()
print(json.dumps({"first_token_at": at, "import_s": t1 - t0, "load_s": t2 - t1,
                  "warmup_s": warmup, "rates": rates, "ttft_s": ttft, "later_ttft_s": later}))
"""


class StartupBenchError(RuntimeError):
    """A timed start failed (its process's last line of error output says why)."""


SIDES = {
    "mlx-lm": "mlx-lm load + first token",
    "kvlingo": "kvlingo load + first token (rates reused)",
    "kvlingo-new": "kvlingo, new cache folder (rates measured)",
}


def run_one(side: str, args: dict, cache: Path, timeout: float) -> dict:
    """One start in a fresh process; its parts, and `start_s`: spawn to first token."""
    env = dict(os.environ)
    with tempfile.TemporaryDirectory(prefix="kvlingo-startup-", ignore_cleanup_errors=True) as new:
        if side == "kvlingo-new":  # a new cache folder linking everything in `cache` but the rates
            for entry in cache.iterdir() if cache.is_dir() else ():
                if entry.name != RATES and not entry.name.startswith("."):
                    (Path(new) / entry.name).symlink_to(entry.resolve())
            env["KVLINGO_CACHE"] = new
        spawned = time.time()
        out = subprocess.run([sys.executable, "-c", _CHILD, side, json.dumps(args)], env=env,
                             capture_output=True, text=True, timeout=timeout)  # fmt: skip
    if out.returncode != 0:
        last = (out.stderr.strip().splitlines() or ["no message"])[-1]
        raise StartupBenchError(f"the {side} start failed (exit {out.returncode}): {last}")
    got = json.loads(out.stdout.strip().splitlines()[-1])
    got["start_s"] = got.pop("first_token_at") - spawned
    return got


def run_startup_bench(source=None, target=None, translator=None, demo_pair: str = "dense",
                      trials: int = 3, timeout: float = 600.0, log=print) -> dict:  # fmt: skip
    """The three sides, one untimed start each, then `trials` alternating rounds."""
    from mlx_kvlingo._platform.cachedir import cache_root
    from mlx_kvlingo.models.demo.pair import demo_models

    named = {"source": source, "target": target, "translator": translator}
    args = {k: None if v is None else str(v) for k, v in named.items()}
    # the large model's folder (or Hub id) as mlx-lm loads it: the demo's converted target
    args["target_folder"] = str(target or demo_models(demo_pair or "dense")[1])
    args.update(pair=None if source or target else demo_pair, prompt=PROMPT)
    cache = cache_root()
    order = ("kvlingo", "mlx-lm", "kvlingo-new")
    runs: dict[str, list[dict]] = {side: [] for side in order}
    info = report.run_info()  # the load average at the start
    for side in ("kvlingo", "mlx-lm"):  # untimed: the page cache, the stored rates
        log(f"untimed start: {side}")
        run_one(side, args, cache, timeout)
    for i in range(trials):
        for side in order:
            got = run_one(side, args, cache, timeout)
            runs[side].append(got)
            log(f"round {i + 1}/{trials} · {side}: {got['start_s']:.2f} s (rates {got['rates']})")
    info["machine"]["load_average_end"] = report.load_average()
    return {**info, "args": args, "trials": trials, "runs": runs, "summary": summarize(runs)}


def summarize(runs: dict[str, list[dict]]) -> dict:
    out = {}
    for side, rs in runs.items():
        out[side] = {k: report.stats([r.get(k) for r in rs]) for k in
                     ("start_s", "import_s", "load_s", "warmup_s", "ttft_s", "later_ttft_s")}  # fmt: skip
        out[side]["rates"] = sorted({str(r.get("rates")) for r in rs})
    base = out["mlx-lm"]["start_s"]
    for mine in (out["kvlingo"], out["kvlingo-new"]):
        mine["vs_mlx_lm"] = {k: mine["start_s"][k] / base[k] for k in ("min", "median")}
        mine["first_vs_later_turn"] = mine["ttft_s"]["median"] / mine["later_ttft_s"]["median"]
    return out


def markdown(result: dict) -> str:
    s = result["summary"]

    def f(x, key="median"):
        return "" if x is None else f"{x[key]:.2f}"

    rows = []
    for side, label in SIDES.items():
        r = s[side]
        ratio = f"{r['vs_mlx_lm']['median']:.2f}x" if "vs_mlx_lm" in r else "1x"
        rows.append([label, f(r["start_s"], "min"), f(r["start_s"]), ratio, f(r["import_s"]),
                     f(r["load_s"]), f(r["warmup_s"]), f(r["ttft_s"]), f(r["later_ttft_s"])])  # fmt: skip
    columns = ("start", "min", "median", "vs mlx-lm (median)", "imports", "load", "warm-up",
               "first TTFT", "later TTFT")  # fmt: skip
    kv = s["kvlingo"]
    lines = [
        f"## Start to the first token ({result['trials']} fresh processes each, alternating)",
        "",
        f'Spawn to the first token of a one-word answer ("{PROMPT}"), in seconds; the parts '
        "are medians within the child (imports, load, warm-up, the first turn's TTFT, and a "
        "later turn's in a new conversation).",
        "",
        *report.md_table(columns, "lrrrrrrrr", rows),
        "",
        f"kvlingo on a machine that ran it before against mlx-lm: {kv['vs_mlx_lm']['median']:.2f}x "
        f"(median), {kv['vs_mlx_lm']['min']:.2f}x (min). First turn against a later one: "
        f"{kv['first_vs_later_turn']:.2f}x (rates reused), "
        f"{s['kvlingo-new']['first_vs_later_turn']:.2f}x (new cache folder).",
        "",
        f"{report.machine_line(result['machine'], result['software'])}; "
        f"{report.load_span(result['machine'])}. Target: {result['args']['target_folder']}.",
    ]
    return "\n".join(lines) + "\n"


def write_outputs(result: dict, out_dir) -> dict[str, Path]:
    """startup.json and startup.md in `out_dir`."""
    return report.write(out_dir, "startup", result, markdown(result))
