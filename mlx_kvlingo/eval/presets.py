"""Shape-faithful model pairs with random weights (a shared offline tokenizer, a random
translator), built once into `$KVLINGO_CACHE/presets/<name>`: latency without a download, since
timings depend on shapes, not weight values; their outputs are meaningless.
"""

from __future__ import annotations

import shutil
from dataclasses import asdict, dataclass, field
from pathlib import Path

from mlx_kvlingo._platform.cachedir import build_atomically, cache_root, stamp_ok

#: Bump when the way presets are built changes, so cached folders are rebuilt.
BUILD_VERSION = 1
STAMP = "kvlingo-preset.json"
QWEN3_MOE = "qwen3-0.6b>qwen3-30b-a3b-scaled"
QWEN3_SHALLOW_MOE = "qwen3-0.6b>qwen3-moe-8-layers"
LLAMA_QWEN2 = "llama-3.2-1b>qwen2.5-3b-scaled"
#: Qwen3-0.6B's shape exactly, the source of both Qwen3 presets
QWEN3_06B = dict(
    kind="qwen3", hidden_size=1024, num_hidden_layers=28, intermediate_size=3072,
    num_attention_heads=16, num_key_value_heads=8, head_dim=128, rope_theta=1e6,
    max_position_embeddings=40960, tie_word_embeddings=True,
)  # fmt: skip
#: the qwen3_moe targets' common shape: Qwen3-30B-A3B's heads, hidden size and experts scaled
#: (each target sets its layers, heads and KV heads)
QWEN3_MOE_TARGET = dict(
    QWEN3_06B,
    kind="qwen3_moe",
    num_experts=16,
    moe_intermediate_size=384,
    norm_topk_prob=True,
    tie_word_embeddings=False,
)


@dataclass(frozen=True)
class Preset:
    name: str
    description: str
    #: `synthetic.BASE` kind + config overrides, per side
    source: dict
    target: dict
    #: model vocabulary (embedding rows); None: the tokenizer's own size
    vocab_size: int | None = None
    tokenizer_vocab: int = 512
    variant: str = "mixing"
    nu: int = 1
    seed: int = 0
    #: what the scaled side was derived from, for the record
    reference: dict = field(default_factory=dict)

    def config(self, side: str, vocab: int) -> dict:
        from mlx_kvlingo.data.synthetic import model_config

        spec = dict(self.source if side == "source" else self.target)
        kind = spec.pop("kind")
        return model_config(kind, self.vocab_size or vocab, **spec)

    def parameter_count(self, side: str) -> int:
        """Parameters of one side, from its config (a lazy model: no weights are computed)."""
        from mlx_lm.utils import _get_classes, get_total_parameters

        c = self.config(side, self.vocab_size or self.tokenizer_vocab + 3)
        model, args = _get_classes(c)
        return get_total_parameters(model(args.from_dict(c)))


PRESETS: dict[str, Preset] = {
    p.name: p
    for p in (
        Preset(
            "tiny",
            "tiny qwen3 source and qwen3_moe target (tests, smoke runs)",
            source={"kind": "qwen3"},
            target={"kind": "qwen3_moe"},
            tokenizer_vocab=300,
        ),
        Preset(
            QWEN3_MOE,
            "Qwen3-0.6B-shaped source; Qwen3-30B-A3B attention geometry with hidden size, "
            "expert width and expert count scaled to fit 24 GiB in float32",
            source=QWEN3_06B,
            target=dict(QWEN3_MOE_TARGET, num_hidden_layers=48, num_attention_heads=32,
                        num_key_value_heads=4, num_experts_per_tok=8),
            vocab_size=151936,
            reference={
                "source": "Qwen/Qwen3-0.6B (exact shape)",
                "target": "Qwen/Qwen3-30B-A3B: hidden 2048->1024, moe_intermediate 768->384, "
                "experts 128->16; layers, heads, KV heads, head dim, top-8 kept",
            },
        ),
        Preset(
            QWEN3_SHALLOW_MOE,
            "Qwen3-0.6B-shaped source into a shallower qwen3_moe target: 8 layers, 4 KV heads "
            "x 128 (a translator that reads 8 of the source's 28 layers)",
            source=QWEN3_06B,
            target=dict(QWEN3_MOE_TARGET, num_hidden_layers=8, num_attention_heads=16,
                        num_key_value_heads=4, num_experts_per_tok=4),
            reference={"source": "Qwen/Qwen3-0.6B (exact shape, small vocabulary)",
                       "target": "issue 28's pair: 8-layer qwen3_moe, 4 KV heads x 128"},
        ),
        Preset(
            LLAMA_QWEN2,
            "Llama-3.2-1B attention geometry (16 layers, 8 KV heads x 64, traditional RoPE) "
            "into Qwen2.5-3B's (36 layers, 2 KV heads x 128), hidden sizes scaled to 1024",
            source=dict(
                kind="llama", hidden_size=1024, num_hidden_layers=16, intermediate_size=2816,
                num_attention_heads=16, num_key_value_heads=8, head_dim=64, rope_theta=5e5,
            ),
            target=dict(
                kind="qwen2", hidden_size=1024, num_hidden_layers=36, intermediate_size=2816,
                num_attention_heads=8, num_key_value_heads=2, head_dim=128, rope_theta=1e6,
            ),
            nu=2,
            reference={
                "source": "meta-llama/Llama-3.2-1B: layers, heads, KV heads, head dim kept; "
                "hidden 2048->1024",
                "target": "Qwen/Qwen2.5-3B: layers, KV heads, head dim kept; hidden 2048->1024, "
                "16->8 query heads",
            },
        ),
    )
}  # fmt: skip


