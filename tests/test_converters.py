"""Converters from PyTorch layouts: parity with the PyTorch reference, exact decoding on the
known-answer pair, refusal of unsafe pickles, and a specific error for each bad input."""

import hashlib
import json
import subprocess
import sys
from pathlib import Path

import mlx_kvlingo  # noqa: F401  (OpenBLAS before mlx)
from mlx_kvlingo.cli.convert import convert_cmd
from mlx_kvlingo.data import synthetic as syn
from mlx_kvlingo.kv.capture import SpanKV, capture_from_cache
from mlx_kvlingo.models.files import TranslatorFileError, load_translator, read_metadata
from mlx_kvlingo.models.pair import load_model, load_pair

import mlx.core as mx
import numpy as np
import pytest
import pytorch_writers as pw
from click.testing import CliRunner
from helpers import handoff
from mlx_lm import stream_generate
from mlx_lm.models.cache import KVCache

ROOT = Path(__file__).resolve().parents[1]
try:
    import kvlingo_converters as conv
except ImportError:  # a checkout that is not installed
    sys.path.insert(0, str(ROOT))
    import converters as conv


START, T, B = 5, 6, 2
PROMPT = "def parse_args(argv):\n    parser = argparse.ArgumentParser(description="
N_TOKENS = 40


def torch_ref():
    pytest.importorskip("torch")
    from importlib import import_module

    return import_module(conv.__name__ + ".torch_reference")


def geom(model):
    g = model.geometry
    return {"layers": g.layers, "kv_heads": g.kv_heads, "head_dim": g.head_dim}


@pytest.fixture(scope="module")
def models(tiny_dir):
    """Tiny models; targets with k_norm get random k_norm weights so the cut matters."""
    out = {k: load_model(tiny_dir[k]) for k in ("qwen3", "qwen3_moe", "llama", "qwen2")}
    out["qwen3_b"] = load_model(tiny_dir["qwen3"])
    deep = tiny_dir["root"] / "qwen3_deep"
    if not deep.exists():
        syn.make_model_folder(deep, "qwen3", tiny_dir["tokenizer"], seed=5, num_hidden_layers=6)
    out["qwen3_deep"] = load_model(deep)
    rng = np.random.default_rng(0)
    for name in ("qwen3_moe", "qwen3_b"):
        m = out[name]
        for i in range(m.geometry.layers):
            kn = m.attention(i).k_norm
            kn.weight = mx.array(rng.uniform(0.5, 1.5, kn.weight.shape).astype(np.float32))
    return out


@pytest.fixture(scope="module")
def known(tiny_dir):
    return load_pair(tiny_dir["qwen3"], tiny_dir["known"])


def random_kv(src, seed=0):
    """Source K/V for positions [0, START + T): keys rotated as a cache holds them."""
    g = src.geometry
    rng = np.random.default_rng(seed)
    shape = (g.layers, B, g.kv_heads, START + T, g.head_dim)
    return rng.standard_normal(shape).astype(np.float32), rng.standard_normal(shape).astype(
        np.float32
    )


def mlx_apply(pair, path, keys, values, keys_rotated):
    """Our side: load the converted file; capture [START, START+T) from a cache (rotated keys,
    un-rotated by the capture code) or take pre-RoPE keys as recorded; translate."""
    tr = load_translator(path, pair)
    if keys_rotated:
        cache = []
        for layer in range(keys.shape[0]):
            c = KVCache()
            c.update_and_fetch(mx.array(keys[layer]), mx.array(values[layer]))
            cache.append(c)
        span = capture_from_cache(pair.source, cache, START, START + T)
    else:
        span = SpanKV(mx.array(keys[..., START:, :]), mx.array(values[..., START:, :]), START)
    ks, vs = tr.translate(span, pair.target)
    return np.stack([np.array(k) for k in ks]), np.stack([np.array(v) for v in vs])


def torch_apply(ref, keys, values, keys_rotated):
    import torch

    with torch.no_grad():
        k, v = ref(torch.from_numpy(keys[..., START:, :]), torch.from_numpy(values[..., START:, :]),
                   START, keys_rotated=keys_rotated)  # fmt: skip
    return k.numpy(), v.numpy()


