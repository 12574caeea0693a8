"""Composing a translator through a related target (weights/build/compose_moe.py)."""

from mlx_kvlingo.kv.translator import Side, Translator, TranslatorConfig
from mlx_kvlingo.models.pair import load_model

import mlx.core as mx
import numpy as np
import pytest
from helpers import build_module


@pytest.fixture(scope="module")
def compose():
    return build_module("compose_moe")


class Ex:
    def __init__(self, ids):
        self.prefix = tuple(int(i) for i in ids)


def test_key_bridges_recover_a_known_map(compose, tiny_dir):
    """A target whose k_proj is A^T times the other's: the fit returns A, layer by layer."""
    dense, other = load_model(tiny_dir["qwen3"]), load_model(tiny_dir["qwen3"])
    rng = np.random.default_rng(0)
    known = []
    for layer in other.model.model.layers:
        w = layer.self_attn.k_proj.weight
        a = rng.normal(size=(w.shape[0], w.shape[0])).astype(np.float32) / np.sqrt(w.shape[0])
        layer.self_attn.k_proj.weight = mx.array(a.T) @ w
        known.append(a)
    examples = [Ex(rng.integers(3, 200, size=48)) for _ in range(4)]
    bridges = compose.fit_key_bridges(dense, other, examples, alpha=1e-9)
    for got, want in zip(bridges, known, strict=True):
        np.testing.assert_allclose(got, want, atol=2e-3)
    # the recorders are gone: the model computes as before
    assert all(type(x.self_attn.k_proj).__name__ != "Recorder" for x in other.model.model.layers)


def test_composed_maps(compose):
    side = Side(3, 2, 4, 4)
    rows = tuple((i,) for i in range(3))
    tr = Translator(TranslatorConfig("mixing", side, side, rows, rows, bias=True))
    rng = np.random.default_rng(1)
    for p in (tr.key, tr.value):
        p["weight"] = mx.array(rng.normal(size=p["weight"].shape).astype(np.float32))
        p["bias"] = mx.array(rng.normal(size=p["bias"].shape).astype(np.float32))
    bridges = [rng.normal(size=(8, 8)) for _ in range(3)]
    out = compose.compose(tr, bridges, Side(3, 2, 4, 4))
    assert out.config.key_cut == "pre_norm" and "composed" in out.config.metadata["calibration"]
    x = rng.normal(size=(5, 8)).astype(np.float32)
    for i, a in enumerate(bridges):
        want = (x @ np.array(tr.key["weight"][i]) + np.array(tr.key["bias"][i])) @ a
        got = x @ np.array(out.key["weight"][i]) + np.array(out.key["bias"][i])
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)
    assert mx.array_equal(out.value["weight"], tr.value["weight"])
