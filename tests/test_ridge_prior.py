"""Stage 1 toward a prior map: the ridge limits, a known answer, the identity and file priors,
and the choice of strength on held-out documents."""

from mlx_kvlingo.calibrate.closed_form import (
    Stage1Accumulator,
    Stage1Config,
    fit_closed_form,
    is_validation,
    ridge,
)
from mlx_kvlingo.data.examples import DataConfig, Example, load_examples
from mlx_kvlingo.kv.capture import SpanKV
from mlx_kvlingo.models.files import save_translator
from mlx_kvlingo.models.pair import load_pair

import mlx.core as mx
import numpy as np
import pytest


def _moments(x, y):
    return x.T @ x, x.T @ y, x.sum(0), y.sum(0), len(x)


def test_ridge_toward_prior_limits_and_known_answer():
    rng = np.random.default_rng(0)
    n, d, k = 200, 6, 4
    # centered orthogonal design scaled so that Cxx = s I: the fit has a closed form
    z = rng.standard_normal((n, d))
    q, _ = np.linalg.qr(z - z.mean(0))  # orthonormal columns, each orthogonal to ones
    x = 3.0 * q + rng.standard_normal(d)  # shifted: centering must remove the shift
    a, c, w0 = rng.standard_normal((d, k)), rng.standard_normal(k), rng.standard_normal((d, k))
    y = (x - x.mean(0)) @ a + c
    m = _moments(x, y)
    for alpha in (0.1, 1.0, 7.0):  # lam = alpha * trace(Cxx)/d = alpha * s
        w, b = ridge(*m, alpha, True, w0)
        np.testing.assert_allclose(w, (a + alpha * w0) / (1 + alpha), atol=1e-10)
        np.testing.assert_allclose(b, c - x.mean(0) @ w, atol=1e-10)
    # a huge lambda returns the prior; lambda 0 is the plain fit, prior or not
    np.testing.assert_allclose(ridge(*m, 1e12, True, w0)[0], w0, atol=1e-9)
    np.testing.assert_array_equal(ridge(*m, 0.0, True, w0)[0], ridge(*m, 0.0, True)[0])
    np.testing.assert_allclose(ridge(*m, 0.0, True)[0], a, atol=1e-10)
    # the zero prior is the old ridge
    np.testing.assert_array_equal(
        ridge(*m, 0.5, True, np.zeros((d, k)))[0], ridge(*m, 0.5, True)[0]
    )


@pytest.mark.parametrize("variant", ["mixing", "headwise"])
def test_identity_prior_with_huge_alpha_is_raw_transfer(known_pair, text_file, variant):
    train, _ = load_examples(text_file, known_pair.tokenizer, DataConfig(32, 96, 8, seed=1))
    tr = fit_closed_form(known_pair, train[:4], Stage1Config(variant=variant, prior="identity",
                         alpha=1e12))  # fmt: skip
    for kind in ("key", "value"):
        w = np.array(getattr(tr, kind)["weight"])
        eye = np.eye(w.shape[-1])
        np.testing.assert_allclose(w, np.broadcast_to(eye, w.shape), atol=1e-6)
    assert tr.config.metadata["calibration"]["stage1"]["prior"] == "identity"


def test_file_prior_is_returned_by_huge_alpha_and_ignored_at_zero(known_pair, text_file, tmp_path):
    train, _ = load_examples(text_file, known_pair.tokenizer, DataConfig(32, 96, 8, seed=1))
    related = fit_closed_form(known_pair, train[:6], Stage1Config())
    path = tmp_path / "related.safetensors"
    save_translator(related, path, known_pair)
    pulled = fit_closed_form(known_pair, train[6:9], Stage1Config(prior=str(path), alpha=1e12))
    for kind in ("key", "value"):
        np.testing.assert_allclose(
            np.array(getattr(pulled, kind)["weight"]),
            np.array(getattr(related, kind)["weight"]),
            atol=1e-5,
        )
    plain = fit_closed_form(known_pair, train[6:9], Stage1Config(alpha=0.0))
    free = fit_closed_form(known_pair, train[6:9], Stage1Config(prior=str(path), alpha=0.0))
    np.testing.assert_array_equal(np.array(plain.key["weight"]), np.array(free.key["weight"]))