def build_preset(name: str, cache_dir=None, log=None) -> Path:
    """The preset's folder (source/, target/, translator.safetensors) in `cache_root(cache_dir)`'s
    presets/, built once."""
    preset = PRESETS[name]
    final = cache_root(cache_dir) / "presets" / name.replace(">", "__to__").replace("/", "_")
    stamp = {"build_version": BUILD_VERSION, "preset": asdict(preset)}
    if stamp_ok(final, stamp, STAMP):
        return final
    if log:
        gb = 4 * (preset.parameter_count("source") + preset.parameter_count("target")) / 1e9
        log(f"building preset {name} into {final} (once; ~{gb:.1f} GB float32)")
    return build_atomically(final, stamp, lambda tmp: _build(preset, tmp), STAMP)


def _build(preset: Preset, folder: Path) -> None:
    import gc

    from mlx_kvlingo.data import synthetic as syn
    from mlx_kvlingo.models.files import save_translator
    from mlx_kvlingo.models.pair import load_pair

    import mlx.core as mx

    tok = syn.build_tokenizer(folder / "tokenizer", vocab_size=preset.tokenizer_vocab)
    vocab = {"vocab_size": preset.vocab_size} if preset.vocab_size else {}
    for i, (side, spec) in enumerate((("source", preset.source), ("target", preset.target))):
        shape = {k: v for k, v in spec.items() if k != "kind"}
        syn.make_model_folder(folder / side, spec["kind"], tok, preset.seed + i, **shape, **vocab)
        gc.collect()
        mx.clear_cache()
    shutil.rmtree(tok)
    pair = load_pair(folder / "source", folder / "target")
    tr = random_translator(pair, preset.variant, preset.nu, seed=preset.seed + 2)
    save_translator(tr, folder / "translator.safetensors", pair,
                    provenance={"preset": preset.name, "random": True})  # fmt: skip


def random_translator(pair, variant: str = "mixing", nu: int = 1, seed: int = 0):
    """A translator with random weights of the right shape (scaled 1/sqrt(fan-in))."""
    from mlx_kvlingo.kv.translator import Side, Translator, TranslatorConfig, nearest_layer_map

    import mlx.core as mx

    src, tgt = pair.source.geometry, pair.target.geometry
    rows = tuple(tuple(r) for r in nearest_layer_map(src.layers, tgt.layers, nu))
    config = TranslatorConfig(variant, Side.of(src), Side.of(tgt), rows, rows)
    tr = Translator(config)
    key = mx.random.key(seed)
    for params in (tr.key, tr.value):
        w = params["weight"]
        key, sub = mx.random.split(key)
        params["weight"] = mx.random.normal(w.shape, key=sub) * w.shape[-2] ** -0.5
    mx.eval(tr.parameters())
    return tr


def load_preset(name: str, cache_dir=None, log=None, dtype="auto"):
    """(pair, translator, folder) for a preset, built first if needed, computing in `dtype`."""
    from mlx_kvlingo.models.files import load_translator
    from mlx_kvlingo.models.pair import load_pair

    folder = build_preset(name, cache_dir, log=log)
    pair = load_pair(folder / "source", folder / "target", dtype=dtype)
    pair.source.name = f"{name}:source"
    pair.target.name = f"{name}:target"
    return pair, load_translator(folder / "translator.safetensors", pair, dtype=dtype), folder
