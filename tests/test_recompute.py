"""The target recomputing chosen positions of a translated span (`recompute`): exact against
its own prefill, only the chosen positions change, and the attention it reports is a softmax's."""

from mlx_kvlingo.content_tasks import build_tasks
from mlx_kvlingo.kvcache import append_kv, new_cache
from mlx_kvlingo.measure.content import (
    TargetReadsTail,
    TargetRecomputes,
    native_kv,
    recompute_kv,
    tail_read_kv,
)
from mlx_kvlingo.pair import load_model
from mlx_kvlingo.recompute import attended, read_positions, recompute_attended

import mlx.core as mx
import pytest
from helpers import exact_translator
from test_content import TEXT, _maps

TOKENS = [5, 17, 42, 8, 99, 23, 61, 7, 30, 12, 77, 3, 54, 18, 90, 41]


def _cache_of(model, keys, values):
    cache = new_cache(model)
    append_kv(cache, keys, values)
    return cache


def _garbage(keys):
    return [mx.random.normal(k.shape, key=mx.random.key(i)) for i, k in enumerate(keys)]


@pytest.mark.parametrize("kind", ["qwen3", "qwen3_moe", "llama"])
def test_recomputing_every_position_from_garbage_is_the_prefill(tiny_dir, kind):
    """Every layer writes the chosen rows' K/V before they attend, so recomputing all
    positions over a cache of noise gives the model's own prefill, bit for bit."""
    model = load_model(tiny_dir[kind])
    nk, nv = native_kv(model, TOKENS)
    cache = _cache_of(model, _garbage(nk), _garbage(nv))
    mass = read_positions(model.model, cache, TOKENS, range(len(TOKENS)), attention=True)
    for c, k, v in zip(cache, nk, nv):
        assert mx.array_equal(c.keys[..., : len(TOKENS), :], k).item()
        assert mx.array_equal(c.values[..., : len(TOKENS), :], v).item()
    # peak softmax weights: in (0, 1], and 1 at the first token (its own row sees only it)
    assert mass.shape == (len(TOKENS),)
    assert mx.all(mass > 0).item() and mx.all(mass <= 1 + 1e-6).item()
    assert mass[0].item() == pytest.approx(1.0)


def test_only_the_chosen_positions_change_and_the_tail_reads_as_a_forward(tiny_dir):
    """Over a cache of noise, recomputing the last positions equals the model reading them
    itself on that cache; positions not chosen keep their noise."""
    model = load_model(tiny_dir["qwen3"])
    nk, nv = native_kv(model, TOKENS)
    gk, gv = _garbage(nk), _garbage(nv)
    cut = 11
    ref = _cache_of(model, [k[..., :cut, :] for k in gk], [v[..., :cut, :] for v in gv])
    model.model.model(mx.array(TOKENS[cut:])[None], cache=ref)
    cache = _cache_of(model, gk, gv)
    read_positions(model.model, cache, TOKENS, range(cut, len(TOKENS)))
    for c, r, g in zip(cache, ref, gk):
        assert mx.array_equal(c.keys[..., :cut, :], g[..., :cut, :]).item()
        assert mx.allclose(c.keys[..., : len(TOKENS), :], r.keys[..., : len(TOKENS), :],
                           atol=1e-5).item()  # fmt: skip


def test_bad_positions_and_a_cache_of_another_length_are_refused(tiny_dir):
    model = load_model(tiny_dir["qwen3"])
    nk, nv = native_kv(model, TOKENS)
    cache = _cache_of(model, nk, nv)
    with pytest.raises(ValueError, match="positions must lie in"):
        read_positions(model.model, cache, TOKENS, [3, len(TOKENS)])
    with pytest.raises(ValueError, match="holds"):
        read_positions(model.model, cache, TOKENS[:-1], [3])


def test_attended_takes_the_first_then_the_most_attended_with_their_neighbours():
    mass = mx.array([0.0, 1.0, 9.0, 3.0, 7.0, 50.0, 60.0, 2.0, 8.0, 0.5])
    alone = (0, 0)
    assert attended(mass, 3, end=5, spread=alone) == [0, 2, 4]
    assert attended(mass, 10, end=5, spread=alone) == [0, 1, 2, 3, 4]
    assert attended(mass, 1, end=5) == [0]
    assert attended(mass, 0, end=5) == []
    assert attended(mass, 2, start=1, end=5, spread=alone) == [2, 4]  # no sink outside the range
    # the peak (6) brings one before and two after it (5-8); the next (5, taken already)
    # brings the one before it (4), and the count is reached
    assert attended(mass, 6, spread=(1, 2)) == [0, 4, 5, 6, 7, 8]
    assert attended(mass, 4, start=3, end=9, spread=(1, 2)) == [5, 6, 7, 8]


def test_recompute_shares_zero_and_one_are_the_tail_read_and_native(known_pair, tiny_dir):
    """Share 0: exactly the target reading the tail itself; share 1: every position before
    the tail the target's own (its own prefill there), the tail as it read it over the rest."""
    pair = known_pair
    exact = exact_translator(pair, tiny_dir["known_answer"])
    zero = exact_translator(pair, {"key_maps": [m * 0 for m in _maps(exact, "key")],
                                   "value_maps": [m * 0 for m in _maps(exact, "value")]})  # fmt: skip
    task = build_tasks(pair.tokenizer, [TEXT], [64], 1, ("fact",), seed=2)[0]
    nk, _ = native_kv(pair.target, list(task.tokens[:-1]))
    tk, _ = tail_read_kv(pair, TargetReadsTail(zero, 5), task)
    rk, _ = recompute_kv(pair, TargetRecomputes(zero, 5, 0.0), task)
    ak, _ = recompute_kv(pair, TargetRecomputes(zero, 5, 1.0), task)
    cut = len(task.tokens) - 1 - 5  # share 1: every position before the tail is the target's
    for t, r, a, n in zip(tk, rk, ak, nk):  # own; the tail stays as read over the zeros
        assert mx.allclose(r, t, atol=1e-5).item()
        assert mx.allclose(a[..., :cut, :], n[..., :cut, :], atol=1e-5).item()
        assert mx.allclose(a[..., cut:, :], t[..., cut:, :], atol=1e-5).item()
    assert not mx.allclose(ak[-1][..., :cut, :], tk[-1][..., :cut, :], atol=1e-3).item()
    # a share in between recomputes that many positions before the tail, and no others
    cache = _cache_of(pair.target, *[list(x) for x in _zero_kv(nk)])
    toks = list(task.tokens[:-1])
    chosen = recompute_attended(pair.target.model, cache, toks, 5, 0.25)
    assert len(chosen) == round(0.25 * (len(toks) - 5))
    assert chosen[0] == 0 and all(0 < p < len(toks) - 5 for p in chosen[1:])
    untouched = [p for p in range(len(toks) - 5) if p not in chosen]
    assert mx.all(cache[-1].keys[..., mx.array(untouched), :] == 0).item()
    assert not mx.any(cache[-1].keys[..., mx.array(chosen), :] == 0).item()


def _zero_kv(keys):
    return [mx.zeros_like(k) for k in keys], [mx.zeros_like(k) for k in keys]
