"""Rotate and un-rotate keys with a model's own RoPE module, at absolute positions.

On the CPU backend `mx.fast.rope` has no kernel: MLX composes it from a dozen ops (slices,
products, a concatenate), several times the cost of one pass over the keys. There, for a
rotation over the full head (`dims` == head dim), the cos/sin the op itself would use are
read off it once per span (rotating a probe of ones), and applied in one compiled
elementwise pass: bit for bit the op's result (tests/test_translator.py checks it). A
translator's sums of products, bias and k_norm weights join that pass (`rotate_sum`).
"""

from __future__ import annotations

import functools
from dataclasses import asdict, dataclass

import mlx.core as mx
import mlx.nn as nn


@dataclass(frozen=True)
class RopeSpec:
    """What a translator file records about a model's RoPE (for display and checks)."""

    kind: str
    dims: int
    traditional: bool
    base: float | None
    scale: float

    def as_dict(self) -> dict:
        return asdict(self)


def describe(rope: nn.Module) -> RopeSpec:
    if isinstance(rope, nn.RoPE):
        return RopeSpec("default", rope.dims, rope.traditional, rope.base, rope.scale)
    if hasattr(rope, "_freqs"):
        dims = getattr(rope, "dims", None) or rope.dim
        traditional = bool(getattr(rope, "traditional", False))
        return RopeSpec(type(rope).__name__, dims, traditional, None, 1.0)
    raise ValueError(f"unsupported RoPE module {type(rope).__name__}")


def rotate(rope: nn.Module, x: mx.array, offset: int) -> mx.array:
    """Apply the model's RoPE to `x` (..., T, D) whose first token sits at `offset`."""
    y = rotate_sum(rope, [x], offset)
    return rope(x, offset=offset) if y is None else y


def unrotate(rope: nn.Module, x: mx.array, offset: int, token_major: bool = False) -> mx.array:
    """Exact inverse of `rotate`, computed in float32: negative angles, same frequencies.
    x is (..., T, D), or with `token_major` (..., T, H, D), and so is the result."""
    x = x if x.dtype == mx.float64 else x.astype(mx.float32)
    spec = describe(rope)
    dims = spec.dims
    args = dict(traditional=spec.traditional, base=spec.base, scale=-spec.scale)
    if not isinstance(rope, nn.RoPE):  # a RoPE kind with its own frequencies (`describe`)
        args["freqs"] = rope._freqs
    if _fused_applies(x, dims):
        y = _fused([x], dims, offset, args, token_major)
    elif token_major:
        y = mx.fast.rope(x.swapaxes(-3, -2), dims, offset=offset, **args).swapaxes(-3, -2)
    else:
        y = mx.fast.rope(x, dims, offset=offset, **args)
    # YarnRoPE scales the rotated part by `mscale`, SuScaledRoPE by `_scale`
    s = float(getattr(rope, "mscale", None) or getattr(rope, "_scale", None) or 1.0)
    return y if s == 1.0 else y.at[..., :dims].multiply(1.0 / s)


def unrotate_layers(ropes: list, xs: list, offset: int, token_major: bool = False) -> mx.array:
    """`mx.stack([unrotate(r, x, offset) for r, x in zip(ropes, xs)])` for layers' keys xs
    (B, H, T, D): (L, B, H, T, D), one un-rotation of the stacked keys (one table, one pass)
    where every layer has the same default RoPE. With `token_major` the result is a view of
    (L, B, T, H, D) memory, the layout a mixing map reads (no transposed copy later)."""
    xs = [x.swapaxes(1, 2) for x in xs] if token_major else xs
    if all(type(r) is nn.RoPE and describe(r) == describe(ropes[0]) for r in ropes):
        x = mx.stack(xs)
        y = unrotate(ropes[0], x.reshape(-1, *x.shape[2:]), offset, token_major).reshape(x.shape)
    else:
        y = mx.stack([unrotate(r, x, offset, token_major) for r, x in zip(ropes, xs, strict=True)])
    return y.swapaxes(2, 3) if token_major else y


# -- the CPU path: mx.fast.rope's own tables, one fused pass --------------------------------


def _fused_applies(x: mx.array, dims: int) -> bool:
    return (
        mx.default_device() == mx.cpu
        and x.ndim >= 3
        and dims == x.shape[-1]
        and x.dtype in (mx.float32, mx.float16, mx.bfloat16)  # what mx.compile fuses on the CPU
        and _compiles()
    )


