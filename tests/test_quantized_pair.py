"""Quantized checkpoints kept quantized: the path Mac users run (`dtype=None`, `--dtype stored`).

The tiny pair is written by mlx-lm's own `convert`, as mlx-community checkpoints are: a
bfloat16 folder with `quantization` in config.json and packed weights with scales and biases.
The qwen3 source is 8-bit (group 64), the qwen3_moe target 4-bit (group 32: its attention
output reads 96 features), experts included (`QuantizedSwitchLinear`; mlx-lm keeps the router
at 8 bits). Capture, translation, stage 1, stage 2 and decoding all run on those weights, and
the weights are still quantized afterwards.
"""

import json

from mlx_kvlingo.calibrate.closed_form import Stage1Config, fit_closed_form
from mlx_kvlingo.calibrate.distill import Stage2Config, distill
from mlx_kvlingo.cli import cli
from mlx_kvlingo.data.examples import DataConfig, load_examples
from mlx_kvlingo.kv.cache import new_cache
from mlx_kvlingo.kv.capture import prefill, trace
from mlx_kvlingo.kv.scoring import heldout_scores, prepare
from mlx_kvlingo.kv.translator import Side, TranslatorConfig, identity_translator
from mlx_kvlingo.models.files import load_translator
from mlx_kvlingo.models.pair import load_model, load_pair

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from click.testing import CliRunner
from helpers import handoff
from mlx.utils import tree_flatten
from mlx_lm import stream_generate
from mlx_lm.models.cache import make_prompt_cache
from mlx_lm.models.switch_layers import QuantizedSwitchLinear, SwitchLinear

PROMPT = "def parse_args(argv):\n    parser = argparse.ArgumentParser(description="
#: (bits, group size) as written: the source at 8 bits, the target at 4
QUANT = {"source": (8, 64), "target": (4, 32)}


@pytest.fixture(scope="module")
def qdir(tiny_dir, tmp_path_factory):
    """The tiny qwen3 / qwen3_moe folders quantized by `mlx_lm.convert` (bfloat16, as uploaded)."""
    from mlx_lm.convert import convert

    root = tmp_path_factory.mktemp("quantized")
    out = {}
    for role, kind in (("source", "qwen3"), ("target", "qwen3_moe")):
        bits, group = QUANT[role]
        out[role] = root / f"{kind}-{bits}bit"
        convert(str(tiny_dir[kind]), str(out[role]), quantize=True, q_group_size=group,
                q_bits=bits, dtype="bfloat16")  # fmt: skip
    return out


@pytest.fixture(scope="module")
def qpair(qdir):
    return load_pair(qdir["source"], qdir["target"], dtype=None)


@pytest.fixture(scope="module")
def data(text_file, qpair):
    return load_examples(text_file, qpair.tokenizer, DataConfig(16, 48, 12, seed=1))


def layer_kinds(model: nn.Module) -> dict:
    """How many modules of each class the model holds."""
    kinds = {}
    for _, m in model.named_modules():
        kinds[type(m).__name__] = kinds.get(type(m).__name__, 0) + 1
    return kinds


def assert_quantized(loaded) -> None:
    """Every linear layer (attention, MLP, experts, head) and the embedding stay quantized."""
    model = loaded.model
    plain = [
        n
        for n, m in model.named_modules()
        if type(m) in (nn.Linear, nn.Embedding, SwitchLinear)  # the float classes
    ]
    assert not plain, f"{loaded.name}: float layers {plain[:4]}"
    attn = loaded.attention(0)
    for proj in ("q_proj", "k_proj", "v_proj", "o_proj"):
        assert isinstance(getattr(attn, proj), nn.QuantizedLinear), proj
    assert isinstance(model.model.embed_tokens, nn.QuantizedEmbedding)
    assert attn.k_proj.weight.dtype == mx.uint32
    if loaded.geometry.model_type == "qwen3_moe":
        experts = [m for _, m in model.named_modules() if isinstance(m, QuantizedSwitchLinear)]
        assert len(experts) == 3 * loaded.geometry.layers  # gate, up, down per layer
        assert experts[0].bits == 4 and experts[0].group_size == 32


