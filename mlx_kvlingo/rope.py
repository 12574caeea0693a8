"""Rotate and un-rotate keys with a model's own RoPE module, at absolute positions."""

from __future__ import annotations

from dataclasses import dataclass

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
        return {
            "kind": self.kind,
            "dims": self.dims,
            "traditional": self.traditional,
            "base": self.base,
            "scale": self.scale,
        }


def _dims(rope: nn.Module) -> int:
    return getattr(rope, "dims", None) or rope.dim


def _input_scale(rope: nn.Module) -> float:
    # YarnRoPE scales the rotated part by `mscale`, SuScaledRoPE by `_scale`.
    return float(getattr(rope, "mscale", None) or getattr(rope, "_scale", None) or 1.0)


def describe(rope: nn.Module) -> RopeSpec:
    if isinstance(rope, nn.RoPE):
        return RopeSpec("default", rope.dims, rope.traditional, rope.base, rope.scale)
    if hasattr(rope, "_freqs"):
        return RopeSpec(
            type(rope).__name__, _dims(rope), bool(getattr(rope, "traditional", False)), None, 1.0
        )
    raise ValueError(f"unsupported RoPE module {type(rope).__name__}")


def rotate(rope: nn.Module, x: mx.array, offset: int) -> mx.array:
    """Apply the model's RoPE to `x` (..., T, D) whose first token sits at `offset`."""
    return rope(x, offset=offset)


def unrotate(rope: nn.Module, x: mx.array, offset: int) -> mx.array:
    """Exact inverse of `rotate`, computed in float32: negative angles, same frequencies."""
    x = x if x.dtype == mx.float64 else x.astype(mx.float32)
    dims = _dims(rope)
    if isinstance(rope, nn.RoPE):
        return mx.fast.rope(
            x, dims, traditional=rope.traditional, base=rope.base, scale=-rope.scale, offset=offset
        )
    if not hasattr(rope, "_freqs"):
        raise ValueError(f"cannot invert RoPE module {type(rope).__name__}")
    y = mx.fast.rope(
        x,
        dims,
        traditional=bool(getattr(rope, "traditional", False)),
        base=None,
        scale=-1.0,
        offset=offset,
        freqs=rope._freqs,
    )
    s = _input_scale(rope)
    return y if s == 1.0 else y.at[..., :dims].multiply(1.0 / s)
