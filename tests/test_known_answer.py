"""The known-answer pair: translated decoding must equal the target's own, token for token."""

from mlx_kvlingo.kv.cache import new_cache
from mlx_kvlingo.kv.translator import identity_translator
from mlx_kvlingo.models.pair import load_pair

import mlx.core as mx
import pytest
from helpers import exact_translator, handoff
from mlx_lm import stream_generate
from mlx_lm.sample_utils import make_sampler

PROMPT = "def parse_args(argv):\n    parser = argparse.ArgumentParser(description="
N_TOKENS = 120


@pytest.fixture(scope="module")
def pair(tiny_dir):
    return load_pair(tiny_dir["qwen3"], tiny_dir["known"])


def native_tokens(pair, tokens, sampler=None, seed=None):
    if seed is not None:
        mx.random.seed(seed)
    out = stream_generate(
        pair.target.model, pair.tokenizer, mx.array(tokens), max_tokens=N_TOKENS, sampler=sampler
    )
    return [r.token for r in out]


def translated_tokens(pair, tr, tokens, sampler=None, seed=None):
    h = handoff(pair, tr, tokens)
    if seed is not None:
        mx.random.seed(seed)
    out = stream_generate(
        pair.target.model,
        pair.tokenizer,
        mx.array(tokens[-1:]),
        max_tokens=N_TOKENS,
        prompt_cache=h.target_cache,
        sampler=sampler,
    )
    return [r.token for r in out]


@pytest.mark.parametrize("key_cut", ["post_norm", "pre_norm"])
def test_greedy_matches_native(pair, tiny_dir, key_cut):
    tokens = pair.tokenizer.encode(PROMPT)
    tr = exact_translator(pair, tiny_dir["known_answer"], key_cut=key_cut)
    native = native_tokens(pair, tokens)
    assert len(native) == N_TOKENS
    assert translated_tokens(pair, tr, tokens) == native


def test_seeded_sampling_matches_native(pair, tiny_dir):
    tokens = pair.tokenizer.encode(PROMPT)
    tr = exact_translator(pair, tiny_dir["known_answer"])
    sampler = make_sampler(temp=0.8, top_p=0.95)
    native = native_tokens(pair, tokens, sampler, seed=7)
    assert translated_tokens(pair, tr, tokens, sampler, seed=7) == native


def test_span_starting_after_zero(pair, tiny_dir):
    """The target reads its first 9 tokens itself; only [9, n-1) is translated at p0 = 9."""
    tokens = pair.tokenizer.encode(PROMPT)
    tr = exact_translator(pair, tiny_dir["known_answer"])
    h = handoff(pair, tr, tokens)
    p0 = 9
    tgt = new_cache(pair.target)
    pair.target.model(mx.array(tokens[:p0])[None], cache=tgt)
    from mlx_kvlingo.kv.capture import capture_from_cache
    from mlx_kvlingo.kv.translator import append_translation

    span = capture_from_cache(pair.source, h.source_cache, p0, len(tokens) - 1)
    assert span.start == p0
    append_translation(pair.target, tr, span, tgt)
    out = stream_generate(
        pair.target.model,
        pair.tokenizer,
        mx.array(tokens[-1:]),
        max_tokens=N_TOKENS,
        prompt_cache=tgt,
    )
    assert [r.token for r in out] == native_tokens(pair, tokens)


def test_raw_cache_does_not_match(pair):
    tokens = pair.tokenizer.encode(PROMPT)
    g = pair.source.geometry
    from mlx_kvlingo.kv.translator import Side, TranslatorConfig

    rows = tuple((layer,) for layer in range(g.layers))
    raw = identity_translator(TranslatorConfig("mixing", Side.of(g), Side.of(g), rows, rows))
    assert translated_tokens(pair, raw, tokens) != native_tokens(pair, tokens)
