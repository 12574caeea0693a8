"""The low-rank translator: exact recovery of rank-r maps, full width = full rank, the runtime
map against its multiplied-out form, the file, and `kvlingo calibrate --rank`."""

import json

from mlx_kvlingo.calibrate.closed_form import Moments, Stage1Config
from mlx_kvlingo.calibrate.distill import Stage2Config, distill
from mlx_kvlingo.calibrate.lowrank import balance_codes, factor, fit_lowrank_with_full
from mlx_kvlingo.cli import cli
from mlx_kvlingo.data.examples import DataConfig, load_examples
from mlx_kvlingo.kv.capture import trace
from mlx_kvlingo.kv.lowrank import LowRankTranslator, multiply_adds
from mlx_kvlingo.kv.translator import Side, Translator, TranslatorConfig
from mlx_kvlingo.models.files import (
    TranslatorFileError,
    load_translator,
    read_metadata,
    save_translator,
)

import mlx.core as mx
import numpy as np
import pytest
from click.testing import CliRunner

CFG = DataConfig(min_prefix=32, max_prefix=128, continuation=16, seed=3)


def _exact_rank_problem(rng, nu, rank, ls=3, lt=5, d=12, dt=10, n=400):
    """Moments of data whose maps are exactly rank `rank` per source layer, and the truth."""
    xs = [rng.normal(size=(n, d)) @ rng.normal(size=(d, d)) + rng.normal(size=d) for _ in range(ls)]
    enc = [rng.normal(size=(d, rank)) for _ in range(ls)]
    rows = [tuple(sorted({t % ls, (t + 1) % ls}))[:nu] for t in range(lt)]
    ys, truth = [], []
    for row in rows:
        x = np.concatenate([xs[s] for s in row], 1)
        dec = rng.normal(size=(nu * rank, dt))
        w = np.concatenate([enc[s] @ dec[j * rank : (j + 1) * rank] for j, s in enumerate(row)])
        b = rng.normal(size=dt)
        ys.append(x @ w + b)
        truth.append((w, b))
    return rows, _moments(np.stack(xs), np.stack(ys), rows), truth


def _moments(xs, ys, rows):
    """`Moments` of one example with source features xs (Ls, n, d), target ys (Lt, n, dt)."""
    m = Moments()
    m.add({"key": (xs, ys)}, [("key", t, row) for t, row in enumerate(rows)], xs.shape[1])
    return m


def _product(params, rows, rank):
    return [
        np.concatenate(
            [
                params["encoder"][s] @ params["decoder"][t][j * rank : (j + 1) * rank]
                for j, s in enumerate(row)
            ]  # fmt: skip
        )
        for t, row in enumerate(rows)
    ]


@pytest.mark.parametrize("nu", [1, 2])
def test_fit_recovers_maps_of_exactly_rank_r(nu):
    rng = np.random.default_rng(nu)
    rows, moments, truth = _exact_rank_problem(rng, nu, rank=4)
    params, report = factor(rows, moments, "key", 3, 4, Stage1Config(alpha=0.0))
    for w, (w_true, b_true), b in zip(_product(params, rows, 4), truth, params["bias"]):
        np.testing.assert_allclose(w, w_true, atol=1e-8)
        np.testing.assert_allclose(b, b_true, atol=1e-8)
    assert report["r2_min"] > 1 - 1e-12
    # one rank fewer cannot hold them: the check above is not vacuous
    params, report = factor(rows, moments, "key", 3, 3, Stage1Config(alpha=0.0))
    assert report["r2_min"] < 0.999


def test_fit_is_the_reduced_rank_optimum_for_nu_1():
    """Noisy full-rank maps from anisotropic inputs: the whitened SVD's rank-3 encoder beats
    the plain SVD of the stacked maps and random encoders (each with its best decoders)."""
    rng = np.random.default_rng(7)
    n, d, dt, rank = 600, 10, 8, 3
    x = (
        rng.normal(size=(n, d))
        * np.geomspace(10, 0.1, d)
        @ np.linalg.qr(rng.normal(size=(d, d)))[0]
    )
    rows = [(0,), (0,)]
    ys = [x @ rng.normal(size=(d, dt)) + rng.normal(size=(n, dt)) for _ in rows]
    moments = _moments(x[None], np.stack(ys), rows)
    params, _ = factor(rows, moments, "key", 1, rank, Stage1Config(alpha=0.0, bias=False))

    def sse(enc):  # best decoders for this encoder, on the data
        z = x @ enc
        return sum(float(((z @ np.linalg.lstsq(z, y, rcond=None)[0] - y) ** 2).sum()) for y in ys)

    w = np.concatenate([np.linalg.lstsq(x, y, rcond=None)[0] for y in ys], axis=1)
    best = sse(params["encoder"][0])
    assert best < 0.999 * sse(np.linalg.svd(w)[0][:, :rank])
    assert all(best <= sse(rng.normal(size=(d, rank))) for _ in range(20))