def assert_parity(pair, out, ref, keys_rotated=True, seed=0):
    keys, values = random_kv(pair.source, seed)
    mk, mv = mlx_apply(pair, out, keys, values, keys_rotated)
    tk, tv = torch_apply(ref, keys, values, keys_rotated)
    assert mk.shape == tk.shape and mv.shape == tv.shape
    np.testing.assert_allclose(mk, tk, atol=1e-5, rtol=0)
    np.testing.assert_allclose(mv, tv, atol=1e-5, rtol=0)


def parts(ref_mod, pair):
    src_rope = ref_mod.RoPE.from_mlx(pair.source.rope)
    tgt_rope, k_norm, eps = ref_mod.target_parts(pair.target)
    return src_rope, tgt_rope, k_norm, eps


# -- parity: converted MLX translator == PyTorch reference, per layout ---------------------


def knlp_geometry(model):
    g = model.geometry
    return pw.knlp_geometry(g.layers, g.kv_heads, g.head_dim)


@pytest.mark.parametrize(
    "src,tgt,kind",
    [("qwen3", "qwen3_b", "translator"), ("qwen2", "llama", "stage2"),
     ("qwen3", "qwen3_b", "unknown_cut")],
)  # fmt: skip
def test_kv_lingo_v1_parity(models, tmp_path, src, tgt, kind):
    """knlp files as kv_lingo_train.py writes them == the F.linear reference to 1e-5."""
    R = torch_ref()
    pair = load_pair(models[src], models[tgt])
    # an unrecognised cut converts only with the key cut stated: here keys after k_norm
    cut = "post_norm" if kind == "unknown_cut" else "pre_norm"
    src_rope, tgt_rope, k_norm, eps = parts(R, pair)
    ref = R.KVLingoV1Reference(geom(pair.source), geom(pair.target), src_rope, tgt_rope, k_norm, eps,
                               key_cut=cut).randomize_(seed=1)  # fmt: skip
    weights = (ref.key_weight.detach(), ref.value_weight.detach())
    gs, gt = knlp_geometry(pair.source), knlp_geometry(pair.target)
    if kind == "stage2":
        f = pw.knlp_stage2_checkpoint(tmp_path / "stage2-4b-to-8b-step3.pt", *weights, gs, gt)
    else:
        f = pw.knlp_translator(tmp_path / "stage1-4b-to-8b.pt", *weights, gs, gt,
                               cut=pw.KNLP_CUT if kind == "translator" else "keys post k_norm")  # fmt: skip
    options = {"key_cut": "post_norm"} if kind == "unknown_cut" else {}
    out, done = conv.convert_file(f, tmp_path / "out.safetensors", pair=pair, **options)
    assert done.provenance["stage2_checkpoint"] is (kind == "stage2")
    if kind == "stage2":
        assert done.provenance["ignored_keys"] == ["metrics", "optimizer", "rng"]
        assert done.provenance["global_step"] == 3 and done.provenance["last_mean_kl"] > 0
    # pre-norm keys are k_proj outputs (never rotated); post-norm ones come out of a cache
    assert_parity(pair, out, ref, keys_rotated=(cut == "post_norm"))
    meta = read_metadata(out)
    assert meta["key_cut"] == cut
    prov = meta["provenance"]
    assert prov["layout"] == "kv_lingo_translator_v1" and prov["key_cut"] == cut
    assert prov["key_cut_override"] is (kind == "unknown_cut")
    assert prov["input_sha256"] == hashlib.sha256(f.read_bytes()).hexdigest()
    assert prov["direction"] == "4b-to-8b"
    assert (prov["source_model"], prov["target_revision"]) == (
        "Qwen/Qwen3-4B", pw.KNLP_PINS["Qwen/Qwen3-8B"])  # fmt: skip


