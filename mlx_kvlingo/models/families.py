"""Where each model family keeps its attention parts: the one place that knows.

mlx-lm caches hold keys after `k_norm` (when the family has one) and after RoPE, values
as raw `v_proj` output. Everything family-specific the runtime needs is in `FAMILIES`.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Family:
    model_type: str
    has_k_norm: bool
    #: attribute of a decoder layer holding the attention module
    attention: str = "self_attn"
    #: config key for the KV head count (falls back to the attention head count)
    kv_heads_key: str = "num_key_value_heads"


FAMILIES: dict[str, Family] = {
    f.model_type: f
    for f in (
        Family("llama", has_k_norm=False),
        Family("mistral", has_k_norm=False),
        Family("qwen2", has_k_norm=False),
        Family("qwen3", has_k_norm=True),
        Family("qwen3_moe", has_k_norm=True),
    )
}


class UnsupportedModelError(ValueError):
    pass


def family_of(model_type: str) -> Family:
    try:
        return FAMILIES[model_type]
    except KeyError:
        known = ", ".join(sorted(FAMILIES))
        raise UnsupportedModelError(
            f"model_type {model_type!r} is not supported for KV translation (known: {known})"
        ) from None
