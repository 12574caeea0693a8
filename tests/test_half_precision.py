"""float16 and 8-bit translator files against float32: the tolerance each is held to.

A float16 file rounds every weight to 11 significant bits (relative error <= 2^-11). Over a
span of the tiny pair, with a translator of random weights (the known answer's are exact in
float16), the translated keys and values (after RoPE, as they enter the cache)
must then agree with the float32 file's within a relative RMS error of

    HALF_FILE_RTOL = 1e-3   the file stored in float16, computed in float32 (CPU, "auto")
    HALF_COMPUTE_RTOL = 4e-3   the file and the translation in float16 (as on a GPU)

    EIGHT_BIT_RTOL = 1e-2   the file quantized to 8 bits (groups of 64 or 32), computed in float32

(measured 2.0e-4, 3.5e-4 and 4.8e-3 on this pair: the bounds leave room, not slack for a real
bug: a wrong layer, head or position gives errors of order 1). An 8-bit file loads as exactly
mx.dequantize(mx.quantize(w)) of the weights it was saved from.
"""

from mlx_kvlingo.eval.presets import random_translator
from mlx_kvlingo.kv.cache import new_cache
from mlx_kvlingo.kv.capture import prefill
from mlx_kvlingo.models.files import TranslatorFileError, load_translator, save_translator
from mlx_kvlingo.models.pair import load_pair

import mlx.core as mx
import numpy as np
import pytest

HALF_FILE_RTOL = 1e-3
HALF_COMPUTE_RTOL = 4e-3
EIGHT_BIT_RTOL = 1e-2
TEXT = "def parse_args(argv):\n    parser = argparse.ArgumentParser(description="


def rel_rms(got: list, want: list) -> float:
    g = np.concatenate([np.array(x.astype(mx.float32)).ravel() for x in got])
    w = np.concatenate([np.array(x.astype(mx.float32)).ravel() for x in want])
    return float(np.sqrt(np.mean((g - w) ** 2) / np.mean(w**2)))


@pytest.fixture(scope="module")
def setup(tiny_dir, tmp_path_factory):
    pair = load_pair(tiny_dir["qwen3"], tiny_dir["qwen3_moe"])
    tr = random_translator(pair, seed=5)
    d = tmp_path_factory.mktemp("half")
    full = save_translator(tr, d / "full.safetensors", pair)
    half = save_translator(tr, d / "half.safetensors", pair, dtype=mx.float16)
    span = prefill(pair.source, pair.tokenizer.encode(TEXT), new_cache(pair.source))
    span.start = 3  # RoPE at positions that are not 0
    return pair, full, half, span


def test_8bit_file_loads_as_its_dequantized_weights(setup, tmp_path):
    pair, full, _, span = setup
    tr = load_translator(full, pair)
    path = save_translator(tr, tmp_path / "q8.safetensors", pair, dtype=mx.float16, bits=8)
    assert mx.load(str(path))["key.weight"].dtype == mx.uint32  # stored packed
    got = load_translator(path, pair)
    for side, name in (("key", "weight"), ("value", "weight")):
        w = getattr(tr, side)[name].astype(mx.float16)
        g = 32  # the tiny pair's maps are 96 wide
        want = mx.dequantize(*mx.quantize(w, g, 8), g, 8)
        assert mx.array_equal(getattr(got, side)[name], want.astype(mx.float32))
    ref = tr.translate(span, pair.target)
    out = got.translate(span, pair.target)
    assert 0 < rel_rms(out[0], ref[0]) <= EIGHT_BIT_RTOL
    assert 0 < rel_rms(out[1], ref[1]) <= EIGHT_BIT_RTOL


def test_8bit_file_without_its_scales_is_refused(setup, tmp_path):
    pair, full, _, _ = setup
    path = save_translator(load_translator(full, pair), tmp_path / "q8.safetensors", pair, bits=8)
    tensors = mx.load(str(path), return_metadata=True)
    del tensors[0]["value.weight_scales"]
    mx.save_safetensors(str(path), tensors[0], metadata=tensors[1])
    with pytest.raises(TranslatorFileError, match="value.weight is not a packed map"):
        load_translator(path, pair)


def test_float16_file_computed_in_float32(setup):
    pair, full, half, span = setup
    ref = load_translator(full, pair).translate(span, pair.target)
    tr = load_translator(half, pair, dtype=mx.float32)
    got = tr.translate(span, pair.target)
    assert rel_rms(got[0], ref[0]) <= HALF_FILE_RTOL
    assert rel_rms(got[1], ref[1]) <= HALF_FILE_RTOL
    assert rel_rms(got[0], ref[0]) > 0  # it is the rounded file, not the same weights


def test_float16_file_computed_in_float16(setup):
    pair, full, half, span = setup
    ref = load_translator(full, pair).translate(span, pair.target)
    tr = load_translator(half, pair, dtype=None)  # as stored: float16 weights and compute
    assert tr.key["weight"].dtype == mx.float16
    got = tr.translate(span, pair.target)
    assert rel_rms(got[0], ref[0]) <= HALF_COMPUTE_RTOL
    assert rel_rms(got[1], ref[1]) <= HALF_COMPUTE_RTOL


def test_the_tolerance_catches_a_wrong_layer(setup):
    """A float16 file whose layers are shifted by one is far outside the tolerance."""
    pair, full, half, span = setup
    ref = load_translator(full, pair).translate(span, pair.target)
    tr = load_translator(half, pair, dtype=mx.float32)
    tr.key["weight"] = mx.roll(tr.key["weight"], 1, axis=0)
    got = tr.translate(span, pair.target)
    assert rel_rms(got[0], ref[0]) > 100 * HALF_FILE_RTOL
