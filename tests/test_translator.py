"""Shape-changing pairs, every variant and nu, dtypes, layer maps, RoPE round trips."""

from mlx_kvlingo.capture import capture_from_cache, prefill
from mlx_kvlingo.decode import handoff
from mlx_kvlingo.kvcache import new_cache
from mlx_kvlingo.pair import TokenizerMismatchError, load_model, load_pair
from mlx_kvlingo.rope import unrotate
from mlx_kvlingo.translator import Side, Translator, TranslatorConfig, nearest_layer_map

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx_lm import stream_generate

TEXT = "class Namespace(object):\n    def __init__(self, **kwargs):\n        for name in kwargs:"


def random_translator(pair, variant, nu, bias=True, key_cut="post_norm", dtype=mx.float32, seed=0):
    s, t = pair.source.geometry, pair.target.geometry
    rows = tuple(tuple(r) for r in nearest_layer_map(s.layers, t.layers, nu))
    cfg = TranslatorConfig(variant, Side.of(s), Side.of(t), rows, rows, key_cut=key_cut, bias=bias)
    tr = Translator(cfg, dtype=dtype)
    mx.random.seed(seed)
    for params in (tr.key, tr.value):
        for k, v in params.items():
            params[k] = (mx.random.normal(v.shape) * 0.1).astype(dtype)
    return tr


@pytest.fixture(scope="module")
def models(tiny_dir):
    return {k: load_model(tiny_dir[k]) for k in ("qwen3", "qwen3_moe", "llama", "qwen2")}


@pytest.mark.parametrize(
    "src,tgt", [("qwen3", "qwen3_moe"), ("qwen3_moe", "qwen3"), ("llama", "qwen3")]
)
@pytest.mark.parametrize(
    "variant,nu", [("mixing", 1), ("mixing", 2), ("mixing", 3), ("headwise", 2)]
)
def test_shape_changing_pairs_decode(models, src, tgt, variant, nu):
    pair = load_pair(models[src], models[tgt])
    s, t = pair.source.geometry, pair.target.geometry
    if variant == "headwise" and s.kv_heads != t.kv_heads:
        with pytest.raises(ValueError, match="equal KV head counts"):
            random_translator(pair, variant, nu)
        return
    tr = random_translator(pair, variant, nu, key_cut="pre_norm")
    tokens = pair.tokenizer.encode(TEXT)
    h = handoff(pair, tr, tokens)
    assert h.target_cache[0].offset == len(tokens) - 1
    assert len(h.target_cache) == t.layers
    k, v = h.target_cache[0].keys_and_values()
    assert k.shape == (1, t.kv_heads, len(tokens) - 1, t.head_dim)
    out = list(
        stream_generate(
            pair.target.model,
            pair.tokenizer,
            mx.array(tokens[-1:]),
            max_tokens=5,
            prompt_cache=h.target_cache,
        )
    )
    assert len(out) == 5


def test_headwise_equals_blockdiagonal_mixing(models):
    """Headwise is mixing restricted to the block diagonal: same output, fewer weights."""
    pair = load_pair(models["qwen3"], models["qwen3"])
    g = pair.source.geometry
    hw = random_translator(pair, "headwise", 2)
    mix = random_translator(pair, "mixing", 2)
    L, H, D = g.layers, g.kv_heads, g.head_dim
    for name in ("key", "value"):
        w = np.array(getattr(hw, name)["weight"])  # (L, H, nu*D, D)
        full = np.zeros((L, 2 * H * D, H * D), np.float32)
        for h in range(H):
            for j in range(2):
                full[:, j * H * D + h * D : j * H * D + (h + 1) * D, h * D : (h + 1) * D] = w[
                    :, h, j * D : (j + 1) * D
                ]
        getattr(mix, name)["weight"] = mx.array(full)
        getattr(mix, name)["bias"] = getattr(hw, name)["bias"].reshape(L, H * D)
    cache = new_cache(pair.source)
    span = prefill(pair.source, pair.tokenizer.encode(TEXT), cache)
    a, b = hw(span), mix(span)
    for x, y in zip(a, b):
        np.testing.assert_allclose(np.array(x), np.array(y), atol=1e-5)


def test_bfloat16_target_and_weights(tiny_dir):
    pair = load_pair(
        load_model(tiny_dir["qwen3"]), load_model(tiny_dir["qwen3_moe"], dtype=mx.bfloat16)
    )
    tr = random_translator(pair, "mixing", 1, dtype=mx.bfloat16)
    h = handoff(pair, tr, pair.tokenizer.encode(TEXT))
    assert h.target_cache[0].keys.dtype == mx.bfloat16