def test_convert_writes_a_quantized_folder(qdir):
    for role, folder in qdir.items():
        bits, group = QUANT[role]
        cfg = json.loads((folder / "config.json").read_text())
        assert cfg["quantization"]["bits"] == bits
        assert cfg["quantization"]["group_size"] == group
        assert cfg["quantization_config"] == cfg["quantization"]
        names = mx.load(str(folder / "model.safetensors"))
        assert names["model.layers.0.self_attn.k_proj.weight"].dtype == mx.uint32
        assert names["model.layers.0.self_attn.k_proj.scales"].dtype == mx.bfloat16
    names = mx.load(str(qdir["target"] / "model.safetensors"))
    assert "model.layers.0.mlp.switch_mlp.up_proj.scales" in names


def test_stored_keeps_quantized_layers(qpair, qdir):
    for m in (qpair.source, qpair.target):
        assert_quantized(m)
        assert m.geometry.dtype == "bfloat16"  # the scales' dtype: the cache's
    assert layer_kinds(qpair.target.model)["QuantizedSwitchLinear"] == 18
    # the CPU default dequantizes to float32 (fast there); nothing quantized is left
    auto = load_model(qdir["target"])
    assert "QuantizedLinear" not in layer_kinds(auto.model)
    assert "QuantizedSwitchLinear" not in layer_kinds(auto.model)
    assert auto.geometry.dtype == "float32"


@pytest.mark.parametrize("role", ["source", "target"])
def test_capture_equals_mlx_lm_cache(qpair, role):
    """Our prefill fills the cache mlx-lm's own would hold; the RoPE-free span, rotated back
    by an identity translator (post_norm cut), decodes greedily as the model does itself."""
    m = getattr(qpair, role)
    tokens = qpair.tokenizer.encode(PROMPT)
    n = len(tokens) - 1
    ref = make_prompt_cache(m.model)
    m.model(mx.array(tokens[:n])[None], cache=ref)
    ours = new_cache(m)
    span = prefill(m, tokens[:n], ours)
    assert span.length == n and span.keys.dtype == mx.float32
    for a, b in zip(ours, ref, strict=True):
        assert a.offset == b.offset == n
        assert mx.array_equal(a.keys[..., :n, :], b.keys[..., :n, :])
        assert mx.array_equal(a.values[..., :n, :], b.values[..., :n, :])
    g = m.geometry
    rows = tuple((layer,) for layer in range(g.layers))
    same = load_pair(m, m)
    tr = identity_translator(TranslatorConfig("mixing", Side.of(g), Side.of(g), rows, rows))
    h = handoff(same, tr, tokens)
    for c, b in zip(h.target_cache, ref, strict=True):
        assert c.keys.dtype == b.keys.dtype == mx.bfloat16
        assert mx.array_equal(c.values[..., :n, :], b.values[..., :n, :])
        got, want = (np.array(x[..., :n, :].astype(mx.float32)) for x in (c.keys, b.keys))
        np.testing.assert_allclose(got, want, rtol=0, atol=1e-7)  # un-rotate, rotate: float32
    native = [
        r.token for r in stream_generate(m.model, same.tokenizer, mx.array(tokens), max_tokens=40)
    ]
    out = stream_generate(m.model, same.tokenizer, mx.array(tokens[-1:]), max_tokens=40,
                          prompt_cache=h.target_cache)  # fmt: skip
    assert len(native) == 40
    assert [r.token for r in out] == native
    assert_quantized(m)


@pytest.mark.parametrize("role", ["source", "target"])
def test_pre_norm_cut_on_quantized_k_proj(qpair, role):
    """The pre_norm cut records the quantized `k_proj`'s output; k_norm and RoPE applied by
    an identity translator give the cache's keys within bfloat16 rounding (the model rounds
    after k_norm and after RoPE, the translator only after RoPE: two steps of the largest
    key apart at most, so greedy decoding is not held to token equality here)."""
    m = getattr(qpair, role)
    tokens = qpair.tokenizer.encode(PROMPT)
    n = len(tokens) - 1
    ref = make_prompt_cache(m.model)
    m.model(mx.array(tokens[:n])[None], cache=ref)
    g = m.geometry
    rows = tuple((layer,) for layer in range(g.layers))
    config = TranslatorConfig("mixing", Side.of(g), Side.of(g), rows, rows, key_cut="pre_norm")
    h = handoff(load_pair(m, m), identity_translator(config), tokens)
    for c, b in zip(h.target_cache, ref, strict=True):
        got, want = (np.array(x[..., :n, :].astype(mx.float32)) for x in (c.keys, b.keys))
        assert np.abs(got - want).max() <= 2**-6 * np.abs(want).max()  # two bfloat16 steps
    assert_quantized(m)  # the recorders were taken out again


