"""The MoE demo target against the dense one it was upcycled from, through the product's paths.

    content L1,L2 PER SEED   native answers (and the chat's reading) of both targets on the same
                             held-out fact tasks (`eval.content.evaluate_content`), counts and
                             how many replies are identical
    ttft LENGTH TRIALS loop|gather
                             TTFT on the MoE pair through `Conversation`: reader "self" against
                             reader "small" on a LENGTH-token document, greedy, alternating, after
                             one warm-up round; `loop`: MoE prefill through `moe_cpu.per_expert_loop`

Run from the repo root:  OPENBLAS_NUM_THREADS=1 python -m weights.experiments.moe_upcycle_check content 1024,2048 4 21
"""

import statistics
import sys
import time

import mlx_kvlingo  # noqa: F401  (preloads OpenBLAS; must come before mlx)
from mlx_kvlingo._platform import moe_cpu
from mlx_kvlingo.cli._common import content_texts
from mlx_kvlingo.config import ReaderPolicy
from mlx_kvlingo.data.content_tasks import build_tasks
from mlx_kvlingo.eval.content import Chat, evaluate_content, fitting_tasks
from mlx_kvlingo.models.loading import load_models_and_translators


def content(lengths: list[int], per_kind: int, seed: int) -> None:
    rows = {}
    for name in ("dense", "moe"):
        pair, fwd, _ = load_models_and_translators(demo_pair=name)
        tasks = fitting_tasks(
            pair, content_texts(None), lengths, per_kind, seed=seed, kinds=("fact",)
        )
        t0 = time.time()
        with moe_cpu.per_expert_loop(name == "moe"):
            res = evaluate_content(pair, tasks, {"chat": Chat(fwd, 32, 0.1)}, small=False,
                                   progress=False)  # fmt: skip
        rows[name] = [(r["length"], r["condition"], r["correct"], r["reply"]) for r in res.records]
        print(name, "minutes", round((time.time() - t0) / 60, 1), flush=True)
    for n in lengths:
        for cond in ("native", "chat"):
            d, m = ([r for r in rows[k] if r[:2] == (n, cond)] for k in ("dense", "moe"))
            same = sum(a[3] == b[3] for a, b in zip(d, m, strict=True))
            print(f"{n} {cond}: right dense {sum(r[2] for r in d)}/{len(d)}, moe "
                  f"{sum(r[2] for r in m)}/{len(m)}; identical replies {same}/{len(d)}")  # fmt: skip


def ttft(length: int, trials: int, loop: bool) -> None:
    import mlx_kvlingo as kvl

    pair = kvl.load(pair="moe")
    tok = pair.tokenizer
    tasks = build_tasks(tok, content_texts(None), [length], trials + 1, ("fact",), seed=11)

    def user(t):  # the user message of the templated prompt
        return tok.decode(t.tokens).split("<|im_start|>user\n", 1)[1].split("<|im_end|>", 1)[0]

    got = {"self": [], "small": []}
    with moe_cpu.per_expert_loop(loop) as active:
        for i, task in enumerate(tasks):  # round 0 warms up
            for reader in ("self", "small") if i % 2 else ("small", "self"):
                cache = kvl.make_prompt_cache(pair, policy=ReaderPolicy(reader=reader))
                kvl.generate(pair, user(task), prompt_cache=cache, max_tokens=1, temp=0.0)
                h = cache.last_turn
                if i:
                    got[reader].append(h.ttft_s)
                print(reader, i, f"{h.ttft_s:.2f} s", h.prompt_tokens, flush=True)
    small, own = statistics.median(got["small"]), statistics.median(got["self"])
    print(f"per_expert_loop={active} {length} tokens: small {small:.2f} s, self {own:.2f} s, "
          f"ratio {small / own:.3f}")  # fmt: skip


if __name__ == "__main__":
    what, *rest = sys.argv[1:]
    if what == "content":
        content([int(x) for x in rest[0].split(",")], int(rest[1]), int(rest[2]))
    else:
        ttft(int(rest[0]), int(rest[1]), rest[2] == "loop")
