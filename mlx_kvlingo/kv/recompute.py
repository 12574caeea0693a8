"""The target recomputes chosen tokens of a translated span, attending to the rest as it is.

A translated cache keeps the style of what the small model read and loses what the target's
deeper layers add to a token from its context. Run the target's own layers over a few chosen
positions of the span, at their true positions, attending causally to the whole cache
(translated K/V elsewhere, the recomputed ones at the chosen positions), and write their K/V
back in every layer: CacheBlend's selective recompute (Yao et al., 2024) on a translated
cache. Which positions: those the target's reading of the turn's last tokens attends to most
(`attended`), taken in turn with the small model's (`votes`), each with the rest of its
sentence (`Selection`).

The model's own layer modules run unchanged: a cache shim scatters the chosen positions' K/V
into the layer's buffer and hands back the whole span, and the layer's RoPE module is called
once per token row with that row's position (an array offset, bit for bit `rope(x, offset=p)`).
"""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from functools import lru_cache, reduce

import mlx.core as mx
import mlx.nn as nn


class _RowPositions(nn.Module):
    """The layer's RoPE applied to (1, H, n, D) rows at their own positions; records the
    rotated queries (the first call in each layer) when `keep` is set."""

    def __init__(self, rope, positions: mx.array, keep: list | None):
        super().__init__()
        self._rope, self._pos, self._keep, self._calls = rope, positions, keep, 0

    def __call__(self, x, offset=0):
        y = self._rope(x.transpose(2, 1, 0, 3), offset=self._pos).transpose(2, 1, 0, 3)
        if self._keep is not None and self._calls == 0:
            self._keep.append(y)
        self._calls += 1
        return y


class _ScatterCache:
    """Stands in for one layer's mlx-lm KVCache: writes the chosen positions, returns the span."""

    def __init__(self, cache, positions: mx.array, length: int):
        self._cache, self._pos, self.offset = cache, positions, length
        self.keys = None

    def update_and_fetch(self, keys, values):
        c = self._cache
        c.keys[..., self._pos, :] = keys.astype(c.keys.dtype)
        c.values[..., self._pos, :] = values.astype(c.values.dtype)
        self.keys = c.keys[..., : self.offset, :]
        return self.keys, c.values[..., : self.offset, :]


@contextmanager
def _rope_swapped(layer, rope):
    attn = layer.self_attn
    old = attn.rope
    attn.rope = rope
    try:
        yield
    finally:
        attn.rope = old


