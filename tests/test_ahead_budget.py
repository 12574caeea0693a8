"""The translate-ahead budget: translation time stays within its share of decode time."""

from mlx_kvlingo.conversation.budget import MIN_CHUNK, AheadBudget

import pytest


def simulate(budget, decode_s, per_call, per_token, tokens, span):
    """A fake clock: `tokens` small tokens of `decode_s` each; chunks cost per_call + per_token n."""
    left, spent, chunks = span, 0.0, []
    for i in range(tokens):
        if i:
            budget.earn(decode_s)
        n = budget.tokens(left)
        if n:
            cost = per_call + per_token * n
            budget.spent(n, cost)
            left, spent = left - n, spent + cost
            chunks.append(n)
    return spent, chunks, left


@pytest.mark.parametrize("per_call", [0.0, 0.005, 0.05])
def test_translation_time_stays_within_the_share(per_call):
    b = AheadBudget(share=0.10)
    decode, per_token, tokens = 0.02, 0.0002, 400
    spent, chunks, left = simulate(b, decode, per_call, per_token, tokens, span=100_000)
    first = per_call + per_token * MIN_CHUNK  # the measuring chunk is paid before it is known
    assert spent <= 0.10 * decode * tokens + 2 * first
    assert spent >= 0.10 * decode * tokens * 0.6  # the budget is used, not left idle
    if per_call:  # a large per-call cost makes chunks grow past the smallest
        assert max(chunks) > 4 * MIN_CHUNK


def test_short_span_is_finished_and_then_nothing_more():
    b = AheadBudget(share=0.5)
    spent, chunks, left = simulate(b, 0.02, 0.001, 0.0001, tokens=50, span=40)
    assert left == 0 and sum(chunks) == 40


def test_share_is_checked():
    for bad in (0.0, -0.1, 1.5):
        with pytest.raises(ValueError, match="share"):
            AheadBudget(share=bad)