def _fused(
    terms: list, dims: int, offset: int, args: dict, token_major: bool = False, scale=None
) -> mx.array:
    """mx.fast.rope(sum(terms) * scale, dims, offset=offset, **args) as cos/sin tables + one
    compiled pass; terms (..., T, D), or with `token_major` (..., T, H, D), and so is the result."""
    x = terms[0]
    cos, sin = _tables(x.shape[-3 if token_major else -2], dims, offset, args, x.dtype)
    if token_major:  # (T, 1, ...) broadcasts over the heads axis that follows T
        cos, sin = cos[:, None], sin[:, None]
    split = (dims // 2, 2) if args["traditional"] else (2, dims // 2)
    pairs = [t.reshape(*t.shape[:-1], *split) for t in terms]
    if scale is not None:
        pairs.append(scale.reshape(*scale.shape[:-1], *split))
    out = _rotate_pairs(cos, sin, pairs, args["traditional"], scale is not None)
    return out.reshape(*out.shape[:-2], dims)


def _tables(T: int, dims: int, offset: int, args: dict, dtype) -> tuple[mx.array, mx.array]:
    """The op's own cos and sin per position, laid out as `_rotate_*` read them.

    Rotating a probe whose pair "first" elements are 1 and "second" are 0 yields exactly the
    op's cos (first) and sin (second) for every position: 1*c - 0*s and 1*s + 0*c."""
    half = dims // 2
    trad = args["traditional"]
    probe = mx.zeros((1, 1, T, half, 2) if trad else (1, 1, T, 2, half), dtype=dtype)
    probe = (probe.at[..., 0].add(1) if trad else probe.at[..., 0, :].add(1)).reshape(1, 1, T, dims)
    r = mx.fast.rope(probe, dims, offset=offset, **args)
    r = r.reshape(T, half, 2) if trad else r.reshape(T, 2, half)
    c, s = (r[..., 0], r[..., 1]) if trad else (r[:, 0], r[:, 1])
    # out_first = x1*c - x2*s = x1*c + x2*(-s) and out_second = x2*c + x1*s, exactly
    axis = -1 if trad else -2
    return mx.stack([c, c], axis=axis), mx.stack([-s, s], axis=axis)


def rotate_sum(
    rope: nn.Module, terms: list, offset: int, scale: mx.array | None = None,
    token_major: bool = False,
) -> mx.array | None:  # fmt: skip
    """`rotate(rope, sum(terms) * scale, offset)` as one compiled pass on the CPU, or None
    where that pass does not apply (then sum and rotate as usual).

    `terms` (a translator's products and bias, broadcastable to one shape) are summed in
    order, so the result is bit for bit the sum, the product and the rotation done apart; with
    `token_major` they are (..., T, H, D) (a mixing map's output before its transpose to the
    cache's (..., H, T, D)) and so is the result, which saves writing a transposed copy."""
    if not isinstance(rope, nn.RoPE) or not _fused_applies(terms[0], rope.dims):
        return None  # (every term has terms[0]'s last axis: a map's products and bias)
    args = dict(traditional=rope.traditional, base=rope.base, scale=rope.scale)
    return _fused(terms, rope.dims, offset, args, token_major, scale)


def sum_scaled(has_scale: bool, parts) -> mx.array:
    """parts[0] + parts[1] + ... in order, times the last part with `has_scale`."""
    x = parts[0]
    for t in parts[1 : len(parts) - has_scale]:
        x = x + t
    return x * parts[-1] if has_scale else x


# shapeless: traced once, not again for every new span length (inside that turn's time to
# first token). A shapeless function cannot slice, so each part comes twice: as it is, and
# with the two elements of every rotated pair swapped (a view); both sums are the same adds.
@functools.partial(mx.compile, shapeless=True)
def _sum_rotate(cos, sin, has_scale, *parts):
    half = len(parts) // 2
    x = sum_scaled(has_scale, parts[:half])
    return x * cos + sum_scaled(has_scale, parts[half:]) * sin


def _rotate_pairs(cos, sin, pairs: list, traditional: bool, has_scale: bool) -> mx.array:
    """pairs: (..., D/2, 2) if traditional else (..., 2, D/2), the last one the scale."""
    if traditional:
        # a reversed view would send MLX's compiled CPU kernel down its slow strided loop:
        # sum first, swap the pairs in one copy, then rotate contiguous arrays (same adds)
        x = pairs[0] if len(pairs) == 1 else summed_scaled(has_scale, *pairs)
        return _rotate(x, mx.contiguous(x[..., ::-1]), cos, sin)
    swapped = [p[..., ::-1, :] for p in pairs]
    return _sum_rotate(cos, sin, has_scale, *pairs, *swapped)


@functools.partial(mx.compile, shapeless=True)
def summed_scaled(has_scale, *parts):
    return sum_scaled(has_scale, parts)


@functools.partial(mx.compile, shapeless=True)
def _rotate(x, swapped, cos, sin):
    return x * cos + swapped * sin


@functools.cache
def _compiles() -> bool:
    """mx.compile on the CPU builds C++ kernels at run time; without a compiler, don't fuse."""
    try:
        x = mx.ones((1, 1, 2, 2, 2))
        mx.eval(_rotate_pairs(mx.ones((2, 2, 2)), mx.zeros((2, 2, 2)), [x], False, False))
        return True
    except Exception:  # noqa: BLE001 - any failure means: use mx.fast.rope as it is
        return False
