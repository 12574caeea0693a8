"""Other cache hand-off methods: raw, quantized, DroidSpeak, SCD (REUSE), and `kvlingo compare`."""

import json

import mlx_kvlingo  # noqa: F401  (OpenBLAS before mlx)
from mlx_kvlingo.data import synthetic as syn
from mlx_kvlingo.data.examples import DataConfig, load_examples
from mlx_kvlingo.eval.methods import (
    KVLingo,
    NotApplicable,
    capture_span,
    droidspeak,
    mean_kl,
    prepare,
    quantized,
    raw,
    scd,
)
from mlx_kvlingo.kv.cache import append_kv, new_cache
from mlx_kvlingo.models.files import save_translator
from mlx_kvlingo.models.pair import load_model, load_pair

import mlx.core as mx
import numpy as np
import pytest
from helpers import exact_translator

CFG = DataConfig(min_prefix=32, max_prefix=96, continuation=12, seed=3)


@pytest.fixture(scope="module")
def same_pair(models):
    return load_pair(models["qwen3"], models["qwen3"])


@pytest.fixture(scope="module")
def data(text_file, known_pair):
    return load_examples(text_file, known_pair.tokenizer, CFG)


def greedy(pair, method, prompt, n=8):
    """Target tokens after a hand-off by `method` (None: the target's own prefill)."""
    cache = new_cache(pair.target)
    if method is None:
        pair.target.model(mx.array(prompt[:-1])[None], cache=cache)
    else:
        span = capture_span(pair.source, prompt[:-1], method.key_cut, method.needs_hidden)
        append_kv(cache, *method.translate(span, pair.target))
    out, last = [], prompt[-1]
    for _ in range(n):
        last = int(pair.target.model(mx.array([[last]]), cache=cache)[0, -1].argmax())
        out.append(last)
    return out


def exact_on(pair, method, held, n=4):
    prompts = [list(ex.prefix) for ex in held[:n]]
    assert all(greedy(pair, method, p) == greedy(pair, None, p) for p in prompts)
    points = method.needs_hidden
    assert mean_kl(method, pair, [prepare(pair, ex, "post_norm", points) for ex in held[:n]]) < 1e-4


# -- exactness ---------------------------------------------------------------------------------


def test_raw_and_droidspeak_exact_on_identical_models(same_pair, data):
    _, held = data
    exact_on(same_pair, raw.RawTransfer.for_pair(same_pair), held)
    for block in ((0, 1), (1, 3), (2, 4)):  # source == target: any recomputed block is exact
        exact_on(same_pair, droidspeak.DroidSpeak.for_pair(same_pair, block), held, n=2)


def test_droidspeak_full_block_exact_on_known_pair(known_pair, data):
    """The known target's caches differ from the source's, its embeddings do not: recomputing
    every layer from the source's layer-0 input is the target's own prefill."""
    _, held = data
    exact_on(known_pair, droidspeak.DroidSpeak.for_pair(known_pair, (0, 4)), held)
    assert mean_kl(raw.RawTransfer.for_pair(known_pair), known_pair,
                   [prepare(known_pair, ex) for ex in held[:2]]) > 0.1  # fmt: skip


def test_scd_full_rank_recovers_known_map(known_pair, data):
    train, held = data
    full, low = scd.fit_reuse(known_pair, train[:60], [(None, None), (8, 16)], alpha=1e-9)
    assert full.ranks == (64, 64) and low.ranks == (8, 16)
    exact_on(known_pair, full, held)
    exact_on(known_pair, KVLingo(full.to_translator()), held, n=2)  # multiplied out: the same
    # low rank: fewer numbers on the wire, and worse
    assert low.wire_bytes_per_token() == 4 * (8 + 16) * 2 < full.wire_bytes_per_token()
    assert mean_kl(low, known_pair, [prepare(known_pair, ex) for ex in held[:3]]) > 1e-3