@pytest.fixture(scope="module")
def train(text_file, known_pair):
    return load_examples(text_file, known_pair.tokenizer, CFG)[0][:12]


@pytest.mark.parametrize("nu", [1, 2])
def test_full_width_reproduces_full_rank(known_pair, train, nu):
    lt, ls = known_pair.target.geometry.layers, known_pair.source.geometry.layers
    rows = [sorted({t % ls, (t + 1) % ls})[:nu] for t in range(lt)]
    cfg = Stage1Config(nu=nu, key_layers=rows, value_layers=rows)
    width = 2 * 32  # the tiny source: 2 KV heads x 32
    full, (low, wide) = fit_lowrank_with_full(known_pair, train, [width, 1000], cfg, False)
    assert low.config.rank == wide.config.rank == width  # clamped to the per-layer width
    mult = low.full_rank()
    for kind in ("key", "value"):
        for p in ("weight", "bias"):
            a, b = np.array(getattr(mult, kind)[p]), np.array(getattr(full, kind)[p])
            np.testing.assert_allclose(a, b, atol=2e-4 * np.abs(b).max())
    span = trace(known_pair.source, train[0].prefix, "post_norm")
    for a, b in zip(low(span), full(span)):
        np.testing.assert_allclose(np.array(a), np.array(b), atol=1e-3 * np.abs(np.array(b)).max())


def _random_lowrank(known_pair, rank, nu, seed=0):
    src, tgt = known_pair.source.geometry, known_pair.target.geometry
    rows = tuple(
        tuple(sorted({t % src.layers, (t + 2) % src.layers})[:nu]) for t in range(tgt.layers)
    )
    config = TranslatorConfig(
        "lowrank", Side.of(src), Side.of(tgt), rows, rows, bias=True, rank=rank
    )
    tr = LowRankTranslator(config)
    key = mx.random.key(seed)
    for kind in ("key", "value"):
        params = {}
        for name, value in getattr(tr, kind).items():
            key, sub = mx.random.split(key)
            params[name] = mx.random.normal(value.shape, key=sub) * 0.2
        setattr(tr, kind, params)
    return tr


@pytest.mark.parametrize("nu", [1, 2])
def test_runtime_map_equals_multiplied_out(known_pair, train, nu):
    tr = _random_lowrank(known_pair, 8, nu)
    span = trace(known_pair.source, train[0].prefix, "post_norm")
    want = tr.full_rank().translate(span, known_pair.target)
    got = tr.translate(span, known_pair.target)
    for a, b in zip(got[0] + got[1], want[0] + want[1]):
        np.testing.assert_allclose(np.array(a), np.array(b), rtol=1e-4, atol=1e-4)
    # fewer multiply-adds than the mixing map at this rank
    assert multiply_adds(tr.config) < multiply_adds(tr.full_rank().config)
    part = tr.restricted(range(1, 3), source_layers=(3, 1, 2, 0))
    assert part.config.rank == 8 and part.key["decoder"].shape[0] == 2


