"""A bounded load test of `kvlingo serve`: N concurrent OpenAI clients x M requests each.

    python -m weights.experiments.serve_load                          # the demo pair
    python -m weights.experiments.serve_load --tiny                   # tiny random pair (seconds; a smoke run)
    python -m weights.experiments.serve_load --clients 4 --requests 10 --max-tokens 16 --out load.md

Each client holds a chat: every request sends the whole history plus a new question, so the
server's prefix reuse is in play (`--turns` questions, then a fresh chat). Rows, each on its own
server over the same loaded pair:

    large            the model id `large` as the library serves it (the default reader policy
                     "auto": the small model reads a chat's opening and long new turns, the
                     large answers from the translated cache; short follow-ups it reads itself)
    large, small reads   `reader="small"`: the small model reads every new turn (`smallreads`)
    large, self      the large model reads everything it lacks itself (`reader="self"`)
    large, no reuse  `--max-conversations 0`: every request is a new conversation

Per request: TTFT (request sent -> first content chunk, queueing included), server TTFT (the
answering model's catch-up, prefill and first token, as the server reports it in `kvlingo.ttft_s`:
no queueing, no HTTP) and decode tokens/s
(completion tokens after the first / time after the first). The table gives p50/p95 TTFT, p50
decode tok/s, the aggregate completion tok/s over the row's wall time, and per request the
tokens each model read and the tokens translated into the large model (from `usage`).
Everything is bounded: `--requests` per client, `--timeout` per request, `--deadline` per row.
"""

from __future__ import annotations

import argparse
import platform
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import mlx_kvlingo  # noqa: F401  (OpenBLAS before mlx)

QUESTIONS = [
    "What is a KV cache?",
    "Why does it make answers faster?",
    "Give an example with a long document.",
    "What does it cost in memory?",
    "Summarize that in one sentence.",
    "What is a good name for a cat?",
    "How do plants make food?",
    "Tell me a fact about the moon.",
    "What should I cook tonight?",
    "Explain rain to a child.",
]


