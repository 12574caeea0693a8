"""Load a source/target model pair through mlx-lm and describe each one's KV geometry."""

from __future__ import annotations

import hashlib
import json
import math
import os
import sys
from dataclasses import asdict, dataclass, field
from functools import cached_property
from pathlib import Path

from mlx_kvlingo._platform import cpu_memory as _cpu_memory
from mlx_kvlingo.kv.rope import RopeSpec, describe

import mlx.core as mx
import mlx.nn as nn
from mlx_lm import load as mlx_lm_load
from mlx_lm.utils import dequantize_model


class TokenizerMismatchError(ValueError):
    pass


class UnsupportedModelError(ValueError):
    pass


#: The families KV translation supports (the one place that knows), model_type -> whether its
#: attention normalizes the keys (`k_norm`). mlx-lm caches hold keys after `k_norm` (if any) and
#: RoPE, values as raw `v_proj` output; every family keeps its attention module in a decoder
#: layer's `self_attn` and its KV head count in `num_key_value_heads` (else the head count).
HAS_K_NORM = {"llama": False, "mistral": False, "qwen2": False, "qwen3": True, "qwen2_moe": False,
              "qwen3_moe": True}  # fmt: skip


@dataclass(frozen=True)
class KVGeometry:
    """The shape of one model's KV cache, and how its keys are made."""

    model_type: str
    layers: int
    kv_heads: int
    head_dim: int
    value_dim: int
    rope: RopeSpec
    has_k_norm: bool
    dtype: str

    def as_dict(self) -> dict:
        return asdict(self)


@dataclass
class LoadedModel:
    """One model as mlx-lm loads it, with the facts a turn reads as plain attributes:
    `context_length` (None if its config does not say), `query_heads` (the queries'; the cache's
    are `geometry.kv_heads`) and `rope` (layer 0's)."""

    name: str
    model: nn.Module
    tokenizer: object
    config: dict
    geometry: KVGeometry
    folder: Path | None = None  # where its files are (generation_config.json, ...), when known
    context_length: int | None = field(init=False)
    query_heads: int = field(init=False)
    rope: nn.Module = field(init=False)

    def __post_init__(self) -> None:
        self.context_length = self.config.get("max_position_embeddings")
        self.query_heads = int(self.config.get("num_attention_heads", self.geometry.kv_heads))
        self.rope = self.attention(0).rope

    @property
    def layers(self) -> list:
        return self.model.layers

    def attention(self, layer: int) -> nn.Module:
        return self.model.layers[layer].self_attn

    @cached_property
    def dtype(self) -> mx.Dtype:
        """The dtype of the model's weights (its cache takes the same); looked up once."""
        return weights_dtype(self.model)

    def nbytes(self) -> int:
        from mlx.utils import tree_flatten

        return sum(v.nbytes for _, v in tree_flatten(self.model.parameters()))


@dataclass
class ModelPair:
    """The small model that prefills (source) and the model that decodes (target)."""

    source: LoadedModel
    target: LoadedModel
    tokenizer: object = field(repr=False)
    tokenizer_fingerprint: str = ""

    def reversed(self) -> ModelPair:
        return ModelPair(self.target, self.source, self.tokenizer, self.tokenizer_fingerprint)


def weights_dtype(model: nn.Module) -> mx.Dtype:
    """The compute dtype of a model's weights (a quantized embedding's scales tell it)."""
    emb = model.model.embed_tokens
    return getattr(emb, "scales", emb.weight).dtype


def geometry_of(model: nn.Module, config: dict) -> KVGeometry:
    model_type = config["model_type"]
    if model_type not in HAS_K_NORM:  # an unsupported family is refused first
        raise UnsupportedModelError(
            f"model_type {model_type!r} is not supported for KV "
            f"translation (known: {', '.join(sorted(HAS_K_NORM))})"
        )
    layers = model.layers
    attn = layers[0].self_attn
    heads = config["num_attention_heads"]
    # the module's count where it has one (config and module may disagree), else the config's
    kv_heads = getattr(attn, "n_kv_heads", None) or config.get("num_key_value_heads") or heads
    head_dim = config.get("head_dim") or config["hidden_size"] // heads
    dtype = str(weights_dtype(model))
    return KVGeometry(model_type, len(layers), kv_heads, head_dim, head_dim, describe(attn.rope),
                      HAS_K_NORM[model_type], dtype.replace("mlx.core.", ""))  # fmt: skip


def default_dtype(dtype="auto") -> mx.Dtype | None:
    """`dtype`, or for "auto": float32 on the CPU backend (bf16 and quantized matmuls are slow
    there), None (as stored) on a GPU (Metal or CUDA)."""
    if dtype != "auto":
        return dtype
    return None if mx.default_device().type == mx.gpu else mx.float32


