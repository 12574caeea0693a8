"""The demo's MoE target: SmolLM2-135M-Instruct upcycled, exactly, into an mlx-lm `qwen2_moe`.

    MoE(x) = sum_{e in top-k(g)} softmax(g)_e * (E/k) * MLP(x)  +  sigmoid(s(x)) * 0  = MLP(x)
    when the router logits g are equal (a zero router: softmax_e = 1/E, so k * (1/E) * (E/k) = 1)

Every expert is the dense MLP with `down_proj` scaled by E/k (a power of two: exact), the shared
expert and the q/k/v biases are zero, the attention is the dense one (interleaved q/k rows,
`rope_traditional`): its K/V cache is the dense target's, so the dense pair's translators serve
it. A router of logit scale `router_scale` > 0 changes each MLP output by a factor
1 + O(router_scale); `weights/moe/moe.json` records the recipe, from which
`ensure_smollm2_moe` builds the folder once into the cache.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

from mlx_kvlingo._platform.cachedir import build_atomically
from mlx_kvlingo.models.demo.smollm2 import (
    FORMAT_VERSION,
    STAMP,
    TOKENIZER_FILES,
    _quantized,
    _save_json,
    cache_root,
    ensure_smollm2,
    missing_weights,
    weights_dir,
)

MOE_NAME = "SmolLM2-135M-MoE"
#: Bump when the assembled folder's layout changes, so old caches are rebuilt.
MOE_FORMAT_VERSION = 2  # 2: qwen2_moe, an exact upcycle built from the config alone
RECORD = "moe.json"
#: what the assembled folder is built from in the record (the rest is what was measured)
RECIPE = ("experts", "top_k", "router_scale", "seed")
#: the config key saying whose K/V cache this model's equals (models/files.py reads it)
UPCYCLE_KEY = "kvlingo_upcycle"


def moe_config(dense: dict, experts: int, top_k: int) -> dict:
    """mlx-lm qwen2_moe config.json: the dense llama config, every MLP one of `experts`."""
    if not 0 < top_k < experts:
        raise ValueError(f"need 0 < top_k < experts, got top-{top_k} of {experts}")
    if (experts // top_k) * top_k != experts or (experts // top_k) & (experts // top_k - 1):
        raise ValueError(f"experts / top_k must be a power of two, got {experts} / {top_k}")
    heads = dense["num_attention_heads"]
    if dense.get("head_dim", dense["hidden_size"] // heads) * heads != dense["hidden_size"]:
        raise ValueError("qwen2_moe needs head_dim == hidden_size / num_attention_heads")
    keep = ("hidden_size", "num_hidden_layers", "intermediate_size", "num_attention_heads",
            "num_key_value_heads", "rms_norm_eps", "vocab_size", "max_position_embeddings",
            "rope_theta", "rope_traditional", "bos_token_id", "eos_token_id", "quantization")  # fmt: skip
    return {
        "model_type": "qwen2_moe",
        "architectures": ["Qwen2MoeForCausalLM"],
        **{k: dense[k] for k in keep if k in dense},
        "tie_word_embeddings": False,  # qwen2_moe always has its own lm_head
        "num_experts": experts,
        "num_experts_per_tok": top_k,
        "moe_intermediate_size": dense["intermediate_size"],
        "shared_expert_intermediate_size": 1,  # zero weights: it adds exactly 0
        "norm_topk_prob": False,  # qwen2_moe's scores are the softmax's, not renormalised
    }


def router(config: dict, norms: list, scale: float, seed: int) -> list:
    """Per layer, the router weight (E, hidden): zero, or Gaussian with logit std ~ `scale`
    (divided by the RMS of the layer's post-attention norm weight, the router's input scale)."""
    import mlx.core as mx
    import numpy as np

    shape = (config["num_experts"], config["hidden_size"])
    if scale == 0:
        return [mx.zeros(shape) for _ in norms]
    rng = np.random.default_rng(seed)
    out = []
    for g in norms:
        rms = float(np.sqrt((np.array(g, dtype=np.float64) ** 2).mean()))
        w = rng.standard_normal(shape) * scale / (np.sqrt(shape[1]) * rms)
        out.append(mx.array(w.astype(np.float32)))
    return out


def upcycle(dense: dict, config: dict, router_scale: float = 0.0, seed: int = 0) -> dict:
    """qwen2_moe weights from the dense llama weights (float or quantized: a tensor's
    `.scales`/`.biases` go with it; down_proj's scales and biases carry the E/k factor)."""
    import mlx.core as mx

    experts, top_k = config["num_experts"], config["num_experts_per_tok"]
    h = config["hidden_size"]
    out = {k: v for k, v in dense.items() if ".mlp." not in k}
    if "lm_head.weight" not in dense:  # tied: qwen2_moe's lm_head is the embedding's copy
        out.update({f"lm_head.{k.rsplit('.', 1)[1]}": v for k, v in dense.items()
                    if k.startswith("model.embed_tokens.")})  # fmt: skip
    layers = config["num_hidden_layers"]
    norms = [dense[f"model.layers.{i}.post_attention_layernorm.weight"] for i in range(layers)]
    gates = router(config, norms, router_scale, seed)
    for i in range(layers):
        p = f"model.layers.{i}."
        for name in ("q_proj", "k_proj", "v_proj"):
            rows = dense[f"{p}self_attn.{name}.weight"].shape[0]
            out[f"{p}self_attn.{name}.bias"] = mx.zeros((rows,))
        for key, w in dense.items():
            if key.startswith(f"{p}mlp."):
                # E/k on down_proj's float weight, or on a quantized one's scales and biases
                packed = key.endswith(".weight") and _quantized(key, dense)
                w = w * (experts // top_k) if ".down_proj." in key and not packed else w
                out[key.replace(".mlp.", ".mlp.switch_mlp.")] = mx.broadcast_to(
                    w, (experts, *w.shape)
                )
        out[f"{p}mlp.gate.weight"] = gates[i]
        for name, shape in (("gate_proj", (1, h)), ("up_proj", (1, h)), ("down_proj", (h, 1))):
            out[f"{p}mlp.shared_expert.{name}.weight"] = mx.zeros(shape)
        out[f"{p}mlp.shared_expert_gate.weight"] = mx.zeros((1, h))
    return out


def assemble_moe(dense_dir: Path, record: dict, out: Path) -> None:
    """Write the MoE model folder into `out` from the dense target folder and the recipe."""
    import mlx.core as mx

    dense_cfg = json.loads((dense_dir / "config.json").read_text())
    config = moe_config(dense_cfg, record["experts"], record["top_k"])
    dense = mx.load(str(dense_dir / "model.safetensors"))
    weights = upcycle(dense, config, record.get("router_scale", 0.0), record.get("seed", 0))
    mx.save_safetensors(str(out / "model.safetensors"), weights, metadata={"format": "mlx"})
    kv_of = {"name": dense_dir.name, "model_type": dense_cfg["model_type"]}
    _save_json(out / "config.json", {**config, UPCYCLE_KEY: {**kv_of, **record["summary"]}})
    for name in (*TOKENIZER_FILES, "generation_config.json"):
        if (dense_dir / name).is_file():
            shutil.copy2(dense_dir / name, out / name)


def ensure_smollm2_moe(cache_dir: str | os.PathLike | None = None) -> Path:
    """Build the MoE target folder (cached, atomically) from the demo target and
    `weights/moe/moe.json`, the upcycle's recipe (experts, top_k, router) and measurements."""
    path = weights_dir() / "moe" / RECORD
    if not path.is_file():
        raise missing_weights(path.parent, "moe")
    record = json.loads(path.read_text())
    dense_dir = ensure_smollm2(cache_dir)
    recipe = {k: record.get(k) for k in RECIPE}
    stamp = {"format": MOE_FORMAT_VERSION, "dense_format": FORMAT_VERSION, "dense": dense_dir.name,
             "recipe": recipe}  # fmt: skip
    return build_atomically(cache_root(cache_dir) / MOE_NAME, stamp,
                            lambda tmp: assemble_moe(dense_dir, record, tmp), STAMP)  # fmt: skip
