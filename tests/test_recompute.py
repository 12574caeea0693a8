"""The target recomputing chosen positions of a translated span (`recompute`): exact against
its own prefill, only the chosen positions change, and the attention it reports is a softmax's."""

from mlx_kvlingo.data.content_tasks import build_tasks
from mlx_kvlingo.eval.content import (
    Chat,
    chat_kv,
    native_kv,
)
from mlx_kvlingo.kv import recompute
from mlx_kvlingo.kv.cache import append_kv, new_cache
from mlx_kvlingo.kv.recompute import (
    SENTENCE_MAX,
    Selection,
    attended,
    read_positions,
    recompute_attended,
    sentence_ends,
    special_ids,
    template_positions,
)
from mlx_kvlingo.models.pair import load_model

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


@pytest.mark.parametrize("chunk", [256, 5])
@pytest.mark.parametrize("kind", ["qwen3", "qwen3_moe", "llama"])
def test_recomputing_every_position_from_garbage_is_the_prefill(tiny_dir, kind, chunk, monkeypatch):
    """Every layer writes the chosen rows' K/V before they attend, so recomputing all
    positions over a cache of noise gives the model's own prefill: bit for bit in one pass,
    within rounding a chunk of positions at a time (5: four chunks; noise left in any layer
    would be off by order 1)."""
    monkeypatch.setattr(recompute, "POSITIONS_CHUNK", chunk)
    model = load_model(tiny_dir[kind])
    nk, nv = native_kv(model, TOKENS)
    cache = _cache_of(model, _garbage(nk), _garbage(nv))
    mass = read_positions(model.model, cache, TOKENS, range(len(TOKENS)), attention=True)
    for c, k, v in zip(cache, nk, nv):
        if chunk >= len(TOKENS):  # one pass: the prefill's own ops
            assert mx.array_equal(c.keys[..., : len(TOKENS), :], k).item()
            assert mx.array_equal(c.values[..., : len(TOKENS), :], v).item()
        else:  # the same reading, its products in other shapes: rounding apart
            assert mx.allclose(c.keys[..., : len(TOKENS), :], k, atol=1e-5, rtol=0).item()
            assert mx.allclose(c.values[..., : len(TOKENS), :], v, atol=1e-5, rtol=0).item()
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


def test_attended_with_sentence_ends_takes_the_rest_of_each_sentence():
    mass = mx.array([0.0, 1.0, 9.0, 3.0, 7.0, 50.0, 60.0, 2.0, 8.0, 0.5])
    tokens = [10, 11, 12, 99, 13, 14, 15, 16, 99, 17]  # 99 ends a sentence
    ends = frozenset({99})
    # the peak (6) brings one before it and the rest of its sentence (6-8), not two after
    assert attended(mass, 5, spread=(1, 2), tokens=tokens, ends=ends) == [0, 5, 6, 7, 8]
    # the next (5) brings the one before it (4); then 2 brings 1 and 2, and the count is reached
    assert attended(mass, 8, spread=(1, 2), tokens=tokens, ends=ends) == [0, 1, 2, 4, 5, 6, 7, 8]
    # a sentence without an end stops at the range's end or after SENTENCE_MAX tokens
    assert attended(mass, 9, start=5, end=8, spread=(0, 0), tokens=tokens, ends=ends) == [5, 6, 7]
    mass = mx.array([0.0, 5.0] + [0.0] * 58 + [4.0] + [0.0] * 39)
    got = attended(mass, SENTENCE_MAX + 3, spread=(0, 0), tokens=[1] * 100, ends=ends)
    assert got == [*range(1 + SENTENCE_MAX), 60, 61]


def test_skipped_positions_are_peaks_after_all_others():
    mass = mx.array([0.0, 1.0, 9.0, 3.0, 7.0, 50.0, 60.0, 2.0, 8.0, 0.5])
    assert attended(mass, 3, spread=(0, 0), skip={5, 6}) == [0, 2, 8]
    assert attended(mass, 10, spread=(0, 0), skip={5, 6}) == list(range(10))
    # a skipped position is still taken inside another peak's span
    assert attended(mass, 4, spread=(1, 1), skip={6}) == [0, 4, 5, 6]


def test_template_positions_are_the_markers_and_the_rest_of_their_line(known_pair):
    tok = known_pair.tokenizer
    toks = tok.apply_chat_template([{"role": "user", "content": "Hi there. Bye."}],
                                   add_generation_prompt=True)  # fmt: skip
    marked = template_positions(toks, special_ids(tok), sentence_ends(tok))
    text = "".join(tok.decode([t]) for i, t in enumerate(toks) if i not in marked)
    assert "Hi there. Bye." in text and "<|im_" not in text and "user" not in text, text
    assert toks[max(marked)] in sentence_ends(tok)  # the generation prompt's line break


def test_sentence_ends_are_the_tokens_ending_a_sentence_or_line(known_pair):
    tok = known_pair.tokenizer
    ends = sentence_ends(tok)
    ids = tok.encode("It rained. Did it? Yes!\nThe end", add_special_tokens=False)
    marked = [tok.decode([i]) for i in ids if i in ends]
    assert marked == [".", "?", "!", "\n"]

    class OneAtATime:  # no Rust tokenizer behind it: every id decoded alone
        get_vocab, decode = tok.get_vocab, tok.decode

    assert sentence_ends(OneAtATime()) == ends


