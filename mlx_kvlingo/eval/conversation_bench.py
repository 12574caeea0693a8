"""A multi-turn conversation timed under the policies of `config.POLICIES` side by side (large
reads / small reads / auto reads / cascade), each a `Session`, turn by turn.

User turns are `user_lengths` tokens (cycled), answers exactly `answer_tokens` tokens (greedy,
end-of-sequence banned): every policy does the same work. TTFT is as the user sees it (an
escalated cascade turn: the small answer plus the large's TTFT).
"""

from __future__ import annotations

import random
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

from mlx_kvlingo.api import Pair
from mlx_kvlingo.config import POLICIES, ReaderPolicy
from mlx_kvlingo.conversation.session import Session
from mlx_kvlingo.conversation.warmup import warm_up
from mlx_kvlingo.eval import report
from mlx_kvlingo.eval.bench import prompt_tokens
from mlx_kvlingo.eval.report import md_row, md_table, number
from mlx_kvlingo.kv.translator import Translator
from mlx_kvlingo.models.pair import ModelPair

import numpy as np
from mlx_lm.sample_utils import make_logits_processors

SCHEMA = "mlx-kvlingo/conversation-bench"


@dataclass
class ConversationBenchConfig:
    turns: int = 8
    user_lengths: tuple[int, ...] = (32, 128, 512)
    answer_tokens: int = 16
    escalation_rate: float = 0.25
    seed: int = 0
    policies: tuple[str, ...] = tuple(POLICIES)
    warmup: bool = True
    policy: ReaderPolicy = field(default_factory=ReaderPolicy)  # as the API's conversations


@dataclass
class TurnTiming:
    policy: str
    turn: int
    user_tokens: int
    ttft_s: float
    total_s: float
    read_s: float = 0.0  # the small model reading for the large
    translate_s: float = 0.0  # every translation this turn (both directions)
    large_read_tokens: int = 0  # tokens the large model read itself (the recompute's tail too)
    recomputed_tokens: int = 0  # translated tokens the large model recomputed
    recompute_s: float = 0.0  # its read of the tail and the recompute
    small_read: bool = False  # the small model read this turn for the large one
    retention: float | None = None  # what reader auto expected the small path to keep
    escalated: bool = False
    escalation_ttft_s: float | None = None  # the large model's TTFT after the escalation
    small_decode_tps: float | None = None  # the small model's decode speed (cascades)
    large_decode_tps: float | None = None  # the large model's decode speed once escalated


def _answer(session: Session, model: str, cfg: ConversationBenchConfig, escalate: bool = False):
    """Run one answer to its full length (end-of-sequence banned through mlx-lm's logit bias);
    (total seconds, turn stats: its TTFT as the session measured it)."""
    procs = make_logits_processors(
        logit_bias=dict.fromkeys(session.pair.tokenizer.eos_token_ids, -1e9)
    )
    run = session.escalate if escalate else session.generate
    t0 = time.perf_counter()
    list(run(model, max_tokens=cfg.answer_tokens, logits_processors=procs))
    return time.perf_counter() - t0, session.last_turn


def _translate_s(st) -> float:
    switches = [st.switch] + ([st.read.catch_up] if st.read else [])
    return sum(s.seconds for s in switches if s is not None and s.translated)


def _turn(s: Session, policy: str, t: int, n: int, cfg, escalate: bool) -> TurnTiming:
    """One turn of `policy` on its session, timed (the user turn already added)."""
    if not policy.startswith("cascade"):
        total, st = _answer(s, "target", cfg)
        sw = st.switch
        return TurnTiming(
            policy, t, n, st.ttft_s, total, read_s=st.read.seconds if st.read else 0.0,
            translate_s=_translate_s(st),
            # with the recompute the answer reads the tail's last token again
            large_read_tokens=max(st.prompt_tokens, sw.tail_read if sw else 0),
            recomputed_tokens=sw.recomputed if sw else 0,
            recompute_s=sw.recompute_s if sw else 0.0, small_read=st.read is not None,
            retention=st.retention,
        )  # fmt: skip
    total, st = _answer(s, "source", cfg)
    tt = TurnTiming(policy, t, n, st.ttft_s, total, translate_s=_translate_s(st),
                    small_decode_tps=st.generation_tps)  # fmt: skip
    if escalate:
        e_total, est = _answer(s, "target", cfg, escalate=True)
        tt.ttft_s, tt.total_s = total + est.ttft_s, total + e_total
        tt.escalation_ttft_s = est.ttft_s
        tt.large_decode_tps, tt.large_read_tokens = est.generation_tps, est.prompt_tokens
        tt.translate_s += _translate_s(est)
        tt.escalated = True
    return tt


