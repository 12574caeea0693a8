"""Shape-changing pairs, every variant and nu, dtypes, layer maps, RoPE round trips."""

from mlx_kvlingo.kv.cache import new_cache
from mlx_kvlingo.kv.capture import capture_from_cache, prefill
from mlx_kvlingo.kv.rope import unrotate
from mlx_kvlingo.kv.translator import (
    MARGIN,
    STRATEGIES,
    MapReading,
    Side,
    Translator,
    TranslatorConfig,
    k_norm_all,
    measure,
    nearest_layer_map,
    pick,
    rule,
)
from mlx_kvlingo.models.pair import TokenizerMismatchError, load_model, load_pair

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from helpers import handoff
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
    from mlx_kvlingo.data import synthetic as syn

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
        np.testing.assert_array_equal(
            np.array(v_anch[layer][..., 1:, :]), np.array(v_plain[layer][..., 1:, :])
        )
    # a span that does not start at 0 is translated as is
    later = capture_from_cache(pair.source, new_cache_with(pair, tokens), 3, len(tokens))
    later.tokens = tuple(tokens[3:])
    np.testing.assert_array_equal(
        np.array(anchored.translate(later, pair.target)[0][0]),
        np.array(plain.translate(later, pair.target)[0][0]),
    )


@pytest.mark.parametrize("variant", ["mixing", "headwise"])
def test_a_span_of_the_layers_read_translates_as_the_whole_span(models, variant):
    """The span a translator captures (`Translator.capture`: the source layers it reads,
    token-major for a mixing map) holds those layers of the whole span, and translates to
    the same K/V, bit for bit; a layer it does not read is not captured."""
    pair = load_pair(models["qwen3"], models["qwen3_moe" if variant == "mixing" else "qwen3"])
    s, t = pair.source.geometry, pair.target.geometry
    rows = tuple((s.layers - 1 - 2 * (i % 2),) for i in range(t.layers))  # out of order, some
    tr = Translator(TranslatorConfig(variant, Side.of(s), Side.of(t), rows, rows[::-1], bias=True))
    for params in (tr.key, tr.value):
        for k, v in params.items():
            params[k] = mx.random.normal(v.shape) * 0.1
    tokens = pair.tokenizer.encode(TEXT)
    cache = new_cache_with(pair, tokens)
    whole = capture_from_cache(pair.source, cache, 2, len(tokens))
    read = tr.source_layers_read
    assert read == tuple(sorted({r[0] for r in rows})) and len(read) < s.layers
    part = tr.capture(pair.source, cache, 2, len(tokens))
    assert part.layers == read and part.keys.shape[0] == len(read)
    for i, layer in enumerate(read):
        assert mx.array_equal(part.keys[i], whole.keys[layer]).item()
        assert mx.array_equal(part.values[i], whole.values[layer]).item()
    got, want = tr.translate(part, pair.target), tr.translate(whole, pair.target)
    for a, b in zip(got[0] + got[1], want[0] + want[1], strict=True):
        assert mx.array_equal(a, b).item()


def test_native_first_written_into_the_cache_equals_the_spliced_translation(models):
    """`decode.translate_into` writes the anchor token into the cache before the translated
    rest (no splice copy): the cache equals appending `translate`'s spliced arrays, bit for
    bit, for a batch of 1 and a one-token span; a plain translator is unaffected."""
    from dataclasses import replace

    from mlx_kvlingo.kv.cache import append_kv
    from mlx_kvlingo.kv.translator import append_translation

    pair = load_pair(models["qwen3"], models["qwen3_moe"])
    plain = random_translator(pair, "mixing", 2)
    anchored = Translator(replace(plain.config, native_first=True))
    anchored.key, anchored.value = plain.key, plain.value
    tokens = pair.tokenizer.encode(TEXT)
    for n in (len(tokens), 1):
        span = prefill(pair.source, tokens[:n], new_cache(pair.source))
        for tr in (anchored, plain):
            spliced, direct = new_cache(pair.target), new_cache(pair.target)
            append_kv(spliced, *tr.translate(span, pair.target))
            append_translation(pair.target, tr, span, direct)
            for a, b in zip(spliced, direct, strict=True):
                assert a.offset == b.offset == n
                assert mx.array_equal(a.keys[..., :n, :], b.keys[..., :n, :]).item()
                assert mx.array_equal(a.values[..., :n, :], b.values[..., :n, :]).item()


def new_cache_with(pair, tokens):
    cache = new_cache(pair.source)
    prefill(pair.source, tokens, cache)
    return cache


