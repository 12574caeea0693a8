"""Translating ahead within its budget (`CatchUp.ahead_tokens`): translation time stays within
its share of the small model's decode time, chunks large enough that the per-call cost is at
most a quarter of theirs, priced by the pair's forward translation cost."""

from types import SimpleNamespace

from mlx_kvlingo.conversation import session as sess
from mlx_kvlingo.conversation.reader import ReadCosts
from mlx_kvlingo.conversation.session import AHEAD_MIN, AHEAD_SHARE, CatchUp

import pytest
from helpers import fixed_costs


def simulate(decode_s, per_call, per_token, tokens, span, costs=None):
    """A fake clock: `tokens` small tokens of `decode_s` each; a chunk of n costs per_call +
    per_token n, spent and observed as `CatchUp.ahead_step` does."""
    c = SimpleNamespace(ahead_credit=0.0, read_costs=costs or ReadCosts())
    left, spent, chunks = span, 0.0, []
    for i in range(tokens):
        n = CatchUp.ahead_tokens(c, left, decode_s if i else None)
        if n:
            cost = per_call + per_token * n
            c.ahead_credit -= cost
            c.read_costs.forward.observe(n, cost)
            left, spent = left - n, spent + cost
            chunks.append(n)
    return spent, chunks, left


@pytest.mark.parametrize("per_call", [0.0, 0.005, 0.05])
def test_translation_time_stays_within_the_share(per_call):
    decode, per_token, tokens = 0.02, 0.0002, 400
    assert AHEAD_SHARE == 0.10
    spent, chunks, _ = simulate(decode, per_call, per_token, tokens, span=100_000)
    first = per_call + per_token * AHEAD_MIN  # the measuring chunk is paid before it is known
    assert spent <= 0.10 * decode * tokens + 2 * first
    assert spent >= 0.10 * decode * tokens * 0.6  # the budget is used, not left idle
    if per_call:  # a large per-call cost makes chunks grow past the smallest
        assert max(chunks) > 4 * AHEAD_MIN
        assert min(chunks[2:]) >= 3 * per_call / per_token - 1  # after two measuring chunks


def test_the_pairs_measured_forward_cost_prices_the_first_chunk():
    """With the forward cost already measured (the warm-up's), no measuring chunk: the first
    chunk waits until the credit covers it."""
    costs = fixed_costs(forward=(0.01, 0.001))
    spent, chunks, _ = simulate(0.02, 0.01, 0.001, tokens=100, span=10_000, costs=costs)
    assert chunks and min(chunks) >= 30 and spent <= 0.10 * 0.02 * 100


def test_short_span_is_finished_and_then_nothing_more(monkeypatch):
    monkeypatch.setattr(sess, "AHEAD_SHARE", 0.5)
    spent, chunks, left = simulate(0.02, 0.001, 0.0001, tokens=50, span=40)
    assert left == 0 and sum(chunks) == 40
