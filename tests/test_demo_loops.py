"""The demo's answers do not loop with the default sampling (issue 12): the small model reads,
the large one answers from the translated cache, five everyday prompts, 200 tokens each."""

from collections import Counter

from mlx_kvlingo.config import ReaderPolicy

import pytest

pytestmark = pytest.mark.slow

PROMPTS = [
    "Hi! Can you suggest a name for my cat?",
    "What is the capital of France?",
    "How do I boil an egg?",
    "Give me three tips for sleeping better.",
    "Why is the sky blue?",
]
#: a loop repeats whole clauses: no span of SPAN tokens may occur more than MAX_REPEATS times
#: in one answer. A list repeats a shorter frame ("red has a maximum of 630 nm, green has a
#: maximum of ...") with new words inside every 8 tokens, and is not a loop.
SPAN, MAX_REPEATS = 8, 2


def worst_repeat(token_ids: list[int], n: int = SPAN) -> int:
    """How often the most frequent n-gram of `token_ids` occurs."""
    grams = Counter(tuple(token_ids[i : i + n]) for i in range(len(token_ids) - n + 1))
    return max(grams.values(), default=0)


def test_worst_repeat_counts_ngrams():
    assert worst_repeat([1, 2, 3, 4] * 5, n=4) == 5
    assert worst_repeat(list(range(50))) == 1
    assert worst_repeat([1, 2, 3]) == 0


def test_a_list_is_not_a_loop_and_a_repeated_clause_is():
    frame = [7, 8, 9, 10]  # "has a maximum of"
    listing = [t for item in range(6) for t in (100 + item, *frame, 200 + item, 11, 12)]
    assert worst_repeat(listing, n=4) == 6 and worst_repeat(listing) <= MAX_REPEATS
    assert worst_repeat(list(range(20, 32)) * 3) > MAX_REPEATS


@pytest.fixture(scope="module")
def runtime():
    from mlx_kvlingo import load

    return load(warmup=False)  # the demo pair, its default translators (reader="small"
    # below, so the warm-up's measured read rates are not needed)


def answer(
    runtime, prompt: str, model: str = "large", max_tokens: int = 200, **sampling
) -> tuple[list[int], str]:
    # answers from translated caches as they are: the large model reads only the last token
    # itself and recomputes none
    from mlx_kvlingo import Conversation

    conv = Conversation(
        runtime, policy=ReaderPolicy(reader="small", large_reads_last=1, recompute_share=0)
    )
    *_, done = conv.send(prompt, model, max_tokens=max_tokens, **sampling)
    assert done.model == model
    if model == "large":
        assert done.handoff.read.tokens > 0  # the small model read it
    ids = [t for t in conv.cache.tokens[-done.generation_tokens :]]
    return ids, done.handoff.text


def test_default_sampling_does_not_loop(runtime):
    worst = {}
    for i, prompt in enumerate(PROMPTS):
        ids, text = answer(runtime, prompt, seed=i)
        worst[prompt] = (worst_repeat(ids), text)
    assert all(w <= MAX_REPEATS for w, _ in worst.values()), worst


def test_the_check_fails_under_greedy_without_penalty(runtime):
    """The same check catches a loop from the demo's own models: the small model answering
    alone, greedy without penalty, repeats "I'm not sure" to the end. 100 tokens suffice: the
    loop repeats more than twice by token 75 (five times by 100, eleven by 200)."""
    ids, text = answer(runtime, PROMPTS[4], "small", 100, temp=0, repetition_penalty=1.0)
    assert len(ids) == 100 and worst_repeat(ids) > MAX_REPEATS, text
