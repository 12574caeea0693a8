"""Raw KV transfer: the target reads the source's cache as it is, layer for layer.

Only defined when both caches have the same layout (layers, KV heads, head dim). Keys travel
RoPE-free and are rotated with the target's RoPE, which is the identity on the bytes when the two
RoPEs agree. Nothing is stored; what crosses the wire is the whole source cache.
"""

from __future__ import annotations

from mlx_kvlingo.eval.methods import (
    WIRE_BYTES,
    NotApplicable,
    anchored,
    as_float,
    rotate_layers,
    same_geometry,
)
from mlx_kvlingo.kv.translator import Side, target_dtype


class RawTransfer:
    name = "raw"
    key_cut = "post_norm"
    needs_hidden = ()

    def __init__(self, side: Side, native_first: bool = False):
        self.side, self.native_first = side, bool(native_first)

    @classmethod
    def for_pair(cls, pair, native_first: bool = False) -> RawTransfer:
        why = same_geometry(pair)
        if why:
            raise NotApplicable(f"raw transfer needs identical KV geometry: {why}")
        return cls(Side.of(pair.target.geometry), native_first)

    def translate(self, span, target):
        if Side.of(target.geometry) != self.side or span.keys.shape[0] != self.side.layers:
            raise ValueError(f"raw transfer made for {self.side}, model has {target.geometry}")
        dtype = target_dtype(target)
        keys = rotate_layers(as_float(span.keys), target, span.start)
        keys, values = [k.astype(dtype) for k in keys], [v.astype(dtype) for v in span.values]
        return anchored(keys, values, span, target, self.native_first)

    def label(self) -> str:
        return "raw"

    def wire_bytes_per_token(self) -> float:
        s = self.side
        return s.layers * s.kv_heads * (s.head_dim + s.value_dim) * WIRE_BYTES

    def nbytes(self) -> int:
        return 0