def run_conversation_bench(
    pair: ModelPair,
    forward: Translator,
    backward: Translator | None = None,
    cfg: ConversationBenchConfig = ConversationBenchConfig(),
    log=print,
    info: dict | None = None,
) -> dict:
    """Time `cfg.turns` turns under each policy; a JSON-ready dict."""
    warmup_s = warm_up(pair, forward, backward).warmup_s if cfg.warmup else None
    if cfg.warmup:
        log(f"warm-up {warmup_s:.1f} s")
    runtime = Pair(pair, forward, backward)  # reader auto weighs what the chat's weighs
    policies = {p: replace(cfg.policy, **POLICIES[p]) for p in cfg.policies}
    sessions = {p: Session(pair, forward, backward, policy=policy,
                           retention=runtime.retention(policy))
                for p, policy in policies.items()}  # fmt: skip
    rng = random.Random(cfg.seed)
    escalate = [rng.random() < cfg.escalation_rate for _ in range(cfg.turns)]
    timings: list[TurnTiming] = []
    for t in range(cfg.turns):
        n = cfg.user_lengths[t % len(cfg.user_lengths)]
        user = prompt_tokens(pair, n, cfg.seed * 1000 + t)
        for policy, s in sessions.items():
            s.add_tokens(user)
            timings.append(_turn(s, policy, t, n, cfg, escalate[t]))
        log(f"turn {t} ({n} user tokens): "
            + " · ".join(f"{x.policy} TTFT {x.ttft_s * 1e3:.0f} ms" for x in timings if x.turn == t))  # fmt: skip
    return {
        "schema": SCHEMA,
        "config": asdict(cfg),
        "escalated_turns": [t for t, e in enumerate(escalate) if e],
        "pair": {"source": pair.source.name, "target": pair.target.name, **(info or {})},
        "backward": backward is not None,
        "warmup_s": warmup_s,
        **report.run_info(),
        "turns": [asdict(x) for x in timings],
        "summary": summarize(timings, cfg),
    }


def _mean(xs) -> float | None:
    xs = [x for x in xs if x is not None]
    return float(np.mean(xs)) if xs else None


def summarize(timings: list[TurnTiming], cfg: ConversationBenchConfig) -> dict:
    """Mean TTFT per policy and user-turn length; reader auto against the better of the two
    fixed readers per turn; the cascades' escalations and the small model's decoding."""
    out: dict = {"by_length": {}}
    for n in sorted(set(cfg.user_lengths)):
        row = {}
        for p in cfg.policies:
            xs = [x for x in timings if x.policy == p and x.user_tokens == n and x.turn > 0]
            xs = xs or [x for x in timings if x.policy == p and x.user_tokens == n]
            if xs:
                row[p] = {"ttft_ms": 1e3 * _mean(x.ttft_s for x in xs),
                          "total_ms": 1e3 * _mean(x.total_s for x in xs), "turns": len(xs)}  # fmt: skip
        if "small reads" in row and "large reads" in row:
            row["ttft_ratio_small_over_large"] = row["small reads"]["ttft_ms"] / row["large reads"]["ttft_ms"]  # fmt: skip
        out["by_length"][str(n)] = row
    cascades = {}
    for p in [p for p in cfg.policies if p.startswith("cascade")]:
        mine = [x for x in timings if x.policy == p]
        esc = _mean(x.escalation_ttft_s for x in mine)
        large = _mean(x.large_decode_tps for x in mine)
        step = 1e3 / large if large else None  # one large decode step, ms
        cascades[p] = {
            "escalations": sum(x.escalated for x in mine),
            "escalation_ttft_ms": None if esc is None else 1e3 * esc,
            "large_step_ms": step,
            "escalation_ttft_in_steps": 1e3 * esc / step if esc and step else None,
            "small_decode_tps": _mean(x.small_decode_tps for x in mine),
        }
    if cascades:
        out["cascades"] = cascades
    by = {(x.policy, x.turn): x for x in timings}
    rows = []
    for t in range(cfg.turns):
        large, small, auto = (by.get((p, t)) for p in ("large reads", "small reads", "auto reads"))
        if None in (large, small, auto):
            continue
        # the small path counts where it keeps reader auto's retention threshold
        keeps = auto.retention is None or auto.retention >= cfg.policy.min_retention
        best = min(large.ttft_s, small.ttft_s) if keeps else large.ttft_s
        rows.append({"turn": t, "user_tokens": auto.user_tokens, "small_read": auto.small_read,
                     "large_reads_ms": 1e3 * large.ttft_s, "small_reads_ms": 1e3 * small.ttft_s,
                     "auto_ms": 1e3 * auto.ttft_s, "auto_over_best": auto.ttft_s / best,
                     "retention": auto.retention, "small_keeps": keeps,
                     # the same path as the faster of the columns that keep the threshold (the
                     # rest is noise between runs of the same path)
                     "picked_faster": auto.small_read == (keeps and small.ttft_s < large.ttft_s)})  # fmt: skip
    if rows:  # the goal: auto within 10% of the better of the two on every turn
        out["auto"] = {
            "turns": rows,
            "worst_over_best": max(r["auto_over_best"] for r in rows),
            "within_10pct": sum(r["auto_over_best"] <= 1.10 for r in rows),
            "picked_faster": sum(r["picked_faster"] for r in rows),
        }
    return out


