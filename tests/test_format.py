"""The translator file: round trip, and a specific error for every kind of bad file."""

import json
import pickle
import struct

from mlx_kvlingo.models.files import TranslatorFileError, load_translator, save_translator
from mlx_kvlingo.models.pair import load_model, load_pair

import mlx.core as mx
import numpy as np
import pytest
from helpers import exact_translator


@pytest.fixture(scope="module")
def known(tiny_dir):
    src, tgt = load_model(tiny_dir["qwen3"]), load_model(tiny_dir["known"])
    return load_pair(src, tgt)


@pytest.fixture
def saved(known, tiny_dir, tmp_path):
    tr = exact_translator(known, tiny_dir["known_answer"])
    return save_translator(tr, tmp_path / "t.safetensors", known, calibration={"note": "exact"}), tr


def _rewrite(path, tensors=None, meta=None):
    t = mx.load(str(path))
    header_meta = json.loads(_header(path)["__metadata__"]["kvlingo"])
    if tensors is not None:
        t = tensors(t)
    if meta is not None:
        header_meta = meta(header_meta)
    mx.save_safetensors(str(path), t, metadata={"kvlingo": json.dumps(header_meta)})


def _header(path):
    b = path.read_bytes()
    (n,) = struct.unpack("<Q", b[:8])
    return json.loads(b[8 : 8 + n])


def test_round_trip(saved, known):
    path, tr = saved
    back = load_translator(path, known)
    assert back.config == tr.config
    np.testing.assert_array_equal(np.array(back.key["weight"]), np.array(tr.key["weight"]))
    assert back.config.metadata["calibration"] == {"note": "exact"}


def test_wrong_pair(saved, tiny_dir):
    path, _ = saved
    other = load_pair(load_model(tiny_dir["qwen3"]), load_model(tiny_dir["qwen3_moe"]))
    with pytest.raises(TranslatorFileError, match="wrong model pair"):
        load_translator(path, other)


def test_reverse_direction(saved, known):
    path, _ = saved
    # same geometry both ways here, so name the direction via a model type mismatch instead
    _rewrite(path, meta=lambda m: {**m, "target": {**m["target"], "model_type": "llama"}})
    with pytest.raises(TranslatorFileError, match="made for a llama target"):
        load_translator(path, known)


def test_missing_and_extra_tensors(saved, known):
    path, _ = saved
    _rewrite(path, tensors=lambda t: {k: v for k, v in t.items() if k != "value.weight"})
    with pytest.raises(TranslatorFileError, match=r"missing tensors \['value.weight'\]"):
        load_translator(path, known)
    _rewrite(
        path, tensors=lambda t: {**t, "value.weight": t["key.weight"], "key.extra": t["key.weight"]}
    )
    with pytest.raises(TranslatorFileError, match="unexpected tensors"):
        load_translator(path, known)


def test_wrong_shape(saved, known):
    path, _ = saved
    _rewrite(path, tensors=lambda t: {**t, "key.weight": t["key.weight"][:, :-1]})
    with pytest.raises(TranslatorFileError, match="key.weight has shape"):
        load_translator(path, known)


def test_nan(saved, known):
    path, _ = saved
    _rewrite(
        path, tensors=lambda t: {**t, "value.weight": t["value.weight"] * mx.array(float("nan"))}
    )
    with pytest.raises(TranslatorFileError, match="NaN or Inf"):
        load_translator(path, known)


def test_unknown_schema_version(saved, known):
    path, _ = saved
    _rewrite(path, meta=lambda m: {**m, "schema_version": 99})
    with pytest.raises(TranslatorFileError, match="unsupported schema_version 99"):
        load_translator(path, known)


def test_lowrank_file_of_0_1_is_refused(saved, known):
    """0.1.0 wrote low-rank translators (variant "lowrank", encoder/decoder tensors); this
    version refuses them by name, as the one-line error of any unknown variant."""
    path, _ = saved
    _rewrite(path, meta=lambda m: {**m, "variant": "lowrank", "rank": 4})
    with pytest.raises(TranslatorFileError, match="unknown variant 'lowrank'; expected one of"):
        load_translator(path, known)


def test_truncated(saved, known):
    path, _ = saved
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    with pytest.raises(TranslatorFileError, match="truncated"):
        load_translator(path, known)
    path.write_bytes(data[:5])
    with pytest.raises(TranslatorFileError, match="truncated"):
        load_translator(path, known)


def test_pickle_is_refused_not_executed(tmp_path, known):
    path = tmp_path / "evil.safetensors"
    marker = tmp_path / "executed"

    class Evil:
        def __reduce__(self):
            return (open, (str(marker), "w"))

    path.write_bytes(pickle.dumps(Evil(), protocol=2))
    with pytest.raises(TranslatorFileError, match="pickle"):
        load_translator(path, known)
    assert not marker.exists()


def test_not_a_translator(tmp_path, known):
    path = tmp_path / "plain.safetensors"
    mx.save_safetensors(str(path), {"a": mx.zeros(3)})
    with pytest.raises(TranslatorFileError, match="no kvlingo metadata"):
        load_translator(path, known)


def test_pytorch_file_is_named(tmp_path, known):
    """A torch.save zip given where a translator is expected: say so, and name the command."""
    torch = pytest.importorskip("torch")
    path = tmp_path / "translator.pt"
    torch.save({"schema": "kv_lingo_translator_v1"}, str(path))
    assert path.read_bytes()[:4] == b"PK\x03\x04"
    with pytest.raises(TranslatorFileError, match=r"PyTorch file.*kvlingo convert"):
        load_translator(path, known)


def test_direction_by_name(saved, known):
    """Same geometry and model type both ways: the recorded names decide the direction."""
    path, _ = saved
    load_translator(path, known)
    with pytest.raises(TranslatorFileError, match="goes the other way"):
        load_translator(path, known.reversed())


def test_translator_loaded_here_translates_in_another_thread(tiny_dir, tmp_path):
    """A float16 file cast at load must not leave lazy work bound to the loading thread
    (`kvlingo serve` translates on its worker thread)."""
    import threading

    from mlx_kvlingo.kv.capture import trace
    from mlx_kvlingo.models.pair import load_pair

    from helpers import exact_translator

    pair = load_pair(tiny_dir["qwen3"], tiny_dir["known"])
    tr = exact_translator(pair, tiny_dir["known_answer"], dtype=mx.float16)
    path = save_translator(tr, tmp_path / "half.safetensors", pair)
    loaded = load_translator(path, pair)
    span = trace(pair.source, [5, 6, 7, 8], "post_norm")
    mx.eval(span.keys, span.values)
    out, errors = [], []

    def work():
        try:
            keys, _ = loaded.translate(span, pair.target)
            mx.eval(keys)
            out.append(keys[0].shape)
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(repr(e))

    t = threading.Thread(target=work)
    t.start()
    t.join(60)
    assert not errors and out, errors