@pytest.mark.parametrize(
    "variant,src,tgt",
    [("full_head", "qwen3", "qwen3_deep"), ("full_head", "qwen3_deep", "known"),
     ("per_head", "qwen2", "llama"), ("full_head", "llama", "qwen2")],
)  # fmt: skip
def test_mapper_dir_parity(models, tiny_dir, tmp_path, variant, src, tgt):
    """semantic-router mapper directories as artifact.py writes them == x @ W + b to 1e-5."""
    R = torch_ref()
    mod = {**models, "known": load_model(tiny_dir["known"])}
    pair = load_pair(mod[src], mod[tgt])
    Ls, Lt = pair.source.geometry.layers, pair.target.geometry.layers
    rows = [[(t + 1) % Ls, t % Ls] for t in range(Lt)]  # topk 2, best first (not sorted)
    src_rope, tgt_rope, _, _ = parts(R, pair)
    ref = R.MapperReference(variant, geom(pair.source), geom(pair.target), rows, rows,
                            src_rope, tgt_rope).randomize_(seed=2)  # fmt: skip
    tensors = {k: v.numpy() for k, v in ref.tensors().items()}
    g = pair.target.geometry
    d = pw.sr_mapper(tmp_path / "mapper", tensors, rows, g.kv_heads, g.head_dim,
                     variant=variant, ridge_alpha=0.5)  # fmt: skip
    out, done = conv.convert_file(d, tmp_path / "out.safetensors", pair=pair)
    assert done.config.variant == "mixing"
    assert done.config.nu_k == 2 and done.config.nu_v == 2 and done.config.bias
    assert_parity(pair, out, ref)
    prov = read_metadata(out)["provenance"]
    assert prov["layout"] == "mapper_directory" and prov["key_cut"] == "post_norm"
    assert prov["variant"] == variant and prov["mapper_id"].startswith(f"pair-{variant}-bf16")
    assert prov["input_sha256"] == hashlib.sha256((d / "SHA256SUMS").read_bytes()).hexdigest()
    assert (
        prov["files_sha256"]["weights.safetensors"]
        == hashlib.sha256((d / "weights.safetensors").read_bytes()).hexdigest()
    )
    assert prov["ridge_alpha"] == 0.5 and prov["calibration"]["fitting_token_step"] == 4
    assert (prov["source_model"], prov["target_model"]) == ("Qwen/Qwen3-14B", "Qwen/Qwen3-32B")