def test_native_first_keeps_the_targets_first_token(known_pair, data):
    """With native_first every method hands over position 0 as the target computes it; SCD
    then fits without position 0 and stays exact at full rank."""
    train, held = data
    prompt = list(held[0].prefix)
    cache = new_cache(known_pair.target)
    known_pair.target.model(mx.array(prompt[:-1])[None], cache=cache)
    (full,) = scd.fit_reuse(known_pair, train[:60], [(None, None)], 1e-9, native_first=True)
    for m in (raw.RawTransfer.for_pair(known_pair, native_first=True), full):
        span = capture_span(known_pair.source, prompt[:-1], m.key_cut, m.needs_hidden)
        keys, values = m.translate(span, known_pair.target)
        for layer in range(4):
            np.testing.assert_allclose(  # a one-token forward: same values up to rounding
                np.array(keys[layer][..., :1, :]),
                np.array(cache[layer].keys[..., :1, :]),
                atol=1e-5,
            )
    assert full.to_translator().config.native_first
    exact_on(known_pair, full, held, n=2)


def test_scd_factors_equal_known_answer_float64(tiny_dir, text_file):
    pair = load_pair(
        load_model(tiny_dir["qwen3"], mx.float64), load_model(tiny_dir["known"], mx.float64)
    )
    train, _ = load_examples(text_file, pair.tokenizer, CFG)
    (full,) = scd.fit_reuse(pair, train[:60], [(None, None)], alpha=1e-12)
    tr = full.to_translator()
    answer = tiny_dir["known_answer"]
    np.testing.assert_allclose(np.array(tr.key["weight"]), np.stack(answer["key_maps"]), atol=1e-3)
    np.testing.assert_allclose(
        np.array(tr.value["weight"]), np.stack(answer["value_maps"]), atol=1e-3
    )
    np.testing.assert_allclose(np.array(tr.key["bias"]), 0, atol=1e-3)


def test_droidspeak_profiling_finds_the_changed_layers(tiny_dir, models, data, tmp_path):
    """Target = source with layers 2 and 3 changed: recomputing block [2, 4) is exact and the
    profiling must find it; the 1-layer block must start at 2 (where the change begins)."""
    weights = dict(mx.load(str(tiny_dir["qwen3"] / "model.safetensors")))
    mx.random.seed(7)
    for k, v in weights.items():
        if k.startswith(("model.layers.2.", "model.layers.3.")) and v.ndim == 2:
            weights[k] = v + 0.5 * v.std() * mx.random.normal(v.shape)
    folder = syn.save_folder(tmp_path / "tuned", _model_like(tiny_dir, weights), _cfg(tiny_dir),
                             tiny_dir["tokenizer"])  # fmt: skip
    pair = load_pair(models["qwen3"], load_model(folder))
    train, held = data
    two, one = droidspeak.calibrate(pair, train[:3], layers=[2, 1])
    assert two.block == (2, 4) and one.block == (2, 3)
    kls = two.profile["kl_by_start"]
    assert kls["2"] < 1e-5 and min(kls["0"], kls["1"]) > 1e-3
    exact_on(pair, two, held, n=2)


def _cfg(tiny_dir):
    return json.loads((tiny_dir["qwen3"] / "config.json").read_text())


def _model_like(tiny_dir, weights):
    from mlx.utils import tree_unflatten

    model = syn.build_model(_cfg(tiny_dir))
    model.update(tree_unflatten(list(weights.items())))
    return model


# -- applicability, quantization ------------------------------------------------------------


def test_not_applicable_reasons(models):
    pair = load_pair(models["qwen3"], models["qwen3_moe"])
    with pytest.raises(NotApplicable, match="identical KV geometry.*4x2x32 vs 6x4x24"):
        raw.RawTransfer.for_pair(pair)
    with pytest.raises(NotApplicable, match="same architecture"):
        droidspeak.calibrate(pair, [])