def _attention_peak(queries: mx.array, keys: mx.array, scale: float, mask: mx.array) -> mx.array:
    """The largest softmax weight any head and row of `queries` (1, H, n, D) puts on each
    position of `keys` (1, Hkv, T, D): (T,)."""
    H, Hkv = queries.shape[1], keys.shape[1]
    q = queries.reshape(1, Hkv, H // Hkv, queries.shape[2], queries.shape[3])
    s = (q * scale).astype(mx.float32) @ keys[:, :, None].astype(mx.float32).swapaxes(-1, -2)
    s = mx.where(mask, s, -mx.inf)
    return mx.softmax(s, axis=-1).max(axis=(0, 1, 2, 3))


def read_positions(model, cache: list, tokens: Sequence[int], positions: Sequence[int],
                   attention: bool = False) -> mx.array | None:  # fmt: skip
    """Run `model` over `tokens[p]` for the sorted `positions` p of the span its `cache`
    holds (cache.offset == len(tokens)), writing their K/V into every layer in place.

    With `attention`, returns the largest attention weight any head and row put on each span
    position in the deeper two thirds of the layers (T,): the retrieval heads there, not a
    sum that local and positional heads dominate.

    Positions are read `POSITIONS_CHUNK` at a time, in order, each chunk over the span up to
    its last position: a position attends only to those before it, which an earlier chunk has
    recomputed by then in every layer, so chunks read what one pass reads."""
    T = len(tokens)
    if any(c.offset != T for c in cache):
        raise ValueError(f"the cache holds {[c.offset for c in cache][:1]} tokens, not {T}")
    pos = sorted(set(int(p) for p in positions))
    if not pos:
        return mx.zeros((T,)) if attention else None
    if pos[0] < 0 or pos[-1] >= T:
        raise ValueError(f"positions must lie in [0, {T}), got {pos[0]}..{pos[-1]}")
    if len(pos) > POSITIONS_CHUNK:  # in order, a chunk at a time: the same reading (below)
        parts = [read_positions(model, cache, tokens, pos[i : i + POSITIONS_CHUNK], attention)
                 for i in range(0, len(pos), POSITIONS_CHUNK)]  # fmt: skip
        return reduce(mx.maximum, parts) if attention else None
    p, L = mx.array(pos), pos[-1] + 1  # no position here attends past the last of them
    mask = (mx.arange(L)[None] <= p[:, None])[None, None]  # (1, 1, n, L)
    h = model.model.embed_tokens(mx.array([tokens[i] for i in pos])[None])
    mass = mx.zeros((L,), dtype=mx.float32) if attention else None
    layers = model.model.layers
    for i, (layer, c) in enumerate(zip(layers, cache)):
        kept: list | None = [] if attention else None
        shim = _ScatterCache(c, p, L)
        with _rope_swapped(layer, _RowPositions(layer.self_attn.rope, p, kept)):
            h = layer(h, mask, shim)
        if attention and 3 * i >= len(layers):
            peak = _attention_peak(kept[0], shim.keys, layer.self_attn.scale, mask)
            mass = mx.maximum(mass, peak)
    mass = mx.pad(mass, (0, T - L)) if attention else None
    mx.eval(h, [(c.keys, c.values) for c in cache], *([mass] if attention else []))
    return mass


#: positions read at a time (`read_positions`): bounds the attention scores held at once
POSITIONS_CHUNK = 64

#: (before, after) neighbours an attended position brings: a fact is several tokens
SPREAD = (1, 6)
#: a sentence a peak brings is cut at this many tokens
SENTENCE_MAX = 32


@dataclass(frozen=True)
class Selection:
    """How `recompute_attended` picks the positions to recompute from its attention peaks.

    sentences: "rest", a peak brings one token before it and the rest of its sentence (to a
      sentence end or line break, at most `SENTENCE_MAX` tokens): a stated fact or a sentence
      to copy is retrieved whole or not at all; "whole", its whole sentence; "", the `spread`
      neighbours only.
    floor: at least this many tokens, where the share is above 0 and the span holds them: on a
      short turn 10% is a few tokens, less than one sentence.
    cap: a span longer than this recomputes as many tokens as one this long (None: no cap):
      what a question attends to does not grow with the document.
    template: a chat template's markup ("<|im_start|>user\n") is taken as a peak only after
      every other position: the target attends to it whatever a message says, as it does to
      position 0.
    votes: the small model's peaks, where its cache holds the span, are taken in turn with the
      target's (the small model read the span itself; the target reads translated keys).
    """

    sentences: str = "rest"
    floor: int = 24
    spread: tuple[int, int] = SPREAD
    template: bool = True
    cap: int | None = 2048
    votes: bool = True

    def __post_init__(self):
        if self.sentences not in ("", "rest", "whole"):
            raise ValueError(f"sentences must be '', 'rest' or 'whole' (got {self.sentences!r})")

    def count(self, share: float, span: int) -> int:
        """How many of `span` positions a `share` recomputes: share x min(span, cap), at
        least `floor`, at most `span`."""
        if share <= 0 or span <= 0:
            return 0
        capped = span if self.cap is None else min(span, self.cap)
        return min(span, max(int(round(share * capped)), self.floor))


@lru_cache(maxsize=4)
def special_ids(tokenizer) -> frozenset[int]:
    """The tokenizer's special tokens (a chat template's message markers among them): its
    named ones and the added tokens marked special."""
    ids = set(getattr(tokenizer, "all_special_ids", None) or ())
    added = getattr(tokenizer, "added_tokens_decoder", None) or {}
    ids.update(i for i, t in added.items() if getattr(t, "special", False))
    return frozenset(int(i) for i in ids)


def template_positions(tokens: Sequence[int], specials: frozenset[int],
                       ends: frozenset[int]) -> set[int]:  # fmt: skip
    """The positions of a chat template's markup: each special token and the rest of its line
    ("<|im_start|>user\n": the marker, the role, the line break)."""
    out, inside = set(), False
    for i, t in enumerate(tokens):
        if t in specials:
            out.add(i)
            inside = True
        elif inside:
            out.add(i)
            inside = t not in ends
    return out


@lru_cache(maxsize=4)
def sentence_ends(tokenizer) -> frozenset[int]:
    """The token ids whose text ends a sentence (".", "!" or "?", then perhaps closing quotes or
    brackets) or holds a line break; decoded in one batch by the Rust tokenizer where there is
    one."""
    fast = getattr(getattr(tokenizer, "_tokenizer", None), "_tokenizer", None)
    if hasattr(fast, "decode_batch"):
        ids = [[i] for i in range(fast.get_vocab_size(with_added_tokens=True))]
        texts = fast.decode_batch(ids, skip_special_tokens=False)
    else:
        texts = [tokenizer.decode([i]) for i in range(len(tokenizer.get_vocab()))]
    return frozenset(i for i, text in enumerate(texts)
                     if "\n" in text or text.rstrip(" \"')]\u201d\u2019").endswith((".", "!", "?")))  # fmt: skip


def _span(p: int, lo: int, end: int, spread: tuple[int, int], tokens, ends, whole) -> range:
    """The positions peak `p` brings, within [lo, end)."""
    a = max(lo, p - spread[0])
    if ends is None:
        return range(a, min(end, p + spread[1] + 1))
    q = p
    while q + 1 < min(end, p + SENTENCE_MAX) and tokens[q] not in ends:
        q += 1
    if whole:
        while a > max(lo, q + 1 - SENTENCE_MAX) and tokens[a - 1] not in ends:
            a -= 1
    return range(a, q + 1)


def attended(mass: mx.array, count: int, start: int = 0, end: int | None = None,
             spread: tuple[int, int] = SPREAD, tokens: Sequence[int] | None = None,
             ends: frozenset[int] | None = None, whole: bool = False,
             skip: set[int] | frozenset[int] = frozenset(),
             votes: mx.array | None = None) -> list[int]:  # fmt: skip
    """`count` positions of [start, end), sorted: position 0 where the range holds it (the
    attention sink every row reads, whatever it holds), then, in order of attention `mass`
    (with `votes`, a second reader's attention: the two orders in turn, first of `mass`), each
    position with `spread` = (before, after) neighbours, until `count` are taken. With
    the span's `tokens` and the sentence `ends` among them, a position brings the one before
    it and the rest of its sentence instead (`whole`: all of it). Positions in `skip` are
    taken as peaks only after all others."""
    end = mass.shape[0] if end is None else end
    count = max(0, min(count, end - start))
    chosen: list[int] = [0][: min(count, 1)] if start == 0 else []
    taken = set(chosen)
    lo = start + len(chosen)
    if count <= len(chosen):
        return chosen
    order = (mx.argsort(-mass[lo:end]) + lo).tolist()
    if votes is not None:
        other = (mx.argsort(-votes[lo:end]) + lo).tolist()
        order = [p for both in zip(order, other) for p in both]
    if skip:  # skipped positions come last: taken only where a share asks for (nearly) all
        order = [p for p in order if p not in skip] + [p for p in order if p in skip]
    for p in order:
        for q in _span(p, lo, end, spread, tokens, ends, whole):
            if len(taken) < count and q not in taken:
                taken.add(q)
        if len(taken) >= count:
            break
    return sorted(taken)


def recompute_attended(model, cache: list, tokens: Sequence[int], tail: int, share: float,
                       start: int = 0, selection: Selection = Selection(),
                       ends: frozenset[int] | None = None,
                       specials: frozenset[int] | None = None,
                       votes: mx.array | None = None) -> list[int]:  # fmt: skip
    """The target reads the span's last `tail` tokens over the translated rest, recomputes
    the `share` of [start, cut) its reading attended to most (cut: where the tail begins),
    picked by `selection` (with the tokenizer's `sentence_ends` and `special_ids`, and the
    small model's attention from the same tail, `votes`, where `selection.votes`), then reads
    the tail again over the recomputed positions. Returns the recomputed positions.

    The tail is read again so that its K/V, which the answer reads, are those of a reading over
    the recomputed positions; with share 1 the cache is then the target's own (within float
    rounding)."""
    if (selection.sentences or selection.template) and ends is None:
        raise ValueError("this selection needs the tokenizer's sentence_ends")
    if selection.template and specials is None:
        raise ValueError("this selection needs the tokenizer's special_ids")
    T = len(tokens)
    cut = max(1, T - tail)
    mass = read_positions(model, cache, tokens, range(cut, T), attention=True)
    skip = template_positions(tokens, specials, ends) if selection.template else frozenset()
    chosen = attended(mass, selection.count(share, cut - start), start=start, end=cut,
                      spread=selection.spread, tokens=tokens,
                      ends=ends if selection.sentences else None,
                      whole=selection.sentences == "whole", skip=skip,
                      votes=votes if selection.votes else None)  # fmt: skip
    if chosen:
        read_positions(model, cache, tokens, chosen)
        read_positions(model, cache, tokens, range(cut, T))
    return chosen


def large_reads(tail: int, recomputed: int) -> int:
    """Tokens the target reads at the end of a translated turn (`recompute_attended`): the
    tail, the recomputed positions and, where there are any, the tail again."""
    return tail + recomputed + (tail if recomputed else 0)
