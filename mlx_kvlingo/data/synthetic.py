"""Offline model folders for tests, benchmarks and presets: random-weight mlx-lm models of
real architectures, a byte-level BPE tokenizer trained on local text, and a "known-answer"
target whose cache layout is a function-preserving rewrite of its source's.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx.utils import tree_flatten, tree_unflatten
from mlx_lm.utils import save_config, save_model

CHATML = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}"
    "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]

BASE = {
    "qwen3": dict(
        model_type="qwen3", hidden_size=64, num_hidden_layers=4, intermediate_size=128,
        num_attention_heads=4, num_key_value_heads=2, head_dim=32, rms_norm_eps=1e-6,
        rope_theta=10000.0, max_position_embeddings=32768, tie_word_embeddings=False,
    ),
    "qwen3_moe": dict(
        model_type="qwen3_moe", hidden_size=64, num_hidden_layers=6, intermediate_size=128,
        num_attention_heads=4, num_key_value_heads=4, head_dim=24, rms_norm_eps=1e-6,
        rope_theta=1000000.0, max_position_embeddings=32768, tie_word_embeddings=False,
        num_experts=8, num_experts_per_tok=2, decoder_sparse_step=1, mlp_only_layers=[],
        moe_intermediate_size=32, norm_topk_prob=True,
    ),
    "llama": dict(
        model_type="llama", hidden_size=64, num_hidden_layers=3, intermediate_size=128,
        num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-5, rope_theta=10000.0,
        rope_traditional=True, max_position_embeddings=32768, tie_word_embeddings=False,
    ),
    "qwen2": dict(
        model_type="qwen2", hidden_size=64, num_hidden_layers=3, intermediate_size=128,
        num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-6, rope_theta=1000000.0,
        max_position_embeddings=32768, tie_word_embeddings=False,
    ),
}  # fmt: skip


def training_text() -> str:
    """Local English + code text for the tokenizer: the standard library's own sources."""
    import argparse  # noqa: E401
    import collections
    import dataclasses
    import functools
    import inspect
    import json as json_mod
    import pathlib
    import textwrap

    mods = (argparse, collections, dataclasses, functools, pathlib, json_mod, textwrap, inspect)
    return "\n".join(inspect.getsource(m) for m in mods)