def reference_map(tr, x, kind):
    """The module docstring's formula, one target layer (and head) at a time, in numpy."""
    params = tr.key if kind == "key" else tr.value
    rows = tr.config.key_layers if kind == "key" else tr.config.value_layers
    w = np.array(params["weight"].astype(mx.float64))
    b = np.array(params["bias"].astype(mx.float64)) if "bias" in params else None
    x = np.array(x.astype(mx.float64))  # (Ls, B, Hs, T, D)
    out = []
    for t, layers in enumerate(rows):
        feats = np.concatenate([x[s] for s in layers], axis=-1)  # (B, Hs, T, nu*D)
        if tr.config.variant == "mixing":
            B, Hs, T, _ = feats.shape
            flat = np.concatenate(
                [x[s].transpose(0, 2, 1, 3).reshape(B, T, -1) for s in layers], -1
            )
            y = flat @ w[t] + (0 if b is None else b[t])
            out.append(y.reshape(B, T, tr.config.target.kv_heads, -1).transpose(0, 2, 1, 3))
        else:
            out.append(
                np.einsum("bhtk,hkd->bhtd", feats, w[t]) + (0 if b is None else b[t][:, None])
            )
    return np.stack(out)


@pytest.mark.parametrize(  # gather_mm, and the take fallback (CPU only: no float64 on a GPU)
    "dtype", [pytest.param(mx.float32, id="float32"), pytest.param(mx.float64, id="float64")]
)
@pytest.mark.parametrize("variant,nu,bias", [("mixing", 1, False), ("mixing", 2, True),
                                             ("headwise", 1, True), ("headwise", 3, False)])  # fmt: skip
@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("reads", ["all", "some"])
def test_map_features_match_the_formula_per_layer(
    models, variant, nu, bias, dtype, strategy, reads
):
    """The batched maps (no per-layer copies) equal the formula evaluated layer by layer,
    for a batch of 2 and a layer map that reads source layers out of order, by every way of
    reading the source (`MapReading`), whether the maps read every source layer or some."""
    tgt = models["qwen3_moe"] if variant == "mixing" else models["qwen3"]
    pair = load_pair(models["qwen3"], tgt)
    tr = random_translator(pair, variant, nu, bias=bias, dtype=dtype)
    Ls = pair.source.geometry.layers
    step = 3 if reads == "all" else 2  # tiny source: 4 layers; step 2 reads only 0 and 2...
    rows = tuple(
        tuple((step * t + 2 * j) % Ls for j in range(nu))
        for t in range(pair.target.geometry.layers)
    )
    if reads == "some":  # ...and 1 and 3 are left out of both maps
        assert {x for r in rows for x in r} < set(range(Ls))
    tr.config = TranslatorConfig(variant, tr.config.source, tr.config.target, rows, rows[::-1],
                                 bias=bias)  # fmt: skip
    s = pair.source.geometry
    x = mx.random.normal((Ls, 2, s.kv_heads, 7, s.head_dim)).astype(dtype)
    for kind in ("key", "value"):
        reading = MapReading({(kind, 14): strategy})
        got = np.array(tr.map_features(x, kind, reading=reading).astype(mx.float64))
        tol = 1e-12 if dtype == mx.float64 else 1e-5
        np.testing.assert_allclose(got, reference_map(tr, x, kind), rtol=tol, atol=tol)


def test_measured_reading_picks_a_strategy_per_kind_and_keeps_the_numbers(models):
    """`map_reading.measure` times every strategy, keeps the fastest per kind and token count
    (the rule's unless beaten by more than MARGIN), and the translation is the same (bit for
    bit) whichever it picked."""
    pair = load_pair(models["qwen3"], models["qwen3_moe"])
    tr = random_translator(pair, "mixing", 2)
    s = pair.source.geometry
    x = mx.random.normal((s.layers, 1, s.kv_heads, 9, s.head_dim))
    before = tr.map_features(x, "key")
    reading = measure(tr, n_tokens=(8, 32), rounds=1)
    assert tr.reading is reading
    assert set(reading.chosen) == {(k, n) for k in ("key", "value") for n in (8, 32)}
    for key, times in reading.timings.items():
        assert set(times) == set(STRATEGIES) and reading.chosen[key] == pick(times, rule(x.dtype))
    assert mx.array_equal(tr.map_features(x, "key"), before).item()


