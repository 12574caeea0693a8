"""Quantized KV transfer: what crosses the wire is quantized to b bits, then dequantized.

Wraps another method (raw transfer or a KV-Lingo translator, or any CacheMethod): the source's
RoPE-free K/V (and hidden states, if the inner method reads any) are quantized per group of
`group_size` values along the last axis with `mx.quantize` (affine: a float16 scale and bias per
group), dequantized on arrival, and handed to the inner method. Bytes per token on the wire are
the inner method's elements times (bits / 8 + 4 / group_size).
"""

from __future__ import annotations

from mlx_kvlingo.eval.methods import WIRE_BYTES, SourceSpan

import mlx.core as mx

BITS = (2, 3, 4, 5, 6, 8)


def group_for(dim: int, group_size: int) -> int:
    """The group size used for a last axis of `dim`: `group_size`, else the largest of 64, 32
    that divides it."""
    for g in (group_size, 64, 32):
        if g <= dim and dim % g == 0:
            return g
    raise ValueError(f"cannot quantize a last axis of {dim} in groups of 32 or 64")


def fake_quantize(x: mx.array, bits: int, group_size: int) -> mx.array:
    """Quantize then dequantize `x` along its last axis (what the receiver gets)."""
    g = group_for(x.shape[-1], group_size)
    shape, dtype = x.shape, x.dtype
    flat = x.reshape(-1, shape[-1]).astype(mx.float32)
    w, s, b = mx.quantize(flat, group_size=g, bits=bits)
    return mx.dequantize(w, s, b, group_size=g, bits=bits).reshape(shape).astype(dtype)


class Quantized:
    name = "quantized"

    def __init__(self, inner, bits: int = 4, group_size: int = 64):
        if bits not in BITS:
            raise ValueError(f"bits must be one of {BITS}, got {bits}")
        self.inner, self.bits, self.group_size = inner, int(bits), int(group_size)

    @property
    def key_cut(self) -> str:
        return self.inner.key_cut

    @property
    def needs_hidden(self) -> tuple:
        return self.inner.needs_hidden

    def wire(self, span) -> SourceSpan:
        """The span as the receiver sees it after quantization."""
        q = lambda x: fake_quantize(x, self.bits, self.group_size)  # noqa: E731
        hidden = {k: q(h) for k, h in getattr(span, "hidden", {}).items()}
        return SourceSpan(q(span.keys), q(span.values), span.start, span.tokens, hidden=hidden)

    def translate(self, span, target):
        return self.inner.translate(self.wire(span), target)

    def label(self) -> str:
        return f"{self.inner.label()} @{self.bits}-bit"

    def wire_bytes_per_token(self) -> float:
        elements = self.inner.wire_bytes_per_token() / WIRE_BYTES
        return elements * (self.bits / 8 + 2 * WIRE_BYTES / self.group_size)

    def nbytes(self) -> int:
        return self.inner.nbytes()
