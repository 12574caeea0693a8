"""The model families KV translation supports: the one place that knows.

mlx-lm caches hold keys after `k_norm` (when the family has one) and after RoPE, values as raw
`v_proj` output. Every supported family keeps its attention module in a decoder layer's
`self_attn` and its KV head count in `num_key_value_heads` (else the attention head count).
"""

from __future__ import annotations

#: model_type -> whether its attention normalizes the keys (`k_norm`)
HAS_K_NORM = {"llama": False, "mistral": False, "qwen2": False, "qwen3": True, "qwen2_moe": False,
              "qwen3_moe": True}  # fmt: skip


class UnsupportedModelError(ValueError):
    pass


def has_k_norm(model_type: str) -> bool:
    """Whether `model_type`'s keys pass a `k_norm`; `UnsupportedModelError` for another family."""
    try:
        return HAS_K_NORM[model_type]
    except KeyError:
        known = ", ".join(sorted(HAS_K_NORM))
        raise UnsupportedModelError(
            f"model_type {model_type!r} is not supported for KV translation (known: {known})"
        ) from None