def build_tokenizer(folder: str | Path, vocab_size: int = 512) -> Path:
    """Train a byte-level BPE tokenizer offline and save it with a ChatML chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    folder = Path(folder)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(training_text().splitlines(), trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>"
    )
    fast.chat_template = CHATML
    fast.save_pretrained(str(folder))
    return folder


def model_config(kind: str, vocab_size: int, **overrides) -> dict:
    cfg = {**BASE[kind], "vocab_size": vocab_size, **overrides}
    cfg.setdefault("eos_token_id", None)
    return cfg


def build_model(config: dict, seed: int = 0, logit_scale: float = 4.0) -> nn.Module:
    """A random-weight mlx-lm model; `logit_scale` sharpens its next-token distribution."""
    from mlx_lm.utils import _get_classes

    model_cls, args_cls = _get_classes(config)
    mx.random.seed(seed)
    model = model_cls(args_cls.from_dict(config))
    params = dict(tree_flatten(model.parameters()))
    key = "model.embed_tokens.weight" if config.get("tie_word_embeddings") else "lm_head.weight"
    params[key] = params[key] * logit_scale
    model.update(tree_unflatten(list(params.items())))
    mx.eval(model.parameters())
    return model


def save_folder(folder: str | Path, model: nn.Module, config: dict, tokenizer_dir: Path) -> Path:
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    save_model(folder, model)
    cfg = {k: v for k, v in config.items() if v is not None}
    save_config(cfg, folder / "config.json")
    for f in Path(tokenizer_dir).iterdir():
        if f.is_file():
            shutil.copy(f, folder / f.name)
    return folder


def make_model_folder(
    folder: str | Path, kind: str, tokenizer_dir: Path, seed: int = 0, **overrides
) -> Path:
    vocab = len(json.loads((Path(tokenizer_dir) / "tokenizer.json").read_text())["model"]["vocab"])
    vocab += len(SPECIAL)
    cfg = model_config(kind, vocab, **overrides)
    return save_folder(folder, build_model(cfg, seed), cfg, tokenizer_dir)


# -- a known-answer pair ------------------------------------------------------------------


def known_answer_target(
    source_dir: str | Path, out_dir: str | Path, seed: int = 1, permute: bool = True
) -> dict:
    """Rewrite a source model's cache layout without changing what it computes.

    KV heads are permuted together with their query groups and output columns, and each
    head's values are multiplied by a random orthogonal matrix that `o_proj` undoes. The
    exact translator is returned: `key_maps[l]`, `value_maps[l]` as (H*D, H*D) matrices in
    `x @ W` orientation (source features -> target features), with the head permutation.
    """
    source_dir, out_dir = Path(source_dir), Path(out_dir)
    cfg = json.loads((source_dir / "config.json").read_text())
    H = cfg["num_key_value_heads"]
    heads = cfg["num_attention_heads"]
    D = cfg.get("head_dim") or cfg["hidden_size"] // heads
    G = heads // H
    rng = np.random.default_rng(seed)
    weights = {k: np.array(v) for k, v in mx.load(str(source_dir / "model.safetensors")).items()}
    key_maps, value_maps = [], []
    for layer in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{layer}.self_attn."
        perm = rng.permutation(H) if permute else np.arange(H)  # target head h = source perm[h]
        Q = [np.linalg.qr(rng.standard_normal((D, D)))[0].astype(np.float32) for _ in range(H)]
        wk = weights[p + "k_proj.weight"].reshape(H, D, -1)
        wv = weights[p + "v_proj.weight"].reshape(H, D, -1)
        wq = weights[p + "q_proj.weight"].reshape(H, G * D, -1)
        wo = weights[p + "o_proj.weight"].reshape(-1, H, G * D)
        weights[p + "k_proj.weight"] = wk[perm].reshape(H * D, -1)
        weights[p + "v_proj.weight"] = np.stack([Q[h] @ wv[perm[h]] for h in range(H)]).reshape(
            H * D, -1
        )
        weights[p + "q_proj.weight"] = wq[perm].reshape(H * G * D, -1)
        wo = wo[:, perm]  # (out, H, G*D): columns follow the permuted heads
        for h in range(H):  # o_proj sees Q v: undo it with Q^T per query head in the group
            block = wo[:, h].reshape(-1, G, D)
            wo[:, h] = np.einsum("ogd,ed->oge", block, Q[h]).reshape(-1, G * D)
        weights[p + "o_proj.weight"] = wo.reshape(wo.shape[0], -1)
        for b in ("k_proj.bias", "v_proj.bias", "q_proj.bias"):
            if p + b in weights:
                w = weights[p + b]
                if b == "k_proj.bias":
                    weights[p + b] = w.reshape(H, D)[perm].reshape(-1)
                elif b == "v_proj.bias":
                    vb = w.reshape(H, D)
                    weights[p + b] = np.stack([Q[h] @ vb[perm[h]] for h in range(H)]).reshape(-1)
                else:
                    weights[p + b] = w.reshape(H, G * D)[perm].reshape(-1)
        K = np.zeros((H * D, H * D), np.float32)
        V = np.zeros((H * D, H * D), np.float32)
        for h in range(H):
            s = perm[h]
            K[s * D : (s + 1) * D, h * D : (h + 1) * D] = np.eye(D)
            V[s * D : (s + 1) * D, h * D : (h + 1) * D] = Q[h].T  # row-vector form: v' = v Q^T
        key_maps.append(K)
        value_maps.append(V)
    out_dir.mkdir(parents=True, exist_ok=True)
    mx.save_safetensors(
        str(out_dir / "model.safetensors"), {k: mx.array(v) for k, v in weights.items()}
    )
    for f in source_dir.iterdir():
        if f.name != "model.safetensors" and f.is_file():
            shutil.copy(f, out_dir / f.name)
    return {"key_maps": key_maps, "value_maps": value_maps, "permuted": permute}


def with_new_head(
    source_dir: str | Path, out_dir: str | Path, seed: int = 5, scale: float = 0.5
) -> Path:
    """A copy whose output head is perturbed: same KV cache as the source, different predictions.

    Paired with `known_answer_target(source_dir)`, the exact translator still applies, while
    the model alone scores worse than the target: gap recovered is known to be exactly 1.
    """
    source_dir, out_dir = Path(source_dir), Path(out_dir)
    weights = dict(mx.load(str(source_dir / "model.safetensors")))
    head = weights["lm_head.weight"]
    mx.random.seed(seed)
    weights["lm_head.weight"] = head + scale * mx.random.normal(head.shape) * head.std()
    out_dir.mkdir(parents=True, exist_ok=True)
    mx.save_safetensors(str(out_dir / "model.safetensors"), weights)
    for f in source_dir.iterdir():
        if f.name != "model.safetensors" and f.is_file():
            shutil.copy(f, out_dir / f.name)
    return out_dir