def test_stage1_stage2_and_decoding_stay_quantized(qpair, data):
    train, _ = data
    tr = fit_closed_form(qpair, train[:16], Stage1Config())
    fit = tr.config.metadata["calibration"]["stage1"]["train_fit"]
    assert 0 < fit["key"]["r2_mean"] <= 1 and 0 < fit["value"]["r2_mean"] <= 1
    # translation: a span captured on the quantized source, in the quantized target's layout
    tokens = qpair.tokenizer.encode(PROMPT)
    span = trace(qpair.source, tokens[:-1], "post_norm")
    keys, values = tr.translate(span, qpair.target)
    g = qpair.target.geometry
    assert len(keys) == g.layers
    assert keys[0].shape == (1, g.kv_heads, len(tokens) - 1, g.head_dim)
    assert keys[0].dtype == values[0].dtype == mx.bfloat16
    # stage 2: gradients flow through the 4-bit target (its experts included); a few steps
    # on four examples must lower the KL on those four
    few = train[:4]
    prepared = [prepare(qpair, e, "post_norm") for e in few]
    before = heldout_scores(tr, qpair, prepared)[0]
    start = {k: np.array(v) for k, v in tree_flatten(tr.trainable_parameters())}
    cfg = Stage2Config(steps=8, learning_rate=1e-3, warmup=1, accumulate=1, keep_best=False)
    distill(tr, qpair, few, (), cfg)
    s2 = tr.config.metadata["calibration"]["stage2"]
    assert s2["steps"] == 8 and np.isfinite(s2["final_train_loss"])
    params = tree_flatten(tr.trainable_parameters())
    moved = {k: float(np.abs(np.array(v) - start[k]).max()) for k, v in params}
    assert all(d > 0 for d in moved.values()), moved
    after = heldout_scores(tr, qpair, prepared)[0]
    assert np.isfinite(after) and after < before, (before, after)
    # decoding: greedy from the translated cache
    h = handoff(qpair, tr, tokens)
    assert h.translated_tokens == len(tokens) - 1
    out = stream_generate(qpair.target.model, qpair.tokenizer, mx.array(tokens[-1:]),
                          max_tokens=20, prompt_cache=h.target_cache)  # fmt: skip
    got = [r.token for r in out]
    assert len(got) == 20 and all(0 <= t < qpair.target.config["vocab_size"] for t in got)
    for m in (qpair.source, qpair.target):
        assert_quantized(m)


def test_calibrate_cli_dtype_stored(qdir, text_file, tmp_path, monkeypatch):
    import mlx_kvlingo.models.loading as loading

    load = loading.load_models_and_translators
    loaded = []

    def spy(*args, **kw):  # the one loader every command goes through
        got = load(*args, **kw)
        loaded.append((kw.get("dtype", "auto"), got[0]))
        return got

    monkeypatch.setattr(loading, "load_models_and_translators", spy)
    out_file = tmp_path / "out.safetensors"
    out = CliRunner().invoke(cli, ["calibrate", "--source", str(qdir["source"]), "--target",
                                   str(qdir["target"]), "--data", str(text_file), "--dtype",
                                   "stored", "--steps", "2", "--max-examples", "8",
                                   "--max-prefix", "48", "--continuation", "12",
                                   "--eval-examples", "2", "-o", str(out_file)])  # fmt: skip
    assert out.exit_code == 0, out.output
    [(dtype, pair)] = loaded
    assert dtype is None
    for m in (pair.source, pair.target):
        assert_quantized(m)
    tr = load_translator(out_file, pair)
    assert tr.config.metadata["calibration"]["stage2"]["steps"] == 2
    assert np.isfinite(tr.config.metadata["calibration"]["stage2"]["final_train_loss"])
    assert np.isfinite(
        tr.config.metadata["calibration"]["stage2"]["heldout"]["translated"]["kl_native"]
    )
    h = handoff(pair, tr, pair.tokenizer.encode(PROMPT))
    assert h.target_cache[0].keys.dtype == mx.bfloat16
