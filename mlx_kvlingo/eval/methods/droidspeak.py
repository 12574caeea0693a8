"""DroidSpeak: reuse the source's cache for most layers, recompute one contiguous block.

For two models of one architecture (a base and its fine-tune, say), the target takes the
source's K/V as they are for every layer outside the block [start, end), and recomputes the
block with its own weights: the source's hidden state at the input of layer `start` (the
residual stream, recorded during the source's prefill) runs through the target's layers
start..end-1, whose caches then hold native-style K/V for those layers. Layers after the block
still reuse the source's K/V, so the recomputed hidden state goes no further.

The block is chosen offline: every candidate block of the requested size is scored by
KL(native || DroidSpeak) on calibration examples, and the lowest wins; the scores are kept in
the file's metadata. On the wire: the source's K/V outside the block plus one hidden state per
token. Only for spans that start at position 0 (the block attends to the span alone).
"""

from __future__ import annotations

from mlx_kvlingo.eval.methods import (
    WIRE_BYTES,
    NotApplicable,
    anchored,
    as_float,
    mean_kl,
    prepare,
    rotate_layers,
    same_architecture,
)
from mlx_kvlingo.kv.translator import Side, target_dtype

from mlx_lm.models.base import create_attention_mask
from mlx_lm.models.cache import KVCache
from rich.progress import Progress


class DroidSpeak:
    name = "droidspeak"
    key_cut = "post_norm"

    def __init__(
        self, side: Side, hidden_size: int, block: tuple[int, int], profile=None,
        native_first: bool = False,
    ):  # fmt: skip
        start, end = int(block[0]), int(block[1])
        if not 0 <= start < end <= side.layers:
            raise ValueError(f"block [{start}, {end}) outside the model's {side.layers} layers")
        self.side, self.hidden_size, self.block = side, int(hidden_size), (start, end)
        self.profile = profile or {}
        self.native_first = bool(native_first)

    @classmethod
    def for_pair(cls, pair, block, native_first: bool = False) -> DroidSpeak:
        check(pair)
        side, hidden = Side.of(pair.target.geometry), pair.target.config["hidden_size"]
        return cls(side, hidden, block, native_first=native_first)

    @property
    def needs_hidden(self) -> tuple:
        return (("residual", self.block[0]),)

    def translate(self, span, target):
        if span.start != 0:
            raise ValueError("DroidSpeak recomputes its block over the span alone: start must be 0")
        start, end = self.block
        h = span.hidden[("residual", start)]
        dtype = target_dtype(target)
        keys = list(rotate_layers(as_float(span.keys), target, span.start))
        values = list(span.values)
        h = h.astype(dtype)
        caches = [KVCache() for _ in range(end - start)]
        mask = create_attention_mask(h, caches[0])
        T = span.length
        for c, layer in zip(caches, range(start, end)):
            h = target.layers[layer](h, mask, c)
            keys[layer], values[layer] = c.keys[..., :T, :], c.values[..., :T, :]
        keys, values = [k.astype(dtype) for k in keys], [v.astype(dtype) for v in values]
        return anchored(keys, values, span, target, self.native_first)

    def label(self) -> str:
        start, end = self.block
        return f"droidspeak recompute {end - start} (layers {start}-{end - 1})"

    def wire_bytes_per_token(self) -> float:
        s = self.side
        reused = s.layers - (self.block[1] - self.block[0])
        return (reused * s.kv_heads * (s.head_dim + s.value_dim) + self.hidden_size) * WIRE_BYTES

    def nbytes(self) -> int:
        return 0  # the target's own weights do the work


def check(pair) -> None:
    why = same_architecture(pair)
    if why:
        raise NotApplicable(f"DroidSpeak needs the same architecture: {why}")


def profile_blocks(
    pair, prepared, sizes, progress: bool = False, native_first: bool = False
) -> dict[int, dict[int, float]]:
    """KL(native || DroidSpeak) for every block of each size in `sizes`: {size: {start: kl}}.

    `prepared` must carry the source's residual stream at every candidate start."""
    L = pair.target.geometry.layers
    side, hidden = Side.of(pair.target.geometry), pair.target.config["hidden_size"]
    jobs = [(k, s) for k in sizes for s in range(L - k + 1)]
    out: dict[int, dict[int, float]] = {k: {} for k in sizes}
    with Progress(disable=not progress, transient=True) as bar:
        task = bar.add_task("droidspeak: profiling blocks", total=len(jobs))
        for k, s in jobs:
            m = DroidSpeak(side, hidden, (s, s + k), native_first=native_first)
            out[k][s] = mean_kl(m, pair, prepared)
            bar.advance(task)
    return out


def calibrate(
    pair, examples, layers: int | list[int] = 2, progress: bool = False, native_first: bool = False
) -> DroidSpeak | list[DroidSpeak]:
    """Pick, for each block size in `layers`, the block with the lowest KL on `examples`.

    Returns one DroidSpeak (an int `layers`) or a list (a list of sizes); profiling scores for
    every candidate are kept in each method's `profile`."""
    check(pair)
    sizes = [layers] if isinstance(layers, int) else list(layers)
    L = pair.target.geometry.layers
    if any(not 1 <= k <= L for k in sizes):
        raise ValueError(f"block sizes must be within 1..{L}")
    points = [("residual", s) for s in range(L)]
    prepared = [prepare(pair, ex, "post_norm", points) for ex in examples]
    scores = profile_blocks(pair, prepared, sizes, progress, native_first)
    out = []
    for k in sizes:
        best = min(scores[k], key=lambda s: (scores[k][s], s))
        m = DroidSpeak.for_pair(pair, (best, best + k), native_first)
        m.profile = {
            "criterion": "mean KL(native || droidspeak) on calibration examples",
            "examples": len(examples),
            "kl_by_start": {str(s): v for s, v in scores[k].items()},
        }
        out.append(m)
    return out[0] if isinstance(layers, int) else out