def markdown_report(result: dict) -> str:
    """conversation.md: per turn, by user-turn length and the cascades' (`summarize`)."""
    cfg, summary = result["config"], result["summary"]
    policies, auto = cfg["policies"], summary.get("auto")
    auto_by = {r["turn"]: r for r in auto["turns"]} if auto else {}
    auto_cols = ("auto read by", "retention", "auto / best", "faster path") if auto else ()
    lines = [
        "# kvlingo bench --conversation",
        "",
        f"`{result['pair']['source']}` reads for `{result['pair']['target']}` · "
        f"{cfg['turns']} turns, user turns of {', '.join(map(str, cfg['user_lengths']))} tokens "
        f"(cycled), answers of {cfg['answer_tokens']} tokens · cascade escalates "
        f"{cfg['escalation_rate']:.0%} (turns {result['escalated_turns']}) · backward translator: "
        f"{'yes' if result['backward'] else 'no (the small re-reads the large answers)'}",
        report.machine_line(result["machine"], result["software"]),
        "",
    ]  # fmt: skip
    if auto:
        lines += [f"Reader auto against the better of the large and the small reading (the small "
                  f"only where it keeps the retention threshold), per turn (goal <= 1.10): "
                  f"{auto['within_10pct']} of {len(auto['turns'])} turns within, worst "
                  f"{auto['worst_over_best']:.2f}; auto took the faster column's path on "
                  f"{auto['picked_faster']}. Times in ms.", ""]  # fmt: skip
    lines += md_table(("turn", "user tok", *(f"{p} TTFT" for p in policies), "small read",
                       "translate", *auto_cols), "r" * (4 + len(policies)) + "lrrl"[: len(auto_cols)])  # fmt: skip
    by_turn: dict[int, dict] = {}
    for x in result["turns"]:
        by_turn.setdefault(x["turn"], {})[x["policy"]] = x
    for t, row in sorted(by_turn.items()):
        sr, r = row.get("small reads", {}), auto_by.get(t)
        esc = " (esc.)" if row.get("cascade", {}).get("escalated") else ""
        lines.append(md_row((
            t, next(iter(row.values()))["user_tokens"],
            *(f"{1e3 * row[p]['ttft_s']:.0f}" + (esc if p == "cascade" else "") for p in policies),
            f"{1e3 * sr.get('read_s', 0):.0f}", f"{1e3 * sr.get('translate_s', 0):.0f}",
            *(() if not auto else ("", "", "", "") if r is None else (
                "small" if r["small_read"] else "large", number(r["retention"], ".2f"),
                f"{r['auto_over_best']:.2f}", "yes" if r["picked_faster"] else "no")),
        )))  # fmt: skip
    lines += ["", "Mean TTFT (ms) over turns after the first, by user-turn length:", "",
              *md_table(("user tok", *policies, "small / large TTFT"), "r" * (2 + len(policies)))]  # fmt: skip
    for n, row in summary["by_length"].items():
        lines.append(md_row((n, *(f"{row[p]['ttft_ms']:.0f}" for p in policies if p in row),
                             number(row.get("ttft_ratio_small_over_large"), ".2f"))))  # fmt: skip
    if summary.get("cascades"):
        lines += ["", "Cascades: the large model's TTFT once escalated (against one of its decode "
                  "steps) and the small model's decode speed:", "",
                  *md_table(("policy", "escalations", "escalation TTFT ms", "large step ms",
                             "TTFT / step", "small decode tok/s"), "lrrrrr")]  # fmt: skip
        for p, c in summary["cascades"].items():
            lines.append(md_row((
                p, c["escalations"], number(c["escalation_ttft_ms"], ".0f"),
                number(c["large_step_ms"], ".0f"), number(c["escalation_ttft_in_steps"], ".2f"),
                number(c["small_decode_tps"], ".1f"),
            )))  # fmt: skip
    return "\n".join(lines) + "\n"


def write_outputs(result: dict, out_dir: str | Path) -> dict[str, Path]:
    """conversation.json and conversation.md in `out_dir`."""
    return report.write(out_dir, "conversation", result, markdown_report(result))
