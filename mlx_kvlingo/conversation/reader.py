"""Who reads a turn for the large model, decided once per turn into one `Decision`.

Invariant: where the small model reads for the large one, it reads conversation[:cut] and the
large reads conversation[cut : upto + 1] itself, cut = upto + 1 - tail (never below what the
large holds); `Decision` carries that cut, whether the large recomputes, and why, from the
choice to the hand-off (session.py), so nothing asks twice. Reader "auto" takes the small path
where its predicted TTFT (`rates.Paths.small`) beats the large's own read (`Paths.large`) by
more than READER_MARGIN; a tie, or no timing yet, goes to the token rule; a measured retention
under `min_retention` turns the small path down. The tail and the recompute are dropped (the
recompute first) where they would take the small path past TAIL_BUDGET x the plain handoff's
TTFT and TAIL_ALLOWANCE_S more.

The functions read the `state` they are handed (the session's `CatchUp`: both translators,
`models`, `mode`, `policy`, `read_costs`, `retention`) and change nothing.
"""

from __future__ import annotations

from dataclasses import dataclass

from mlx_kvlingo.conversation.rates import Paths
from mlx_kvlingo.conversation.records import share
from mlx_kvlingo.kv.recompute import Selection

#: the large model's read of the turn's last tokens may add to the small path's predicted TTFT
#: the plain handoff's own TTFT or TAIL_ALLOWANCE_S, whichever is more
TAIL_BUDGET = 2.0
TAIL_ALLOWANCE_S = 0.5
#: reader auto: predicted TTFTs within this fraction of each other are a tie (the token rule)
READER_MARGIN = 0.05
#: which translated tokens the large model recomputes: each attention peak with the rest of its
#: sentence (weights/QUALITY.md, "Sentences, not neighbours")
RECOMPUTE_SELECTION = Selection()


@dataclass(frozen=True)
class Decision:
    """One turn's reading, decided by `choose` and carried through the hand-off."""

    small: bool = False  # the small model reads conversation[:cut] for the large one
    note: str = ""  # why the large reads itself (or reads less), for the status line
    paths: Paths | None = None  # the lengths of both ways (None: no prediction applies)
    cut: int = 0  # where the small model's reading stops (`small` only)
    recompute: bool = False  # the large recomputes `recompute_share` of the translated span
    retention: float | None = None  # the measured retention that turned the small path down


def choose(state, name: str, upto: int) -> Decision:
    """Does the small model read [large's held, upto) for `name` this turn (reader policy,
    see session.py), where does it stop, and does the large recompute?"""
    if name != "target" or state.forward is None or state.mode == "reprefill":
        return Decision()  # reprefill is the reference: the answering model reads it all
    p, (tail, recompute) = state.policy, _reading(state, upto)
    paths = paths_with(state, upto, tail, recompute) if state.mode == "alternation" else None
    held = min(state.models["target"].held, upto)
    cut = max(held, upto + 1 - tail)
    if cut <= state.models["target"].held:  # one way only
        why = f"the turn is within the {p.large_reads_last} tok the large reads itself"
        return Decision(note="" if p.reader == "self" else why)
    small, why, kept = _rule(state, upto, paths)
    count = recompute_count(state, cut - held)  # 0 unless alternation
    over = f"would take over {TAIL_BUDGET:g}x this TTFT and {TAIL_ALLOWANCE_S:g} s more"
    if small and p.large_reads_last > 1 and tail == 1:
        why = f"the large reads the last token only: reading the last {p.large_reads_last} tok"
        why += f" {over}"
    elif small and count and not recompute:
        why = f"no recompute: recomputing {p.recompute_share:.0%} of the turn {over}"
    return Decision(small, why, paths, cut if small else 0, small and recompute and count > 0, kept)


def _rule(state, upto: int, paths: Paths | None) -> tuple[bool, str, float | None]:
    """The reader policy's choice: (the small model reads, why the large reads itself, the
    retention that turned the small path down). Reader "auto" decides by time (the token rule
    on a tie or before any timing), then turns a small path down where its measured retention
    is under `min_retention`."""
    p = state.policy
    if p.reader in ("small", "self"):
        return p.reader == "small", "", None
    held = state.models["target"].held
    rule = held == 0 or upto - held >= p.reader_min_tokens
    under = f"the large reads turns under {p.reader_min_tokens} tok"
    if p.reader == "tokens":
        return rule, "" if rule else f"reader tokens: {under}", None
    large = None if paths is None else paths.large(state.read_costs)
    small = None if paths is None else paths.small(state.read_costs)
    if large is None or small is None:
        small_reads, why = rule, "" if rule else f"reader auto, not timed yet: {under}"
    elif abs(large - small) <= READER_MARGIN * min(large, small):
        small_reads, why = rule, "" if rule else f"reader auto, a tie: {under}"
    else:
        small_reads, why = small < large, "" if small < large else "reader auto: the faster"
    r = state.retention  # what the small path keeps at this length (None: not measured)
    kept = None if r is None or not p.min_retention else r.expected(upto + 1 - held)
    if small_reads and kept is not None and kept < p.min_retention:
        return False, (f"reader auto: the small path keeps ≈{share(kept)} of the content at "
                       f"{upto + 1 - held:,} tok, under {p.min_retention:g}"), kept  # fmt: skip
    return small_reads, why, None


def _reading(state, upto: int) -> tuple[int, bool]:
    """How much the large model reads itself where the small reads for it: (its last
    tokens, whether it recomputes). `large_reads_last` and `recompute_share`, unless that
    is predicted to take more than `TAIL_BUDGET` times the plain handoff's TTFT and
    `TAIL_ALLOWANCE_S` more than it; then without the recompute, then the last token only
    (the plain handoff itself)."""
    k, share = state.policy.large_reads_last, state.policy.recompute_share > 0
    ways = [(k, share), *([(k, False)] if share else []), *([(1, False)] if k > 1 else [])]
    if len(ways) == 1 or state.forward is None or state.mode != "alternation":
        return ways[0]
    a = paths_with(state, upto, 1, False).small(state.read_costs)
    if a is None:
        return ways[0]
    limit = max(TAIL_BUDGET * a, a + TAIL_ALLOWANCE_S)
    for tail, recompute in ways:
        b = paths_with(state, upto, tail, recompute).small(state.read_costs)
        if b is None or b <= limit:
            return tail, recompute
    return 1, False


def paths_with(state, upto: int, tail: int, recompute: bool = True) -> Paths:
    """The lengths of both ways where the large reads the last `tail` tokens itself (and
    recomputes, where `recompute`)."""
    th, sh = min(state.models["target"].held, upto), min(state.models["source"].held, upto)
    cut = max(th, upto + 1 - tail)
    return Paths(upto + 1 - th, max(th - sh, 0), max(cut - max(sh, th), 0),
                 state.backward is not None, upto + 1 - cut,
                 recompute_count(state, cut - th) if recompute else 0, th, sh)  # fmt: skip


def recompute_count(state, translated: int) -> int:
    """How many of `translated` tokens the large model recomputes (`recompute_share`)."""
    if state.mode != "alternation":
        return 0
    return RECOMPUTE_SELECTION.count(state.policy.recompute_share, translated)
