"""Shared test helpers: exact translators for the known-answer pair."""

from mlx_kvlingo.translator import Side, Translator, TranslatorConfig

import mlx.core as mx
import numpy as np


def exact_translator(pair, answer, key_cut="post_norm", dtype=mx.float32) -> Translator:
    src, tgt = pair.source.geometry, pair.target.geometry
    L = tgt.layers
    rows = tuple((layer,) for layer in range(L))
    config = TranslatorConfig(
        "mixing", Side.of(src), Side.of(tgt), rows, rows, key_cut=key_cut, bias=False
    )
    tr = Translator(config, dtype=dtype)
    tr.key["weight"] = mx.array(np.stack(answer["key_maps"])).astype(dtype)
    tr.value["weight"] = mx.array(np.stack(answer["value_maps"])).astype(dtype)
    return tr


def inverse(answer) -> dict:
    """The known pair's maps are orthogonal: the way back (large -> small) is the transpose."""
    return {
        "key_maps": [k.T for k in answer["key_maps"]],
        "value_maps": [v.T for v in answer["value_maps"]],
    }