def tiny_pair(folder: Path):
    """The tests' known-answer tiny pair with its exact translator (built offline)."""
    from mlx_kvlingo.api import Pair
    from mlx_kvlingo.data import synthetic as syn
    from mlx_kvlingo.models.pair import load_pair

    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests"))
    from helpers import exact_translator, known_answer_target

    tok = syn.build_tokenizer(folder / "tokenizer")
    src = syn.make_model_folder(folder / "small", "qwen3", tok, seed=0)
    answer = known_answer_target(src, folder / "large", seed=4)
    pair = load_pair(src, folder / "large")
    return Pair(pair, exact_translator(pair, answer))


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    if not xs:
        return float("nan")
    k = (len(xs) - 1) * q
    lo, hi = int(k), min(int(k) + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


def client_run(url, model, args, out, stop_at):
    from openai import OpenAI

    client = OpenAI(base_url=url, api_key="load", max_retries=0, timeout=args.timeout)
    messages: list[dict] = []
    for i in range(args.requests):
        if time.monotonic() > stop_at:
            out.append({"error": "deadline"})
            return
        if i % args.turns == 0:
            messages = [{"role": "system", "content": "You are a concise assistant."}]
        messages.append({"role": "user", "content": QUESTIONS[i % len(QUESTIONS)]})
        t0 = time.perf_counter()
        first = None
        text, usage, info = "", None, {}
        try:
            stream = client.chat.completions.create(
                model=model, messages=messages, max_tokens=args.max_tokens, temperature=0,
                stream=True, stream_options={"include_usage": True},
            )  # fmt: skip
            for chunk in stream:
                if chunk.choices and chunk.choices[0].delta.content:
                    if first is None:
                        first = time.perf_counter()
                    text += chunk.choices[0].delta.content
                elif chunk.usage is not None:
                    usage = chunk.usage
                    info = (chunk.model_extra or {}).get("kvlingo") or {}
        except Exception as e:  # noqa: BLE001 (counted, reported)
            out.append({"error": type(e).__name__})
            return
        end = time.perf_counter()
        messages.append({"role": "assistant", "content": text})
        n = usage.completion_tokens if usage else 0
        extra = usage.model_extra if usage else {}
        out.append({
            "ttft": (first or end) - t0,
            "server_ttft": info.get("ttft_s") or float("nan"),
            "tps": (n - 1) / (end - first) if first and n > 1 and end > first else float("nan"),
            "tokens": n,
            "read": extra.get("read_tokens", {}),
            "translated": extra.get("translated_tokens", {}),
        })  # fmt: skip


def run_row(pair, label, model, args, **server_kwargs):
    from mlx_kvlingo.serve import Limits, ServeConfig, Server

    config = ServeConfig(port=0, queue_size=max(args.clients, 1),
                         limits=Limits(max_tokens=max(args.max_tokens, 16)),
                         **server_kwargs.pop("config", {}))  # fmt: skip
    server = Server(pair, config, **server_kwargs).start()
    results: list[dict] = []
    t0 = time.perf_counter()
    stop_at = time.monotonic() + args.deadline
    try:
        threads = [threading.Thread(target=client_run, args=(server.url, model, args, results,
                                                             stop_at)) for _ in range(args.clients)]  # fmt: skip
        for t in threads:
            t.start()
        for t in threads:
            t.join(args.deadline + args.timeout)
    finally:
        server.close()
    wall = time.perf_counter() - t0
    ok = [r for r in results if "error" not in r]
    tps = [r["tps"] for r in ok if r["tps"] == r["tps"]]
    n = max(len(ok), 1)

    def mean(key, who):
        return sum(r[key].get(who, 0) for r in ok) / n

    return {
        "label": label,
        "requests": len(ok),
        "errors": len(results) - len(ok),
        "ttft_p50": 1e3 * pct([r["ttft"] for r in ok], 0.5),
        "ttft_p95": 1e3 * pct([r["ttft"] for r in ok], 0.95),
        "server_p50": 1e3
        * pct([r["server_ttft"] for r in ok if r["server_ttft"] == r["server_ttft"]], 0.5),
        "server_p95": 1e3
        * pct([r["server_ttft"] for r in ok if r["server_ttft"] == r["server_ttft"]], 0.95),
        "tps_p50": statistics.median(tps) if tps else float("nan"),
        "aggregate": sum(r["tokens"] for r in ok) / wall,
        "read_small": mean("read", "small"),
        "read_large": mean("read", "large"),
        "translated_large": mean("translated", "large"),
        "wall": wall,
    }


def table(rows, args, names) -> str:
    import mlx.core as mx

    head = (
        f"{args.clients} clients x {args.requests} requests, max_tokens {args.max_tokens}, "
        f"chats of {args.turns} turns · small {Path(names['small']).name}, "
        f"large {Path(names['large']).name} · {platform.machine()} {platform.system()}, "
        f"mlx {mx.__version__} ({mx.default_device()})"
    )
    lines = [
        head,
        "",
        "| row | requests | TTFT p50 ms | TTFT p95 ms | server TTFT p50 ms | server TTFT p95 ms "
        "| decode tok/s p50 | aggregate tok/s "
        "| read by small / req | read by large / req | translated into large / req | errors |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r['label']} | {r['requests']} | {r['ttft_p50']:.0f} | {r['ttft_p95']:.0f} | "
            f"{r['server_p50']:.0f} | {r['server_p95']:.0f} | "
            f"{r['tps_p50']:.1f} | {r['aggregate']:.1f} | {r['read_small']:.1f} | "
            f"{r['read_large']:.1f} | {r['translated_large']:.1f} | {r['errors']} |"
        )
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--source")
    p.add_argument("--target")
    p.add_argument("--translator")
    p.add_argument("--backward-translator")
    p.add_argument("--tiny", action="store_true", help="the tiny random test pair")
    p.add_argument("--clients", type=int, default=4)
    p.add_argument("--requests", type=int, default=10, help="per client")
    p.add_argument("--turns", type=int, default=5, help="questions per chat before a new one")
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--timeout", type=float, default=300.0, help="seconds per request")
    p.add_argument("--deadline", type=float, default=900.0, help="seconds per row")
    p.add_argument("--rows", default="large,self,noreuse",
                   help="which rows: large, smallreads, self, noreuse, small "
                        "(comma-separated)")  # fmt: skip
    p.add_argument("--out", help="also write the table to this file")
    args = p.parse_args(argv)
    if args.clients < 1 or args.requests < 1 or args.requests * args.clients > 400:
        p.error("1..400 requests in all")

    from mlx_kvlingo import ReaderPolicy, load

    print("loading models...", file=sys.stderr)
    if args.tiny:
        pair = tiny_pair(Path(tempfile.mkdtemp(prefix="kvlingo-load-")))
    else:
        pair = load(args.source, args.target, args.translator, args.backward_translator)
    rows, done = [], set()
    for row in [r.strip() for r in args.rows.split(",") if r.strip()]:
        if row == "large":
            rows.append(run_row(pair, "`large`", "large", args))
        elif row == "smallreads":
            rows.append(run_row(pair, "`large`, the small reads every turn", "large", args,
                                policy=ReaderPolicy(reader="small")))  # fmt: skip
        elif row == "self":
            rows.append(run_row(pair, "large reads everything itself", "large", args,
                                policy=ReaderPolicy(reader="self")))  # fmt: skip
        elif row == "noreuse":
            rows.append(run_row(pair, "`large`, no prefix reuse", "large", args,
                                config={"max_conversations": 0}))  # fmt: skip
        elif row == "small":
            rows.append(run_row(pair, "`small`", "small", args))
        else:
            p.error(f"unknown row {row!r}")
        if rows and rows[-1]["label"] not in done:
            done.add(rows[-1]["label"])
            print(f"  {rows[-1]['label']}: done", file=sys.stderr)
    out = table(rows, args, pair.names)
    print(out)
    if args.out:
        Path(args.out).write_text(out + "\n")
    return 0 if all(r["errors"] == 0 for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