def test_span_translation_is_tokenwise_and_positioned(models):
    """Translating [0, n) at once equals translating [0, m) then [m, n) at p0 = m."""
    pair = load_pair(models["qwen3"], models["qwen3_moe"])
    tr = random_translator(pair, "mixing", 2)
    cache = new_cache(pair.source)
    span = prefill(pair.source, pair.tokenizer.encode(TEXT), cache)
    whole_k, whole_v = tr.translate(span, pair.target)
    m = 11
    a = capture_from_cache(pair.source, cache, 0, m)
    b = capture_from_cache(pair.source, cache, m, span.end)
    ka, va = tr.translate(a, pair.target)
    kb, vb = tr.translate(b, pair.target)
    for layer in range(pair.target.geometry.layers):
        np.testing.assert_allclose(
            np.array(whole_k[layer]), np.concatenate([ka[layer], kb[layer]], axis=2), atol=1e-5
        )
        np.testing.assert_allclose(
            np.array(whole_v[layer]), np.concatenate([va[layer], vb[layer]], axis=2), atol=1e-5
        )
    # chunked translation (chunk smaller than the span) gives the same result
    ck, _ = tr.translate(span, pair.target, chunk=5)
    np.testing.assert_allclose(np.array(ck[0]), np.array(whole_k[0]), atol=1e-5)


def test_capture_unrotates_exactly(models):
    """Post-norm capture equals k_norm(k_proj(x)) computed directly, RoPE removed."""
    m = models["qwen3"]
    tokens = m.tokenizer.encode(TEXT)
    cache = new_cache(m)
    span = prefill(m, tokens, cache, cut="pre_norm")
    post = capture_from_cache(m, cache, 0, len(tokens))
    attn = m.attention(0)
    np.testing.assert_allclose(
        np.array(attn.k_norm(span.keys[0])), np.array(post.keys[0]), atol=1e-5
    )


@pytest.mark.parametrize("traditional", [False, True])
def test_rope_round_trip_large_offset(traditional):
    rope = nn.RoPE(64, traditional=traditional, base=1e6)
    x = mx.random.normal((1, 2, 8, 64))
    for off in (0, 1, 30000):
        np.testing.assert_allclose(
            np.array(unrotate(rope, rope(x, offset=off), off)), np.array(x), atol=2e-5
        )


def test_nearest_layer_map():
    assert nearest_layer_map(4, 4, 1) == [[0], [1], [2], [3]]
    assert nearest_layer_map(2, 4, 1) == [[0], [0], [1], [1]]
    assert nearest_layer_map(4, 2, 2) == [[0, 1], [2, 3]]
    with pytest.raises(ValueError):
        nearest_layer_map(2, 4, 3)


def test_tokenizer_mismatch_names_first_differing_id(tiny_dir, tmp_path):
    from mlx_kvlingo import synthetic as syn

    tok2 = syn.build_tokenizer(tmp_path / "tok2", vocab_size=400)
    other = syn.make_model_folder(tmp_path / "other", "qwen3", tok2)
    with pytest.raises(TokenizerMismatchError, match=r"first differing token id \d+"):
        load_pair(tiny_dir["qwen3"], other)


def test_native_first_token_is_the_targets_own(models):
    """With native_first, position 0 is the target's own K/V; the rest is the translation."""
    from dataclasses import replace

    pair = load_pair(models["qwen3"], models["qwen3_moe"])
    plain = random_translator(pair, "mixing", 1)
    anchored = Translator(replace(plain.config, native_first=True))
    anchored.key, anchored.value = plain.key, plain.value
    tokens = pair.tokenizer.encode(TEXT)
    span = prefill(pair.source, tokens, new_cache(pair.source))
    assert span.tokens == tuple(tokens)
    k_plain, v_plain = plain.translate(span, pair.target)
    k_anch, v_anch = anchored.translate(span, pair.target)
    native = new_cache(pair.target)
    pair.target.model(mx.array(tokens[:1])[None], cache=native)
    for layer in range(pair.target.geometry.layers):
        np.testing.assert_array_equal(
            np.array(k_anch[layer][..., :1, :]), np.array(native[layer].keys[..., :1, :])
        )
        np.testing.assert_array_equal(
            np.array(v_anch[layer][..., :1, :]), np.array(native[layer].values[..., :1, :])
        )
        np.testing.assert_array_equal(
            np.array(k_anch[layer][..., 1:, :]), np.array(k_plain[layer][..., 1:, :])
        )
    # a span that does not start at 0 is translated as is
    later = capture_from_cache(pair.source, new_cache_with(pair, tokens), 3, len(tokens))
    later.tokens = tuple(tokens[3:])
    np.testing.assert_array_equal(
        np.array(anchored.translate(later, pair.target)[0][0]),
        np.array(plain.translate(later, pair.target)[0][0]),
    )


def new_cache_with(pair, tokens):
    cache = new_cache(pair.source)
    prefill(pair.source, tokens, cache)
    return cache