def test_quantized_wire(same_pair, known_pair, data):
    _, held = data
    r = raw.RawTransfer.for_pair(same_pair)
    q4, q8 = quantized.Quantized(r, 4, 32), quantized.Quantized(r, 8, 32)
    assert r.wire_bytes_per_token() == 4 * 2 * 64 * 2
    assert q4.wire_bytes_per_token() == pytest.approx(4 * 2 * 64 * (0.5 + 4 / 32))
    preps = [prepare(same_pair, ex) for ex in held[:3]]
    k4, k8 = mean_kl(q4, same_pair, preps), mean_kl(q8, same_pair, preps)
    assert 0 < k8 < k4 and k8 < 1e-3
    span = capture_span(same_pair.source, list(held[0].prefix))
    wired = q4.wire(span)
    err = float(mx.abs(wired.keys - span.keys).max())
    assert 0 < err < float(mx.abs(span.keys).max()) / 4


# -- the comparison ------------------------------------------------------------------------------


def test_compare_command(tiny_dir, known_pair, text_file, tmp_path):
    from mlx_kvlingo.cli import cli

    from click.testing import CliRunner

    out = tmp_path / "cmp.json"
    exact = save_translator(exact_translator(known_pair, tiny_dir["known_answer"]),
                            tmp_path / "exact.safetensors", known_pair)  # fmt: skip
    args = [
        "compare", "--source", str(tiny_dir["qwen3"]), "--target", str(tiny_dir["known"]),
        "--data", str(text_file), "--min-prefix", "32", "--max-prefix", "96",
        "--continuation", "8", "-n", "4", "--calib-examples", "40",
        "--nu", "1", "--bits", "4", "--droidspeak-layers", "1,4", "--scd-ranks", "0.25:0.5,1:1",
        "--ttft-tokens", "32", "--trials", "1",
        "--json", str(out), "--plot", str(tmp_path / "cmp.png"), "--translator", str(exact),
    ]  # fmt: skip
    res = CliRunner().invoke(cli, args)
    assert res.exit_code == 0, res.output
    result = json.loads(out.read_text())
    rows = {r["label"]: r for r in result["rows"]}
    assert rows["native (target re-prefill)"]["kl_native"] == 0
    assert rows[f"kvlingo file {exact}"]["kl_native"] < 1e-4  # a translator file, as a method
    assert rows["raw"]["kl_native"] > 0.1  # the known target's cache layout differs
    ds = [r for r in result["rows"] if r["family"] == "droidspeak"]
    assert len(ds) == 2 and min(r["kl_native"] for r in ds) < 1e-4  # all 4 layers: exact
    full = next(r for r in result["rows"] if r["label"].startswith("scd r_k=64 r_v=64"))
    assert full["kl_native"] < 1e-3 and full["code_size_per_token"]["reuse_per_layer"] == 128
    assert all("switch_ttft_s" in r and "wire_bytes_per_token" in r for r in result["rows"]
               if r["family"] != "reference")  # fmt: skip
    assert (tmp_path / "cmp.png").stat().st_size > 10_000
    # a pair with different geometry lists raw and DroidSpeak as not applicable
    res = CliRunner().invoke(cli, [
        "compare", "--source", str(tiny_dir["qwen3"]), "--target", str(tiny_dir["qwen3_moe"]),
        "--data", str(text_file), "--min-prefix", "32", "--max-prefix", "64", "-n", "2",
        "--calib-examples", "8", "--methods", "raw,droidspeak,quantized", "--bits", "4",
        "--nu", "1", "--ttft-tokens", "16", "--trials", "1", "--json", str(out),
    ])  # fmt: skip
    assert res.exit_code == 0, res.output
    na = {r["label"]: r["not_applicable"] for r in json.loads(out.read_text())["rows"]
          if "not_applicable" in r}  # fmt: skip
    assert set(na) == {"raw", "raw @4-bit", "droidspeak"}
    assert "identical KV geometry" in na["raw"] and "same architecture" in na["droidspeak"]
    assert "n/a" in res.output