def test_file_round_trip_and_refusals(known_pair, tmp_path):
    tr = _random_lowrank(known_pair, 8, 2)
    path = save_translator(tr, tmp_path / "lr.safetensors", known_pair)
    back = load_translator(path, known_pair)
    assert isinstance(back, LowRankTranslator) and back.config == tr.config
    with pytest.raises(ValueError, match="lowrank.new_translator picks the class"):
        Translator(tr.config)
    for kind in ("key", "value"):
        for name, v in getattr(tr, kind).items():
            assert mx.array_equal(getattr(back, kind)[name], v)

    def rewrite(name, tensors=None, meta=None):
        t = mx.load(str(path))
        m = read_metadata(path)
        out = tmp_path / name
        mx.save_safetensors(str(out), tensors(t) if tensors else t,
                            metadata={"kvlingo": json.dumps(meta(m) if meta else m)})  # fmt: skip
        return out

    bad = {
        "no rank": (None, lambda m: {k: v for k, v in m.items() if k != "rank"}, "positive integer rank"),
        "rank 0": (None, lambda m: {**m, "rank": 0}, "positive integer rank"),
        "rank text": (None, lambda m: {**m, "rank": "8"}, "rank must be an integer"),
        "wrong rank": (None, lambda m: {**m, "rank": 4}, "tensor key.encoder has shape"),
        "rank on mixing": (None, lambda m: {**m, "variant": "mixing"}, "rank applies to the lowrank"),
        "no encoder": (lambda t: {k: v for k, v in t.items() if k != "value.encoder"}, None,
                       "missing tensors ['value.encoder']"),
        "full-rank weight": (lambda t: {**t, "key.weight": t["key.decoder"]}, None,
                             "unexpected tensors ['key.weight']"),
    }  # fmt: skip
    for name, (tensors, meta, message) in bad.items():
        with pytest.raises(TranslatorFileError, match=message.replace("[", r"\[")):
            load_translator(rewrite(name.replace(" ", "_") + ".safetensors", tensors, meta))


def test_calibrate_cli_rank(tiny_dir, text_file, tmp_path):
    args = ["calibrate", "--source", str(tiny_dir["qwen3"]), "--target", str(tiny_dir["known"]),
            "--data", str(text_file), "--steps", "0", "--max-examples", "8",
            "--eval-examples", "0"]  # fmt: skip
    out = CliRunner().invoke(cli, [*args, "--rank", "16", "-o", str(tmp_path / "r.safetensors")])
    assert out.exit_code == 0, out.output
    tr = load_translator(tmp_path / "r.safetensors")
    assert isinstance(tr, LowRankTranslator) and tr.config.rank == 16
    assert tr.key["encoder"].shape == (4, 64, 16)
    assert tr.config.metadata["calibration"]["stage1"]["rank_requested"] == 16
    ev = ["eval", "--source", str(tiny_dir["qwen3"]), "--target", str(tiny_dir["known"]),
          "--translator", str(tmp_path / "r.safetensors"), "--data", str(text_file), "-n", "2",
          "--json", str(tmp_path / "e.json")]  # fmt: skip
    out = CliRunner().invoke(cli, ev)
    assert out.exit_code == 0, out.output
    assert json.loads((tmp_path / "e.json").read_text())["translated"]["kl_native"] >= 0
    out = CliRunner().invoke(cli, [*args, "--rank", "16", "--variant", "headwise", "-o", "x"])
    assert out.exit_code != 0 and "--rank fits a low-rank translator" in out.output


def test_stage2_trains_the_codes_and_checkpoints_them(known_pair, train, tmp_path):
    tr = _random_lowrank(known_pair, 8, 1)
    before = {k: np.array(v) for k, v in tr.key.items()}
    cfg = Stage2Config(steps=2, warmup=1, eval_every=2, eval_examples=1, save_every=2)
    distill(tr, known_pair, train[:4], train[4:5], cfg, tmp_path / "ckpt", progress=False)
    assert all(not np.array_equal(np.array(tr.key[k]), before[k]) for k in before)
    saved = load_translator(tmp_path / "ckpt" / "translator.safetensors")
    assert isinstance(saved, LowRankTranslator)
    assert mx.array_equal(saved.key["encoder"], tr.key["encoder"])


def test_balanced_codes_keep_the_maps(known_pair):
    tr = _random_lowrank(known_pair, 8, 2)
    tr.key["encoder"] = tr.key["encoder"] * 1e-3  # whitened-fit-like: tiny encoders
    before = tr.full_rank()
    balance_codes(tr)
    after = tr.full_rank()
    for kind in ("key", "value"):
        a, b = np.array(getattr(after, kind)["weight"]), np.array(getattr(before, kind)["weight"])
        np.testing.assert_allclose(a, b, atol=1e-5 * np.abs(b).max())
    # layer 0's key codes: encoder column norm = norm of every decoder row that reads it
    rows, dec = tr.config.key_layers, np.array(tr.key["decoder"])
    reads = [
        dec[t, j * 8 : (j + 1) * 8]
        for t, row in enumerate(rows)
        for j, s in enumerate(row)
        if s == 0
    ]
    d_norm = np.sqrt(sum((d**2).sum(-1) for d in reads))
    np.testing.assert_allclose(
        np.linalg.norm(np.array(tr.key["encoder"][0]), axis=0), d_norm, rtol=1e-4
    )
