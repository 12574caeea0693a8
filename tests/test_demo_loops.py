"""The demo's answers do not loop with the default sampling (issue 12): the small model reads,
the large one answers from the translated cache, five everyday prompts, 200 tokens each."""

from collections import Counter

import pytest

pytestmark = pytest.mark.slow

PROMPTS = [
    "Hi! Can you suggest a name for my cat?",
    "What is the capital of France?",
    "How do I boil an egg?",
    "Give me three tips for sleeping better.",
    "Why is the sky blue?",
]
MAX_REPEATS = 3  # no 4-gram of tokens may occur more often than this in one answer


def worst_repeat(token_ids: list[int], n: int = 4) -> int:
    """How often the most frequent n-gram of `token_ids` occurs."""
    grams = Counter(tuple(token_ids[i : i + n]) for i in range(len(token_ids) - n + 1))
    return max(grams.values(), default=0)


def test_worst_repeat_counts_ngrams():
    assert worst_repeat([1, 2, 3, 4] * 5) == 5
    assert worst_repeat(list(range(50))) == 1
    assert worst_repeat([1, 2, 3]) == 0


@pytest.fixture(scope="module")
def runtime():
    from mlx_kvlingo import Runtime

    return Runtime.load(warmup=False)  # the demo pair, its default translators (reader="small"
    # below, so the warm-up's measured read rates are not needed)


def answer(runtime, prompt: str, **sampling) -> tuple[list[int], str]:
    conv = runtime.new_conversation(reader="small")  # answers from translated caches
    done = conv.ask(prompt, max_tokens=200, sampling=sampling)
    assert done.model == "large" and done.timings.read_tokens > 0  # the small model read it
    ids = [t for t in conv._session.tokens[-done.timings.generation_tokens :]]
    return ids, done.text


def test_default_sampling_does_not_loop(runtime):
    worst = {}
    for i, prompt in enumerate(PROMPTS):
        ids, text = answer(runtime, prompt, seed=i)
        worst[prompt] = (worst_repeat(ids), text)
    assert all(w <= MAX_REPEATS for w, _ in worst.values()), worst


def test_the_check_fails_under_greedy_without_penalty(runtime):
    """The same check catches the loop that greedy decoding falls into on this pair."""
    ids, text = answer(runtime, PROMPTS[3], temp=0, repetition_penalty=1.0)
    assert worst_repeat(ids) > MAX_REPEATS, text