def with_dtype(model, config: dict, dtype):
    """`model` in `dtype` ("auto": the backend's default; None: as stored), dequantized first
    when stored quantized; returns (model, the dtype applied or None)."""
    dtype = default_dtype(dtype)
    if dtype is not None:
        if "quantization" in config or "quantization_config" in config:
            model = dequantize_model(model)
        model.set_dtype(dtype)
    return model, dtype


def load_model(path_or_repo: str | Path, dtype: mx.Dtype | None = "auto",
               tokenizer: object = None) -> LoadedModel:  # fmt: skip
    """Load one model by hub id or local folder through `mlx_lm.load`; with `tokenizer` (one
    mlx-lm built from the same files: `tokenizer_identity`), its weights only."""
    name = str(path_or_repo)
    _cpu_memory.tune()  # before the first allocations that should be reused
    if tokenizer is None:
        model, tokenizer, config = mlx_lm_load(name, return_config=True)
    else:
        from mlx_lm.utils import load_model as mlx_lm_load_weights

        model, config = mlx_lm_load_weights(Path(name))
    model, dtype = with_dtype(model, config, dtype)
    if dtype is not None:
        mx.eval(model.parameters())
    return LoadedModel(name, model, tokenizer, config, geometry_of(model, config), _folder_of(name))


def _folder_of(name: str) -> Path | None:
    """The local folder mlx_lm.load read (a hub id resolves in the Hub cache, offline)."""
    if Path(name).is_dir():
        return Path(name)
    try:
        from mlx_lm.utils import hf_repo_to_path

        return hf_repo_to_path(name)
    except Exception:  # noqa: BLE001 - not in the cache (or not a hub id): no folder to read
        return None


#: the files of a model folder mlx-lm builds its tokenizer from (`mlx_lm.utils.load_tokenizer`),
#: less the model's own (config, weights index, this package's build stamps)
_TOKENIZER_FILES = (
    "*.json",
    "*.py",
    "tokenizer.model",
    "*.tiktoken",
    "*.txt",
    "*.jsonl",
    "*.jinja",
)
_MODEL_FILES = {
    "config.json",
    "model.safetensors.index.json",
    "kvlingo.json",
    "kvlingo-preset.json",
}


def tokenizer_identity(path: str | Path | LoadedModel) -> str | None:
    """A digest of what mlx-lm builds a local folder's tokenizer from (its tokenizer files, the
    config's model type and end-of-sequence ids): equal digests, equal tokenizers (loaded once).
    None for a loaded model, a hub id or an unreadable folder."""
    if isinstance(path, LoadedModel) or not Path(path).is_dir():
        return None
    folder = Path(path)
    h = hashlib.sha256()
    try:
        config = json.loads((folder / "config.json").read_text())
        h.update(json.dumps([config.get("model_type"), config.get("eos_token_id")]).encode())
        names = sorted({f.name for g in _TOKENIZER_FILES for f in folder.glob(g)} - _MODEL_FILES)
        for name in names:
            h.update(name.encode() + b"\0" + (folder / name).read_bytes() + b"\0")
    except (OSError, ValueError, AttributeError):
        return None
    return h.hexdigest()


def vocab_fingerprint(tokenizer) -> str:
    vocab = tokenizer.get_vocab()
    items = "\n".join(f"{i}\t{t}" for t, i in sorted(vocab.items(), key=lambda kv: kv[1]))
    return hashlib.sha256(items.encode()).hexdigest()[:16]


def model_fingerprint(loaded: LoadedModel) -> str:
    """Identify a model's weights across dtypes: signs of the clearly non-zero entries of its
    embedding and K/V projections (dtype casts and 4-bit rounding keep those signs)."""
    import numpy as np
    from mlx.utils import tree_flatten

    h = hashlib.sha256(json.dumps(loaded.geometry.as_dict(), sort_keys=True).encode())
    for name, w in sorted(tree_flatten(loaded.model.parameters())):
        keep = any(s in name for s in ("embed_tokens", "k_proj", "v_proj"))
        if not keep or not mx.issubdtype(w.dtype, mx.floating):
            continue
        x = np.array(w.reshape(-1)[:256].astype(mx.float32))
        big = np.abs(x) > 0.5 * (x.std() + 1e-12)
        h.update(name.encode())
        h.update(np.packbits(big).tobytes() + np.packbits((x > 0) & big).tobytes())
    return h.hexdigest()[:16]