@pytest.mark.parametrize(
    "src,tgt,cut,bias,fmt",
    [("qwen3", "qwen3_moe", "pre_norm", True, "pt"), ("llama", "qwen3", "post_norm", False, "pt"),
     ("qwen3", "qwen3_moe", "post_norm", True, "safetensors")],
)  # fmt: skip
def test_linear_state_dict_parity(models, tmp_path, src, tgt, cut, bias, fmt):
    R = torch_ref()
    pair = load_pair(models[src], models[tgt])
    Ls, Lt = pair.source.geometry.layers, pair.target.geometry.layers
    k_rows = [[min(t * Ls // Lt, Ls - 1), Ls - 1] for t in range(Lt)]
    v_rows = [[min(t * Ls // Lt, Ls - 1)] for t in range(Lt)]
    src_rope, tgt_rope, k_norm, eps = parts(R, pair)
    ref = R.LinearMapsReference(geom(pair.source), geom(pair.target), k_rows, v_rows, src_rope,
                                tgt_rope, cut, bias, k_norm, eps).randomize_(seed=3)  # fmt: skip
    f = ref.save(tmp_path / "maps.pt")
    if fmt == "safetensors":  # same names in a safetensors file, sidecar given explicitly
        from safetensors.torch import save_file

        save_file(dict(ref.state_dict()), str(tmp_path / "maps.safetensors"))
        (tmp_path / "geo.json").write_text((tmp_path / "maps.pt.json").read_text())
        f = tmp_path / "maps.safetensors"
        out, _ = conv.convert_file(
            f, tmp_path / "o.safetensors", pair=pair, sidecar=tmp_path / "geo.json"
        )
    else:
        out, _ = conv.convert_file(f, tmp_path / "o.safetensors", pair=pair)
    assert_parity(pair, out, ref, keys_rotated=(cut == "post_norm"))
    prov = read_metadata(out)["provenance"]
    assert prov["layout"] == "linear_state_dict" and prov["key_cut"] == cut
    assert prov["input_sha256"] == hashlib.sha256(f.read_bytes()).hexdigest()


def test_linear_state_dict_from_command_line(models, tmp_path):
    """No sidecar: geometry, layer map and cut on the command line (python -m converters)."""
    R = torch_ref()
    pair = load_pair(models["qwen2"], models["llama"])
    rows = [[t] for t in range(3)]
    src_rope, tgt_rope, _, _ = parts(R, pair)
    ref = R.LinearMapsReference(geom(pair.source), geom(pair.target), rows, rows, src_rope, tgt_rope,
                                "post_norm", True).randomize_(seed=4)  # fmt: skip
    f = ref.save(tmp_path / "maps.pt", sidecar=False)
    out = tmp_path / "o.safetensors"
    g_s, g_t = pair.source.geometry, pair.target.geometry
    r = subprocess.run(
        [sys.executable, "-m", "converters", str(f), "-o", str(out), "--layout", "linear",
         "--source-geometry", f"{g_s.layers},{g_s.kv_heads},{g_s.head_dim}",
         "--target-geometry", f"{g_t.layers},{g_t.kv_heads},{g_t.head_dim}",
         "--layer-map", "identity", "--key-cut", "post_norm"],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    assert "wrote" in r.stdout
    assert_parity(pair, out, ref)


# -- the known-answer pair: converted exact maps decode like the native target ------------


def native_tokens(pair, tokens):
    out = stream_generate(pair.target.model, pair.tokenizer, mx.array(tokens), max_tokens=N_TOKENS)
    return [r.token for r in out]


def translated_tokens(pair, tr, tokens):
    h = handoff(pair, tr, tokens)
    out = stream_generate(pair.target.model, pair.tokenizer, mx.array(tokens[-1:]),
                          max_tokens=N_TOKENS, prompt_cache=h.target_cache)  # fmt: skip
    return [r.token for r in out]


def write_known(layout, pair, answer, folder: Path) -> Path:
    """The exact known-answer maps, written as each public writer (or torch) writes them."""
    K = [np.asarray(m, np.float32) for m in answer["key_maps"]]  # x @ W orientation
    V = [np.asarray(m, np.float32) for m in answer["value_maps"]]
    g = pair.target.geometry
    L = g.layers
    if layout in ("knlp", "knlp_stage2"):  # F.linear weights [L, out, in]
        kw, vw = np.stack([k.T for k in K]), np.stack([v.T for v in V])
        geo = pw.knlp_geometry(g.layers, g.kv_heads, g.head_dim)
        if layout == "knlp":
            return pw.knlp_translator(folder / "stage1-4b-to-8b.pt", kw, vw, geo, geo)
        return pw.knlp_stage2_checkpoint(folder / "stage2-4b-to-8b-step3.pt", kw, vw, geo, geo)
    if layout == "mapper":  # x @ W + b, keys after k_norm
        rows = [[t] for t in range(L)]
        return pw.sr_mapper(folder / "known-mapper", pw.sr_tensors(K, V), rows, g.kv_heads,
                            g.head_dim)  # fmt: skip
    import torch

    R = torch_ref()
    src_rope, tgt_rope, _, _ = parts(R, pair)
    rows = [[t] for t in range(L)]
    gs, gt = geom(pair.source), geom(pair.target)
    ref = R.LinearMapsReference(gs, gt, rows, rows, src_rope, tgt_rope, "post_norm", bias=False)
    with torch.no_grad():
        for t in range(L):
            ref.k_maps[t].weight.copy_(torch.from_numpy(K[t].T))
            ref.v_maps[t].weight.copy_(torch.from_numpy(V[t].T))
    return ref.save(folder / "known-maps.pt")


@pytest.mark.parametrize("layout", ["knlp", "knlp_stage2", "mapper", "linear"])
def test_known_answer_decodes_like_native(known, tiny_dir, tmp_path, layout):
    if layout != "mapper":
        pytest.importorskip("torch")
    src = write_known(layout, known, tiny_dir["known_answer"], tmp_path)
    out, done = conv.convert_file(src, tmp_path / "known.safetensors", pair=known)
    assert done.config.key_cut == ("pre_norm" if layout.startswith("knlp") else "post_norm")
    tr = load_translator(out, known)
    tokens = known.tokenizer.encode(PROMPT)
    native = native_tokens(known, tokens)
    assert len(native) == N_TOKENS
    assert translated_tokens(known, tr, tokens) == native


# -- the three files of issue #13, through the command line, no model pair ---------------


def test_public_files_convert_from_the_command_line(known, tiny_dir, tmp_path):
    """A knlp translator (its real cut string), a semantic-router directory (its nested
    `compatibility`), a knlp stage-2 checkpoint (weights under `translator`, no cut)."""
    pytest.importorskip("torch")
    inputs = [
        (write_known("knlp", known, tiny_dir["known_answer"], tmp_path), []),
        (write_known("mapper", known, tiny_dir["known_answer"], tmp_path), ["--source-layers", "4"]),
        (write_known("knlp_stage2", known, tiny_dir["known_answer"], tmp_path), []),
    ]  # fmt: skip
    tokens = known.tokenizer.encode(PROMPT)
    native = native_tokens(known, tokens)[:12]
    for i, (f, extra) in enumerate(inputs):
        out = tmp_path / f"issue{i}.safetensors"
        r = CliRunner().invoke(convert_cmd, [str(f), "-o", str(out), *extra])
        assert r.exit_code == 0, r.output
        assert "wrote" in r.output
        tr = load_translator(out, known)
        assert translated_tokens(known, tr, tokens)[:12] == native


# -- the mapper directory converts without torch -----------------------------------------


def write_mapper_numpy(folder: Path, answer, L: int, **manifest_changes) -> Path:
    """A semantic-router directory (numpy only) holding the exact known-answer maps."""
    rows = [[t] for t in range(L)]
    tensors = pw.sr_tensors(answer["key_maps"], answer["value_maps"])
    return pw.sr_mapper(folder, tensors, rows, 2, 32, source_model="a", target_model="b",
                        source_revision="r1", target_revision="r2", **manifest_changes)  # fmt: skip


def resum(folder: Path) -> None:
    pw.sr_checksums(folder)


def test_mapper_converts_without_torch(known, tiny_dir, tmp_path, monkeypatch):
    d = write_mapper_numpy(tmp_path / "m", tiny_dir["known_answer"], 4)
    monkeypatch.setitem(sys.modules, "torch", None)  # `import torch` now fails
    out, done = conv.convert_file(d, tmp_path / "o.safetensors", source_layers=4)
    assert done.config.source.layers == 4 and done.config.bias
    meta = read_metadata(out)
    assert meta["source"]["name"] == "a" and meta["provenance"]["target_revision"] == "r2"
    tr = load_translator(out, known)
    tokens = known.tokenizer.encode(PROMPT)
    assert translated_tokens(known, tr, tokens)[:10] == native_tokens(known, tokens)[:10]
    # and a PyTorch file says torch is needed
    (tmp_path / "x.pt").write_bytes(b"PK\x03\x04not really")
    with pytest.raises(conv.ConversionError, match="needs torch"):
        conv.convert(tmp_path / "x.pt")


# -- unsafe pickles are refused, never executed -------------------------------------------


class _Evil:
    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return (exec, (f"open({self.marker!r}, 'w').write('pwned')",))


def test_unsafe_pickle_is_refused(tmp_path):
    import torch

    marker = tmp_path / "MARKER"
    evil = tmp_path / "evil.pt"
    torch.save({"schema": "kv_lingo_translator_v1", "payload": _Evil(marker)}, str(evil))
    with pytest.raises(conv.UnsafePickleError, match="refused"):
        conv.convert(evil)
    with pytest.raises(conv.UnsafePickleError):
        conv.convert(evil, layout="linear_state_dict", key_cut="post_norm", layer_map="identity",
                     source=conv.common.side(1, 1, 2), target=conv.common.side(1, 1, 2))  # fmt: skip
    r = CliRunner().invoke(convert_cmd, [str(evil), "-o", str(tmp_path / "o.safetensors")])
    assert r.exit_code != 0 and "UnsafePickleError" in r.output
    assert not marker.exists()
    # the file is live: an unsafe load would have run it
    torch.load(str(evil), weights_only=False)
    assert marker.read_text() == "pwned"


# -- bad inputs: one specific error each --------------------------------------------------


@pytest.fixture
def mapper(tiny_dir, tmp_path):
    return write_mapper_numpy(tmp_path / "mapper", tiny_dir["known_answer"], 4)


def test_mapper_checksum_mismatch(mapper):
    data = bytearray((mapper / "weights.safetensors").read_bytes())
    data[-3] ^= 0xFF
    (mapper / "weights.safetensors").write_bytes(bytes(data))
    with pytest.raises(conv.ChecksumError, match="checksum mismatch for weights.safetensors"):
        conv.convert(mapper, source_layers=4)
    (mapper / "SHA256SUMS").unlink()
    with pytest.raises(conv.ChecksumError, match="no SHA256SUMS"):
        conv.convert(mapper, source_layers=4)


def test_mapper_checksum_checked_before_manifest(mapper):
    (mapper / "manifest.json").write_text("{not json")
    with pytest.raises(conv.ChecksumError, match="manifest.json"):
        conv.convert(mapper, source_layers=4)


def test_mapper_missing_tensor(mapper):
    from safetensors.numpy import load_file, save_file

    t = load_file(str(mapper / "weights.safetensors"))
    del t["target.2.v.W"]
    save_file(t, str(mapper / "weights.safetensors"))
    resum(mapper)
    with pytest.raises(conv.MissingTensorError, match=r"target\.2\.v\.W"):
        conv.convert(mapper, source_layers=4)


def test_mapper_shape_contradicts_manifest(mapper):
    m = json.loads((mapper / "manifest.json").read_text())
    m["source_layers_per_target"]["k"]["1"] = [0, 1]  # nu 2, but W holds one layer
    (mapper / "manifest.json").write_text(json.dumps(m))
    resum(mapper)
    with pytest.raises(conv.ShapeMismatchError, match=r"target\.1\.k\.W has shape \(64, 64\)"):
        conv.convert(mapper, source_layers=4)
    m["source_layers_per_target"]["k"]["1"] = [1]
    m["compatibility"]["head_dim"] = 16
    (mapper / "manifest.json").write_text(json.dumps(m))
    resum(mapper)
    with pytest.raises(conv.ShapeMismatchError, match="imply"):
        conv.convert(mapper, source_layers=4)


def test_mapper_unknown_schema_and_refusals(mapper, tiny_dir, tmp_path):
    bad = write_mapper_numpy(tmp_path / "v9", tiny_dir["known_answer"], 4, schema_version=9)
    with pytest.raises(conv.UnknownSchemaError, match="schema_version 9"):
        conv.convert(bad, source_layers=4)
    rot = write_mapper_numpy(
        tmp_path / "rot", tiny_dir["known_answer"], 4, rope_stripped_on_keys=False
    )
    with pytest.raises(conv.UnsupportedError, match="rotated keys"):
        conv.convert(rot, source_layers=4)
    with pytest.raises(conv.InvalidInputError, match="--source-layers"):
        conv.convert(mapper)
    order = write_mapper_numpy(
        tmp_path / "order", tiny_dir["known_answer"], 4, compatibility__head_order="interleaved"
    )
    with pytest.raises(conv.UnsupportedError, match="head_order 'interleaved'"):
        conv.convert(order, source_layers=4)


def test_mapper_without_compatibility_is_named(mapper):
    """Variant, heads and names at the top level (no public writer does that): say where
    semantic-router keeps them instead of `unknown variant None`."""
    m = json.loads((mapper / "manifest.json").read_text())
    compat = m.pop("compatibility")
    m.update(compat)
    (mapper / "manifest.json").write_text(json.dumps(m))
    resum(mapper)
    with pytest.raises(conv.UnknownSchemaError, match="no 'compatibility' object"):
        conv.convert(mapper, source_layers=4)


def test_mapper_nan(mapper):
    from safetensors.numpy import load_file, save_file

    t = load_file(str(mapper / "weights.safetensors"))
    t["target.3.k.W"][5, 7] = np.nan
    save_file(t, str(mapper / "weights.safetensors"))
    resum(mapper)
    with pytest.raises(conv.NonFiniteWeightError, match=r"target\.3\.k\.W .*index \(5, 7\)"):
        conv.convert(mapper, source_layers=4)


def test_mapper_geometry_against_pair(mapper, models):
    pair = load_pair(models["qwen3"], models["llama"])
    with pytest.raises(conv.GeometryMismatchError, match="target geometry"):
        conv.convert(mapper, pair=pair)


def _v1_file(torch, f, **changes):
    """A knlp translator artifact (2 layers, 1 head of 4) with top-level `changes`."""
    g = pw.knlp_geometry(2, 1, 4)
    pw.knlp_translator(f, torch.randn(2, 4, 4), torch.randn(2, 4, 4), g, g)
    d = torch.load(str(f), weights_only=True)
    d.update(changes)
    torch.save(d, str(f))


def test_v1_bad_inputs(tmp_path):
    torch = pytest.importorskip("torch")
    f = tmp_path / "t.pt"

    def check(exc, match, **changes):
        _v1_file(torch, f, **changes)
        with pytest.raises(exc, match=match):
            conv.convert(f)

    check(
        conv.UnknownSchemaError,
        "unknown schema 'kv_lingo_translator_v2'",
        schema="kv_lingo_translator_v2",
    )
    check(
        conv.MissingTensorError,
        r"missing \['value_weight'\]",
        state_dict={"key_weight": torch.randn(2, 4, 4)},
    )
    nan = torch.randn(2, 4, 4)
    nan[1, 2, 3] = float("nan")
    check(conv.NonFiniteWeightError, r"state_dict.value_weight .*\(1, 2, 3\)",
          state_dict={"key_weight": torch.randn(2, 4, 4), "value_weight": nan})  # fmt: skip
    check(conv.ShapeMismatchError, r"imply \[target_layers, Ht\*Dt, Hs\*Ds\] = \[2, 4, 4\]",
          state_dict={"key_weight": torch.randn(2, 4, 8), "value_weight": torch.randn(2, 4, 4)})  # fmt: skip
    check(conv.UnsupportedError, "equal depth", target_geometry=pw.knlp_geometry(3, 1, 4))
    check(
        conv.InvalidInputError, "width 9", target_geometry={**pw.knlp_geometry(2, 1, 4), "width": 9}
    )
    check(conv.UnsupportedError, "cut 'k:post_rope' is not one we can convert.*--key-cut",
          cut="k:post_rope")  # fmt: skip
    check(conv.UnexpectedTensorError, "key_bias", state_dict={
        "key_weight": torch.randn(2, 4, 4), "value_weight": torch.randn(2, 4, 4), "key_bias": torch.randn(2, 4)})  # fmt: skip
    check(conv.InvalidInputError, "direction '4b-to-8b' names",
          source={"name": "Qwen/Qwen3-8B", "revision": "x"},
          target={"name": "Qwen/Qwen3-4B", "revision": "y"})  # fmt: skip
    _v1_file(torch, f)
    done = conv.convert(f)
    assert done.config.key_cut == "pre_norm" and done.provenance["stage2_checkpoint"] is False
    assert done.provenance["original_cut"] == pw.KNLP_CUT
    assert done.provenance["knlp_provenance"]["samples"] == 8
    # an explicit key cut for an unrecognised cut string converts, and says so
    _v1_file(torch, f, cut="keys from somewhere")
    done = conv.convert(f, key_cut="pre_norm")
    assert done.provenance["key_cut_override"] is True
    assert done.provenance["original_cut"] == "keys from somewhere"
    r = CliRunner().invoke(convert_cmd, [str(f), "-o", str(tmp_path / "o.safetensors"),
                                         "--key-cut", "post_norm"])  # fmt: skip
    assert r.exit_code == 0, r.output
    prov = read_metadata(tmp_path / "o.safetensors")["provenance"]
    assert prov["key_cut"] == "post_norm" and prov["key_cut_override"] is True
    # a stage-2 checkpoint with its weights missing, or with a cut it never has
    g = pw.knlp_geometry(2, 1, 4)
    pw.knlp_stage2_checkpoint(f, torch.randn(2, 4, 4), torch.randn(2, 4, 4), g, g)
    d = torch.load(str(f), weights_only=True)
    torch.save({k: v for k, v in d.items() if k != "translator"}, str(f))
    with pytest.raises(conv.MissingTensorError, match="no 'translator'"):
        conv.convert(f)
    torch.save({**d, "cut": pw.KNLP_CUT}, str(f))
    with pytest.raises(conv.UnexpectedTensorError, match="has no 'cut'"):
        conv.convert(f)
    torch.save({"weights": torch.randn(3)}, str(f))
    with pytest.raises(conv.UnknownSchemaError, match="unknown layout"):
        conv.convert(f)


def test_direction_is_checked(known, tiny_dir, tmp_path):
    """Equal geometry both ways (qwen3 <-> its known-answer rewrite): only the names the file
    declares tell the direction. Refused at conversion and when loading the converted file."""
    pytest.importorskip("torch")
    src, tgt = (Path(known.source.name).name, Path(known.target.name).name)
    K = [np.asarray(m).T for m in tiny_dir["known_answer"]["key_maps"]]
    g = pw.knlp_geometry(4, 2, 32)
    f = pw.knlp_translator(tmp_path / "t.pt", np.stack(K), np.stack(K), g, g, direction="x",
                           source=(f"org/{src}", "r1"), target=(f"org/{tgt}", "r2"))  # fmt: skip
    back = known.reversed()
    with pytest.raises(conv.DirectionError, match="other direction"):
        conv.convert_file(f, tmp_path / "no.safetensors", pair=back)
    assert not (tmp_path / "no.safetensors").exists()
    out, _ = conv.convert_file(f, tmp_path / "t.safetensors")  # names kept from the file
    load_translator(out, known)  # the right way round
    with pytest.raises(TranslatorFileError, match="goes the other way"):
        load_translator(out, back)


def test_linear_bad_inputs(tmp_path):
    torch = pytest.importorskip("torch")
    f = tmp_path / "m.pt"
    sd = {f"{k}_maps.{t}.weight": torch.randn(4, 4) for k in "kv" for t in range(2)}
    s = conv.common.side(2, 1, 4)
    torch.save(sd, str(f))
    with pytest.raises(conv.InvalidInputError, match="does not say its geometry"):
        conv.convert(f)
    with pytest.raises(conv.InvalidInputError, match="key cut must be given"):
        conv.convert(f, source=s, target=s, layer_map="identity")
    with pytest.raises(conv.InvalidInputError, match="no layer map"):
        conv.convert(f, source=s, target=s, key_cut="post_norm")
    (tmp_path / "m.pt.json").write_text(
        json.dumps({"layer_map": [[0], [0]], "key_cut": "pre_norm"})
    )
    with pytest.raises(
        conv.InvalidInputError, match="key_cut: the sidecar and command line disagree"
    ):
        conv.convert(f, source=s, target=s, key_cut="post_norm")
    done = conv.convert(f, source=s, target=s)
    assert done.provenance["sidecar"] == "m.pt.json" and done.config.key_layers == ((0,), (0,))
    del sd["v_maps.1.weight"]
    torch.save(sd, str(f))
    with pytest.raises(conv.MissingTensorError, match=r"v_maps\.1\.weight"):
        conv.convert(f, source=s, target=s)
    sd["v_maps.1.weight"] = torch.randn(4, 8)
    torch.save(sd, str(f))
    with pytest.raises(
        conv.ShapeMismatchError, match=r"v_maps\.1\.weight has shape \(4, 8\).*\(4, 4\)"
    ):
        conv.convert(f, source=s, target=s)
    sd["v_maps.1.weight"] = torch.randn(4, 4)
    sd["extra.weight"] = torch.randn(4, 4)
    torch.save(sd, str(f))
    with pytest.raises(conv.UnexpectedTensorError, match="extra.weight"):
        conv.convert(f, source=s, target=s)


def test_cli_checks_geometry_against_pair(mapper, tiny_dir, tmp_path):
    out = tmp_path / "o.safetensors"
    run = CliRunner().invoke
    args = [str(mapper), "-o", str(out), "--source", str(tiny_dir["qwen3"])]
    r = run(convert_cmd, [*args, "--target", str(tiny_dir["known"])])
    assert r.exit_code == 0, r.output
    assert "geometry checked" in r.output
    assert read_metadata(out)["target"]["name"] == str(tiny_dir["known"])
    r = run(convert_cmd, [*args, "--target", str(tiny_dir["llama"]), "-o", str(tmp_path / "x")])
    assert r.exit_code != 0 and "GeometryMismatchError" in r.output
    assert not (tmp_path / "x").exists()


def test_every_subpackage_is_packaged():
    """pyproject lists packages explicitly (to install converters/ as kvlingo_converters)."""
    tomllib = pytest.importorskip("tomllib")
    cfg = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    assert cfg["package-dir"]["kvlingo_converters"] == "converters"
    found = {
        ".".join(p.parent.relative_to(ROOT).parts)
        for p in (ROOT / "mlx_kvlingo").rglob("__init__.py")
        if "__pycache__" not in p.parts
    }
    missing = sorted(found - set(cfg["packages"]))
    assert not missing, f"add {missing} to [tool.setuptools] packages in pyproject.toml"
