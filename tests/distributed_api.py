"""A user script on the public API alone, run by every rank of `mlx.launch` (test_distributed.py)
and, as the reference, in one process.

    python distributed_api.py JOB.json

JOB: {"cases": [{source, target, translator, backward, wire, timeout, die, short}], "out": path}.
Rank 0 writes one record per case (every answer's token ids and switch counts). A follower's
`load` ends in SystemExit when rank 0 closes that pair; catching it lets one launch
serve several cases. In a case with "die", rank 1 exits abruptly at the first translated span
it is sent, and rank 0 records the error it gets.
"""

import json
import os
import sys
import time

from mlx_kvlingo.config import ReaderPolicy

sys.modules.setdefault("torch", None)  # not needed here; transformers would import it (slow)

import mlx_kvlingo  # noqa: E402,F401  (preloads OpenBLAS before mlx)
from mlx_kvlingo import Conversation, load  # noqa: E402
from mlx_kvlingo.api import Pair  # noqa: E402

GREEDY = {"max_tokens": 5, "temp": 0.0}


def _turn(stream, stop_after=None) -> dict:
    tokens, done = [], None
    for r in stream:
        if r.token is not None:
            tokens.append(r.token)
        if r.finish_reason is not None:
            done = r
            break
        if stop_after is not None and len(tokens) == stop_after:
            stream.close()  # stop early: the conversation keeps what was emitted
            break
    rec = {"tokens": tokens}
    if done is not None:
        st = done.handoff
        sw = st.switch
        rec.update(model=done.model, switch=sw.lacked if sw else 0,
                   translated=sw.translated if sw else 0,
                   read=st.read.tokens if st.read else 0, prompt=st.prompt_tokens)  # fmt: skip
    return rec


def conversation(rt: Pair, short: bool = False) -> dict:
    """Every kind of turn: the small model reading for the large one, alternation both ways,
    escalation both ways (a cache cut back), a stream stopped early, naive re-translation,
    reset, two conversations interleaved, the token rule (the small reads the
    opening, the large a short later turn), the large reading a turn's last 3 tokens itself;
    `short`: the first three turns."""
    a = Conversation(
        rt, policy=ReaderPolicy(reader="small", large_reads_last=1, recompute_share=0)
    )  # the plain handoff
    b = Conversation(rt, policy=ReaderPolicy(reader="self", recompute_share=0))
    turns = [
        _turn(a.send("def foo(x):", "large", **GREEDY)),
        _turn(b.send("class Bar:", "large", **GREEDY)),
        _turn(a.send("return x + 1", "large", **GREEDY)),
    ]
    if short:  # the first switches only (a second wire)
        return {"turns": turns}
    turns += [
        _turn(a.send(escalate=True, **GREEDY)),  # large -> small: the large cache is cut back
        _turn(a.send("and then?", "small", **GREEDY)),
        _turn(a.send(escalate=True, **GREEDY)),
        _turn(b.send("import os", "large", **GREEDY)),
        _turn(a.send("stop early", "large", **GREEDY), stop_after=2),
        _turn(a.send("go on", "large", **GREEDY)),
    ]
    a.mode = "naive"
    turns.append(_turn(a.send("naive now", "large", **GREEDY)))
    a.mode = "alternation"
    a.reset()
    turns.append(_turn(a.send("fresh start", "large", **GREEDY)))
    d = Conversation(
        rt, policy=ReaderPolicy(reader="tokens", large_reads_last=1, recompute_share=0)
    )  # the same in every process
    turns.append(_turn(d.send("def foo(x):", "large", **GREEDY)))
    turns.append(_turn(d.send("ok", "large", **GREEDY)))
    e = Conversation(
        rt, policy=ReaderPolicy(reader="small", large_reads_last=3, recompute_share=0)
    )  # last 3 itself
    turns.append(_turn(e.send("def parse_args(argv): return argv", "large", **GREEDY)))
    stats = {
        k: a.cache.stats()["models"]["target"][k] for k in ("translated_into", "turns", "held")
    }
    return {"turns": turns, "stats": stats}


def run_case(case: dict, distributed: bool) -> dict:
    rt = load(case["source"], case["target"], case["translator"], case.get("backward"),
              distributed=distributed, wire=case.get("wire", "auto"),
              timeout=case.get("timeout"))  # fmt: skip
    if case.get("die"):
        return _lost(rt)
    out = conversation(rt, case.get("short", False))
    out["ranks"] = rt.link.ranks if rt.link is not None else 1
    if distributed:  # internals, to check where the layers and the bytes went
        out["local_layers"] = len(rt.models.target.model.layers)
        out["owners"] = [[o.start, o.stop] for o in rt.link.owners]
        out["bytes_sent"] = rt.link.bytes_sent
        out["bytes_received"] = rt.link.bytes_received
        out["recompute_default"] = Conversation(rt).policy.recompute_share
        try:  # the recompute runs all of the large model's layers in one process
            Conversation(rt, policy=ReaderPolicy(recompute_share=0.1))
            out["recompute_error"] = None
        except Exception as e:  # noqa: BLE001 - the point is which error
            out["recompute_error"] = str(e)
    rt.close()
    return out


def _lost(rt: Pair) -> dict:
    """Rank 0 of a case whose rank 1 dies: the error a user gets, and how long it took."""
    t0 = time.monotonic()
    try:
        conv = Conversation(
            rt, policy=ReaderPolicy(reader="small", large_reads_last=1, recompute_share=0)
        )
        list(conv.send("def foo(x):", "large", **GREEDY))  # a span is sent
        return {"error": None}
    except Exception as e:  # noqa: BLE001 - the point is which error
        return {"error": type(e).__name__, "message": str(e), "seconds": time.monotonic() - t0}


def _die_at_first_span() -> None:
    import mlx_kvlingo.distributed.session as pipelined

    def die(*args, **kwargs):
        os._exit(0)  # abruptly, but with 0: mlx.launch stops the other ranks when one fails

    pipelined.place = die


def main(job_path: str) -> None:
    job = json.loads(open(job_path).read())
    results = []
    for case in job["cases"]:
        if case.get("die") and os.environ.get("MLX_RANK") == "1":
            _die_at_first_span()
        try:
            results.append(run_case(case, distributed=True))
        except SystemExit:  # a follower: rank 0 closed this runtime
            continue
    if results:  # rank 0
        with open(job["out"], "w") as f:
            json.dump(results, f)
        if results[-1].get("error"):
            os._exit(0)  # a rank is gone: skip MLX's teardown of the ring


if __name__ == "__main__":
    main(sys.argv[1])