def test_k_norm_in_one_pass_is_the_per_layer_loop_bit_for_bit(models):
    pair = load_pair(models["qwen3"], models["qwen3_moe"])
    target = pair.target
    Lt = target.geometry.layers
    for t in range(Lt):  # distinct weights per layer, so a mix-up of layers shows
        target.attention(t).k_norm.weight = mx.random.normal((target.geometry.head_dim,))
    keys = mx.random.normal((Lt, 1, 7, target.geometry.kv_heads, target.geometry.head_dim))
    keys = keys.transpose(0, 1, 3, 2, 4)  # strided, as a mixing map's output
    loop = mx.stack([target.attention(t).k_norm(keys[t]) for t in range(Lt)])
    assert mx.array_equal(k_norm_all(target, keys), loop).item()
    assert not mx.array_equal(k_norm_all(target, keys[::-1]), loop).item()


@pytest.mark.parametrize("traditional", [False, True])
@pytest.mark.parametrize("dtype", [mx.float32, mx.float16, mx.bfloat16])
def test_fused_cpu_rope_is_the_op_bit_for_bit(traditional, dtype):
    """rope.rotate/unrotate (one compiled pass on the CPU) equal mx.fast.rope exactly, on a
    strided view (a translator's output) and at a large offset."""
    from mlx_kvlingo.kv.rope import rotate

    rope = nn.RoPE(64, traditional=traditional, base=1e6, scale=0.5)
    x = (mx.random.normal((3, 37, 2, 64)) * 10).astype(dtype).transpose(0, 2, 1, 3)
    for offset in (0, 5, 40_000):
        assert mx.array_equal(rotate(rope, x, offset), rope(x, offset=offset)).item()
        y = x.astype(mx.float32)
        want = mx.fast.rope(y, 64, traditional=traditional, base=1e6, scale=-0.5, offset=offset)
        assert mx.array_equal(unrotate(rope, y, offset), want).item()


def test_pick_keeps_the_rule_within_the_margin_and_leaves_it_when_clearly_beaten():
    # a near tie (noise) keeps the rule's strategy; a clear win does not
    near = {"in_place": 1.0, "gathered": 1.0 - MARGIN / 2}
    clear = {"in_place": 1.0, "gathered": 1.0 - 2 * MARGIN}
    assert pick(near, "in_place") == "in_place"
    assert pick(clear, "in_place") == "gathered"
    assert pick({"gathered": 1.0}, "in_place") == "gathered"  # the rule cannot run here


@pytest.mark.parametrize("src,tgt", [("qwen3", "qwen3_moe"), ("qwen3", "llama")])
@pytest.mark.parametrize("variant,nu,bias", [("mixing", 1, False), ("mixing", 2, True),
                                             ("headwise", 2, True)])  # fmt: skip
@pytest.mark.parametrize("key_cut", ["post_norm", "pre_norm"])
@pytest.mark.parametrize("traditional", [False, True])
def test_fused_translation_is_the_composed_one_bit_for_bit(models, src, tgt, variant, nu, bias,
                                                           key_cut, traditional):  # fmt: skip
    """`translate` on the CPU (sums, bias, k_norm's weights and RoPE in one compiled pass; a
    mixing map's output left token-major) equals the maps then `finish`, bit for bit, with
    and without k_norm (qwen3_moe has one, llama not), at an offset, and with RoPE on
    interleaved pairs (`traditional`, as the GGUF-converted demo models have it)."""
    pair = load_pair(models[src], models[tgt])
    pair.target.rope.traditional = traditional
    s, t = pair.source.geometry, pair.target.geometry
    if variant == "headwise" and s.kv_heads != t.kv_heads:
        pytest.skip("headwise needs equal head counts")
    tr = random_translator(pair, variant, nu, bias=bias, key_cut=key_cut)
    for layer in range(t.layers):  # distinct k_norm weights, so a mix-up of layers shows
        norm = getattr(pair.target.attention(layer), "k_norm", None)
        if norm is not None:
            norm.weight = mx.random.normal(norm.weight.shape)
    from mlx_kvlingo.kv.capture import SpanKV

    for start in (0, 9):
        keys = mx.random.normal((s.layers, 1, s.kv_heads, 11, s.head_dim))
        span = SpanKV(keys, mx.random.normal(keys.shape), start=start)
        assert tr._translate_fused(span, pair.target) is not None  # the fused path applies
        got = tr.translate(span, pair.target)
        want = tr.finish(*tr(span), span, pair.target)
        for a, b in zip(got[0] + got[1], want[0] + want[1], strict=True):
            assert a.shape == b.shape and mx.array_equal(a, b).item()
