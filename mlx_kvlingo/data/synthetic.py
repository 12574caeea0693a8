"""Offline model folders for tests, benchmarks and presets: random-weight mlx-lm models of
real architectures and a byte-level BPE tokenizer trained on local text (the known-answer
target the tests rewrite from them is in tests/helpers.py).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
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
    import importlib
    import inspect

    mods = ("argparse", "collections", "dataclasses", "functools", "pathlib", "json", "textwrap",
            "inspect")  # fmt: skip
    return "\n".join(inspect.getsource(importlib.import_module(m)) for m in mods)


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
    return {**BASE[kind], "vocab_size": vocab_size, **overrides}


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


def make_model_folder(
    folder: str | Path, kind: str, tokenizer_dir: Path, seed: int = 0, **overrides
) -> Path:
    """A random-weight `kind` model (`BASE[kind]` with `overrides`) with the tokenizer (and
    every other file) in `tokenizer_dir`."""
    vocab = len(json.loads((Path(tokenizer_dir) / "tokenizer.json").read_text())["model"]["vocab"])
    cfg = model_config(kind, vocab + len(SPECIAL), **overrides)
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    save_model(folder, build_model(cfg, seed))
    save_config({k: v for k, v in cfg.items() if v is not None}, folder / "config.json")
    shutil.copytree(tokenizer_dir, folder, dirs_exist_ok=True)
    return folder
