"""The assistant-style calibration data: held-out questions never share a subject with training."""

import random

import pytest
from helpers import build_module


@pytest.fixture(scope="module")
def gen():
    return build_module("assistant_data")


def test_heldout_questions_use_heldout_subjects_only(gen):
    rng = random.Random(0)
    held = [[{"role": "user", "content": gen.question(rng, heldout=True)}] for _ in range(300)]
    train = [[{"role": "user", "content": gen.question(rng, heldout=False)}] for _ in range(300)]
    named = lambda convs: set().union(*(gen.named_subjects(c[0]["content"]) for c in convs))  # noqa: E731
    # each question's own subject comes from its split (arithmetic and opposites name none)
    free = ("plus", "times", "opposite")
    for c in held:
        q = c[0]["content"]
        assert any(map(gen._held, gen.named_subjects(q))) or any(w in q for w in free), q
    kept = gen.drop_shared_subjects(train, held)
    assert len(kept) > 200 and not named(kept) & named(train)
    # every list keeps items on both sides, so neither split runs dry
    for name in ("THINGS", "ACTIVITIES", "PLACES", "ADJECTIVES", "FEELINGS", "PETS"):
        items = gen._items(getattr(gen, name))
        assert any(map(gen._held, items)) and not all(map(gen._held, items)), name


def test_shared_subjects_are_dropped_from_heldout(gen):
    conv = lambda *qs: [{"role": "user", "content": q} for q in qs]  # noqa: E731
    train = [conv("Give me three tips for baking bread."), conv("Tell me about owls.")]
    held = [conv("Give me three facts about bread."), conv("Tell me about volcanoes."),
            conv("What is Rome like?", "Tell me about owls and glaciers.")]  # fmt: skip
    assert gen.drop_shared_subjects(train, held) == [held[1]]


def test_questions_are_varied_and_deterministic(gen):
    a = [gen.question(random.Random(1), heldout=False) for _ in range(1)]
    b = [gen.question(random.Random(1), heldout=False) for _ in range(1)]
    assert a == b
    rng = random.Random(2)
    qs = [gen.question(rng, heldout=False) for _ in range(400)]
    assert len(set(qs)) > 300