def check_same_tokenizer(a, b, names=("source", "target")) -> None:
    """Refuse a pair whose tokenizers map ids to different tokens; name the first difference."""
    va, vb = a.get_vocab(), b.get_vocab()
    ia, ib = {i: t for t, i in va.items()}, {i: t for t, i in vb.items()}
    for i in sorted(set(ia) | set(ib)):
        ta, tb = ia.get(i), ib.get(i)
        if ta != tb:
            raise TokenizerMismatchError(
                f"the {names[0]} and {names[1]} tokenizers differ: first differing token id {i} "
                f"is {ta!r} in the {names[0]} and {tb!r} in the {names[1]} "
                f"(vocab sizes {len(va)} and {len(vb)}); KV translation needs one shared tokenizer"
            )
    ea, eb = set(a.eos_token_ids), set(b.eos_token_ids)
    if ea != eb:
        raise TokenizerMismatchError(
            f"the {names[0]} and {names[1]} tokenizers differ in end-of-sequence ids: "
            f"{sorted(ea)} vs {sorted(eb)}"
        )


def load_pair(source: str | Path | LoadedModel, target: str | Path | LoadedModel,
              dtype: mx.Dtype | None = "auto") -> ModelPair:  # fmt: skip
    """Load source and target (hub ids, local folders or loaded models) sharing one tokenizer
    (else `TokenizerMismatchError`)."""
    check_fits(*[p for p in (source, target) if not isinstance(p, LoadedModel)], dtype=dtype)
    shared = tokenizer_identity(source)
    if shared is not None and shared == tokenizer_identity(target):  # one tokenizer for both
        tgt = load_model(target, dtype)
        src = load_model(source, dtype, tokenizer=tgt.tokenizer)
    else:
        src = source if isinstance(source, LoadedModel) else load_model(source, dtype)
        tgt = target if isinstance(target, LoadedModel) else load_model(target, dtype)
        check_same_tokenizer(src.tokenizer, tgt.tokenizer)
    return ModelPair(src, tgt, tgt.tokenizer, vocab_fingerprint(tgt.tokenizer))


def describe_model(m: LoadedModel) -> dict:
    g = m.geometry
    kv = 2 * g.layers * g.kv_heads * g.head_dim * getattr(mx, g.dtype).size
    return {"name": m.name, **g.as_dict(), "parameters_MB": round(m.nbytes() / 2**20, 1),
            "kv_bytes_per_token": kv}  # fmt: skip


class InsufficientMemoryError(MemoryError):
    pass


def estimate_bytes(path_or_repo: str | Path, dtype: mx.Dtype | None = "auto") -> int | None:
    """Bytes a local model folder's weights will take once loaded (None for a hub id not on
    disk), from its safetensors headers: every floating tensor at `dtype` (float32 on the CPU
    backend), quantized weights dequantized (their scales and biases dropped), as `load_model`
    does; anything else as stored. Activations and KV caches come on top."""
    import struct

    folder = Path(path_or_repo)
    if not (folder / "config.json").exists():
        return None
    config = json.loads((folder / "config.json").read_text())
    dtype = default_dtype(dtype)
    quant = config.get("quantization") or config.get("quantization_config") or {}
    bits = int(quant.get("bits", 4)) if quant else None
    total = 0
    for f in sorted(folder.glob("*.safetensors")):
        with open(f, "rb") as fh:
            (n,) = struct.unpack("<Q", fh.read(8))
            header = json.loads(fh.read(n))
        header.pop("__metadata__", None)
        for name, t in header.items():
            stored = t["data_offsets"][1] - t["data_offsets"][0]
            numel = math.prod(t["shape"])
            if dtype is None:
                total += stored
            elif bits and name.endswith((".scales", ".biases")):
                continue  # dequantizing folds them into the weight
            elif bits and t["dtype"] == "U32":  # packed quantized weight: 32 / bits per word
                total += numel * (32 // bits) * dtype.size
            elif t["dtype"] in ("F64", "F32", "F16", "BF16"):
                total += numel * dtype.size
            else:
                total += stored
    return total


def physical_memory() -> int:
    if sys.platform == "darwin":
        return int(mx.metal.device_info().get("memory_size", 0)) or 16 * 2**30
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def check_fits(*paths, dtype="auto", headroom: float = 0.85) -> None:
    """Refuse, before loading, models whose weights alone exceed the machine's memory."""
    sizes = [estimate_bytes(p, dtype) for p in paths]
    need = sum(s for s in sizes if s)
    have = physical_memory()
    if need > headroom * have:
        detail = ", ".join(f"{p}: {s / 2**30:.1f} GiB" for p, s in zip(paths, sizes) if s)
        raise InsufficientMemoryError(
            f"the models need about {need / 2**30:.1f} GiB once loaded (estimate from their "
            f"files: {detail}); this machine has {have / 2**30:.1f} GiB, of which "
            f"{headroom * have / 2**30:.1f} GiB ({headroom:.0%}) may go to weights. Use smaller "
            "or quantized models"
        )
