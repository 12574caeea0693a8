"""Opt-in, CPU only: run mlx-lm's `SwitchGLU` as one plain GEMM per expert for many tokens.

MLX's CPU backend runs mlx-lm's `mx.gather_mm` far below its GEMM speed. From
`MIN_ASSIGNMENTS` token-expert assignments (mlx-lm's sort threshold) the tokens of each expert
are grouped on the host and multiplied in one GEMM: the same function up to rounding order.
Decode steps and quantized experts keep the original path; on Metal nothing changes.
"""

from __future__ import annotations

from contextlib import contextmanager

import mlx.core as mx
import numpy as np
from mlx_lm.models import switch_layers
from mlx_lm.models.switch_layers import SwitchLinear

_original = switch_layers.SwitchGLU.__call__
#: token-expert assignments from which the per-expert path is used (mlx-lm's sort threshold)
MIN_ASSIGNMENTS = 64


def _expert(linear, e: int, x: mx.array) -> mx.array:
    y = x @ linear["weight"][e].T
    if "bias" in linear:
        y = y + linear["bias"][e]
    return y


def switch_glu_per_expert(self, x: mx.array, indices: mx.array) -> mx.array:
    """`SwitchGLU.__call__` with one GEMM per used expert: x (..., D), indices (..., k)
    -> (..., k, D), the output for each of the token's k experts, as mlx-lm returns it."""
    projections = (self.up_proj, self.gate_proj, self.down_proj)
    if indices.size < MIN_ASSIGNMENTS or any(type(p) is not SwitchLinear for p in projections):
        return _original(self, x, indices)
    shape, k, D = indices.shape, indices.shape[-1], x.shape[-1]
    xf = x.reshape(-1, D)
    flat = np.array(indices).reshape(-1)  # evaluates the router: the host groups tokens
    order = np.argsort(flat, kind="stable")
    counts = np.bincount(flat, minlength=self.up_proj["weight"].shape[0])
    parts, start = [], 0
    for e in np.flatnonzero(counts):
        rows = order[start : start + counts[e]]
        start += counts[e]
        xe = xf[mx.array(rows // k)]
        h = self.activation(_expert(self.up_proj, e, xe), _expert(self.gate_proj, e, xe))
        parts.append(_expert(self.down_proj, e, h))
    y = mx.concatenate(parts)[mx.array(np.argsort(order))]  # back in token order
    return y.reshape(*shape, -1)


def enabled() -> bool:
    return switch_layers.SwitchGLU.__call__ is switch_glu_per_expert


@contextmanager
def per_expert_loop(active: bool = True):
    """Use the per-expert path inside the block when `active` and on the CPU (on a GPU
    `gather_mm` is fast); yields whether it is in use."""
    before = switch_layers.SwitchGLU.__call__
    if active and mx.default_device().type != mx.gpu:
        switch_layers.SwitchGLU.__call__ = switch_glu_per_expert
    try:
        yield enabled()
    finally:
        switch_layers.SwitchGLU.__call__ = before