def test_recompute_shares_zero_and_one_are_the_tail_read_and_native(known_pair, tiny_dir):
    """Share 0: exactly the target reading the tail itself; share 1: the target's own cache
    at every position (the positions before the tail recomputed, then the tail read again
    over them)."""
    pair = known_pair
    exact = exact_translator(pair, tiny_dir["known_answer"])
    zero = exact_translator(pair, {"key_maps": [m * 0 for m in _maps(exact, "key")],
                                   "value_maps": [m * 0 for m in _maps(exact, "value")]})  # fmt: skip
    task = build_tasks(pair.tokenizer, [TEXT], [64], 1, ("fact",), seed=2)[0]
    nk, _ = native_kv(pair.target, list(task.tokens[:-1]))
    tk, _ = chat_kv(pair, Chat(zero, 6, 0.0), task)
    ak, _ = chat_kv(pair, Chat(zero, 6, 1.0), task)
    cut = len(task.tokens) - 6
    for a, n in zip(ak, nk):  # share 1: every position the target's own
        assert mx.allclose(a, n, atol=1e-5).item()
    # share 0: the tail as read over the zeros, which is not the target's own
    assert not mx.allclose(tk[-1][..., cut:, :], nk[-1][..., cut:, :], atol=1e-3).item()
    assert not mx.allclose(ak[-1][..., :cut, :], tk[-1][..., :cut, :], atol=1e-3).item()
    # a share in between recomputes that many positions before the tail, and no others
    cache = _cache_of(pair.target, *[list(x) for x in _zero_kv(nk)])
    toks = list(task.tokens[:-1])
    peaks = Selection(sentences="", floor=0, template=False, cap=None)  # no sentences, no floor
    chosen = recompute_attended(pair.target.model, cache, toks, 5, 0.25, selection=peaks)
    assert len(chosen) == round(0.25 * (len(toks) - 5))
    assert chosen[0] == 0 and all(0 < p < len(toks) - 5 for p in chosen[1:])
    untouched = [p for p in range(len(toks) - 5) if p not in chosen]
    assert mx.all(cache[-1].keys[..., mx.array(untouched), :] == 0).item()
    assert not mx.any(cache[-1].keys[..., mx.array(chosen), :] == 0).item()


def _zero_kv(keys):
    return [mx.zeros_like(k) for k in keys], [mx.zeros_like(k) for k in keys]


def test_the_chats_selection_takes_whole_sentences_and_a_floor(known_pair):
    """`Selection()`, the chat's rule: at least its floor of positions, the peaks' sentences
    to their ends; a selection by sentences without the tokenizer's ends is refused."""
    pair = known_pair
    task = build_tasks(pair.tokenizer, [TEXT], [64], 1, ("fact",), seed=2)[0]
    toks = list(task.tokens[:-1])
    nk, nv = native_kv(pair.target, toks)
    ends = sentence_ends(pair.tokenizer)
    cut = len(toks) - 5
    specials = special_ids(pair.tokenizer)
    chosen = recompute_attended(pair.target.model, _cache_of(pair.target, nk, nv), toks, 5, 0.1,
                                ends=ends, specials=specials)  # fmt: skip
    assert len(chosen) == min(cut, Selection().floor) > round(0.1 * cut)
    assert Selection().count(0.1, 1000) == 100 and Selection().count(0.0, 1000) == 0
    # past `cap` tokens the count stays that of the cap; without one it is the share
    assert Selection().count(0.1, 8000) == Selection().count(0.1, 2048) == 205
    assert Selection(cap=None).count(0.1, 8000) == 800
    # every run of chosen positions after the sink ends a sentence or the span, but the one the
    # count cut
    runs = [[chosen[1]]]
    for p in chosen[2:]:
        runs[-1].append(p) if p == runs[-1][-1] + 1 else runs.append([p])
    open_ = [r for r in runs if r[-1] + 1 != cut and toks[r[-1]] not in ends]
    assert chosen[0] == 0 and len(runs) > 1 and len(open_) <= 1, runs
    # a chat template's markup is not taken as a peak: where a selection that may take it
    # does, the chat's rule takes other positions instead
    markup = template_positions(toks, specials, ends)
    mass = mx.ones((len(toks),)).at[mx.array(sorted(markup))].add(9.0)  # markup attended most
    plain = attended(mass, 24, end=cut, tokens=toks, ends=ends)
    rule = attended(mass, 24, end=cut, tokens=toks, ends=ends, skip=markup)
    before = {p for p in markup if p < cut}
    assert before <= set(plain) and len(set(rule) & before) < len(before) // 2, (plain, rule)
    with pytest.raises(ValueError, match="sentence_ends"):
        recompute_attended(pair.target.model, _cache_of(pair.target, nk, nv), toks, 5, 0.1)
    with pytest.raises(ValueError, match="special_ids"):
        recompute_attended(pair.target.model, _cache_of(pair.target, nk, nv), toks, 5, 0.1,
                           ends=ends)  # fmt: skip
    with pytest.raises(ValueError, match="sentences must be"):
        Selection(sentences="paragraph")


def test_the_small_models_votes_take_turns_with_the_targets_peaks():
    """`votes`: a second reader's peaks are taken in turn with the target's, first the
    target's: its best peak, then the votes' best, then the target's second."""
    mass = mx.array([0.0, 0.1, 0.9, 0.2, 0.8, 0.0, 0.0, 0.0])
    votes = mx.array([0.0, 0.0, 0.1, 0.0, 0.0, 0.0, 0.9, 0.0])
    alone = (0, 0)
    assert attended(mass, 3, spread=alone) == [0, 2, 4]
    assert attended(mass, 3, spread=alone, votes=votes) == [0, 2, 6]
    assert attended(mass, 4, spread=alone, votes=votes) == [0, 2, 4, 6]
    assert attended(mass, 3, spread=alone, votes=mass) == [0, 2, 4]  # agreeing: as alone