def test_prior_errors(models, text_file, tmp_path, known_pair):
    shape_pair = load_pair(models["qwen3"], models["qwen3_moe"])
    train, _ = load_examples(text_file, shape_pair.tokenizer, DataConfig(32, 96, 8, seed=1))
    with pytest.raises(ValueError, match="identity prior needs the same KV heads"):
        fit_closed_form(shape_pair, train[:2], Stage1Config(prior="identity"))
    with pytest.raises(ValueError, match="neither one of"):
        Stage1Config(prior=str(tmp_path / "missing.safetensors"))
    with pytest.raises(ValueError, match="alpha must be >= 0"):
        Stage1Config(alpha_grid=(1.0, -1.0))
    hw = fit_closed_form(known_pair, train[:2], Stage1Config(variant="headwise"))
    save_translator(hw, tmp_path / "hw.safetensors", known_pair)
    with pytest.raises(ValueError, match="a headwise translator"):
        fit_closed_form(known_pair, train[:2], Stage1Config(prior=str(tmp_path / "hw.safetensors")))


def _spans(rng, geometry, tokens, noise):
    """A synthetic source span and a target span = source + noise (identity is the truth)."""
    shape = (geometry.layers, 1, geometry.kv_heads, tokens, geometry.head_dim)
    k, v = rng.standard_normal(shape), rng.standard_normal(shape)
    tk, tv = k + noise * rng.standard_normal(shape), v + noise * rng.standard_normal(shape)
    as_mx = lambda a: mx.array(a.astype(np.float32))  # noqa: E731
    return SpanKV(as_mx(k), as_mx(v), 0), SpanKV(as_mx(tk), as_mx(tv), 0)


@pytest.mark.parametrize("prior, expected", [("identity", 1e6), ("zero", 1e-6)])
def test_alpha_grid_picks_strength_on_validation(known_pair, prior, expected):
    # noisy rows (400 to fit 65 parameters per map): least squares fits some noise, so the
    # identity (the truth) wins at full strength; toward zero, shrinking only hurts
    cfg = Stage1Config(prior=prior, alpha_grid=(1e-6, 1e6), native_first=False)
    acc = Stage1Accumulator(known_pair, [cfg])
    rng = np.random.default_rng(0)
    geometry = known_pair.source.geometry
    for i in range(6):
        s, t = _spans(rng, geometry, 200, noise=0.5)
        acc.add(Example((1,) * 20, (1,) * 20, f"doc{i}"), validation=i >= 2, s_span=s, t_span=t)
    (tr,) = acc.solve()
    report = tr.config.metadata["calibration"]["stage1"]
    assert report["validation_examples"] == 4
    for kind in ("key", "value"):
        assert report["alphas"][kind] == [expected] * geometry.layers


def test_validation_split_is_by_document():
    exs = [Example((1,), (2,), f"chat.jsonl:{i}#reply{r}") for i in range(200) for r in (1, 3)]
    sides = {}
    for ex in exs:
        sides.setdefault(ex.source.split("#")[0], set()).add(is_validation(ex, 0.2))
    assert all(len(s) == 1 for s in sides.values())
    share = np.mean([v for s in sides.values() for v in s])
    assert 0.1 < share < 0.3


def test_moments_merge_is_the_sums_of_both_splits():
    """A split of the first examples merged with one of the rest holds exactly what one pass
    accumulates (sums start from the first addition, in order); a reordered pass is only
    rounding-close (control: the exact check can fail)."""
    from mlx_kvlingo.calibrate.closed_form import Moments

    rng = np.random.default_rng(2)
    needed = [("key", t, layers) for t, layers in enumerate([(0,), (0, 1), (1,)])]
    examples = [
        {"key": (rng.standard_normal((2, n, 3)), rng.standard_normal((3, n, 2)))} for n in (5, 7, 4)
    ]
    one, first, rest, reordered = Moments(), Moments(), Moments(), Moments()
    for i, ex in enumerate(examples):
        one.add(ex, needed, 10 + i)
        (first if i < 2 else rest).add(ex, needed, 10 + i)
    for ex in examples[::-1]:
        reordered.add(ex, needed, 0)
    both = first.merged(rest)
    assert (both.n, both.examples, both.tokens) == (one.n, 3, 33) and one.n == 16
    for key in needed:
        for a, b in zip(both.problem(*key), one.problem(*key)):
            np.testing.assert_array_equal(a, b)
    xtx = [reordered.problem(*key)[0] for key in needed]
    assert any(not np.array_equal(a, one.problem(*k)[0]) for a, k in zip(xtx, needed))
    for a, k in zip(xtx, needed):
        np.testing.assert_allclose(a, one.problem(*k)[0], rtol=1e-12)
