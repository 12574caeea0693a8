"""Calibration: data splits, stage 1 on the known-answer pair, stage 2, resumption, evaluation."""

import json

from mlx_kvlingo.calibrate.closed_form import Stage1Config, fit_closed_form
from mlx_kvlingo.calibrate.distill import Stage2Config, TrainingDivergedError, distill
from mlx_kvlingo.data.examples import DataConfig, DataError, load_examples
from mlx_kvlingo.eval.evaluate import evaluate
from mlx_kvlingo.kv.scoring import heldout_scores, kv_error, prepare
from mlx_kvlingo.models.files import load_translator
from mlx_kvlingo.models.pair import load_model, load_pair

import mlx.core as mx
import numpy as np
import pytest


@pytest.fixture(scope="module")
def shape_pair(models):
    return load_pair(models["qwen3"], models["qwen3_moe"])


CFG = DataConfig(min_prefix=32, max_prefix=128, continuation=16, seed=3)


def test_split_is_deterministic_and_disjoint(text_file, known_pair):
    a_train, a_held = load_examples(text_file, known_pair.tokenizer, CFG)
    b_train, b_held = load_examples(text_file, known_pair.tokenizer, CFG)
    assert a_train == b_train and a_held == b_held
    docs = lambda exs: {e.source.split("+")[0] for e in exs}  # noqa: E731
    assert a_held and not docs(a_train) & docs(a_held)
    lengths = [len(e.prefix) for e in a_train]
    assert min(lengths) >= 32 and max(lengths) <= 128 and len(set(lengths)) > 20


def test_chat_switch_points_at_assistant_start(tmp_path, known_pair):
    tok = known_pair.tokenizer
    conv = [{"role": "user", "content": "hello there, how are you doing today?"},
            {"role": "assistant", "content": "fine thanks, and you?"},
            {"role": "user", "content": "good"}, {"role": "assistant", "content": "great to hear"}]  # fmt: skip
    f = tmp_path / "chat.jsonl"
    f.write_text("\n".join(json.dumps({"messages": conv}) for _ in range(3)))
    train, held = load_examples(f, tok, DataConfig(min_prefix=4, heldout_fraction=0.34))
    assert len(held) == 2 and len(train) == 4
    ex = train[0]
    header = tok.encode("<|im_start|>assistant\n")
    assert list(ex.prefix[-len(header) :]) == header
    assert tok.decode(list(ex.continuation)).startswith(("fine thanks", "great to hear"))


def test_bad_data_errors(tmp_path, known_pair):
    tok = known_pair.tokenizer
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"messages": [{"role": "user", "content": "hi"}]}\n{not json}\n')
    with pytest.raises(DataError, match=r"bad.jsonl:2: not valid JSON"):
        load_examples(bad, tok)
    empty = tmp_path / "empty.txt"
    empty.write_text("  \n")
    with pytest.raises(DataError, match="empty text file"):
        load_examples(empty, tok)
    short = tmp_path / "short.txt"
    short.write_text("a b c")
    with pytest.raises(DataError, match="no documents long enough"):
        load_examples(short, tok)
    with pytest.raises(DataError, match="no such file"):
        load_examples(tmp_path / "missing", tok)


def test_stage1_recovers_known_answer(text_file, tiny_dir):
    # float64 models: float32 rounding, amplified by the random model's ill-conditioned
    # directions, would otherwise dominate the 1e-4 comparison
    pair = load_pair(
        load_model(tiny_dir["qwen3"], mx.float64), load_model(tiny_dir["known"], mx.float64)
    )
    train, _ = load_examples(text_file, pair.tokenizer, CFG)
    answer = tiny_dir["known_answer"]
    tr = fit_closed_form(pair, train[:100], Stage1Config(bias=False, alpha=1e-12))
    np.testing.assert_allclose(np.array(tr.key["weight"]), np.stack(answer["key_maps"]), atol=1e-4)
    np.testing.assert_allclose(
        np.array(tr.value["weight"]), np.stack(answer["value_maps"]), atol=1e-4
    )


def test_stage1_headwise_and_layer_selection(text_file, shape_pair, known_pair):
    train, _ = load_examples(text_file, shape_pair.tokenizer, CFG)
    tr = fit_closed_form(shape_pair, train[:20], Stage1Config(nu=2, window=1))
    assert tr.config.nu_k == 2 and len(tr.config.key_layers) == shape_pair.target.geometry.layers
    hw = fit_closed_form(known_pair, train[:20], Stage1Config(variant="headwise"))
    assert hw.key["weight"].shape == (4, 2, 32, 32)


@pytest.fixture(scope="module")
def shape_data(text_file, shape_pair):
    return load_examples(text_file, shape_pair.tokenizer, DataConfig(16, 48, 12, seed=1))


def test_stage2_lowers_heldout_kl(shape_pair, shape_data):
    train, held = shape_data
    tr = fit_closed_form(shape_pair, train[:30], Stage1Config())
    prepared = [prepare(shape_pair, e, "post_norm") for e in held[:8]]
    before = heldout_scores(tr, shape_pair, prepared)[0]
    distill(tr, shape_pair, train, held, Stage2Config(steps=40, learning_rate=3e-5, warmup=4, accumulate=4,
            eval_every=40, eval_examples=8))  # fmt: skip
    after = heldout_scores(tr, shape_pair, prepared)[0]
    assert after < before
    assert tr.config.metadata["calibration"]["stage2"]["steps"] == 40


def test_resume_equals_uninterrupted(shape_pair, shape_data, tmp_path):
    train, held = shape_data
    cfg = Stage2Config(
        steps=6, learning_rate=1e-3, warmup=2, accumulate=2, eval_every=100, save_every=100
    )
    base = fit_closed_form(shape_pair, train[:10], Stage1Config())
    weights = {k: v for k, v in base.parameters().items()}

    def fresh():
        tr = fit_closed_form(shape_pair, train[:10], Stage1Config())
        tr.update(weights)
        return tr

    steps = []  # progress(step, steps, note) after each step, the faces draw it
    full = distill(fresh(), shape_pair, train, (), cfg, progress=lambda *a: steps.append(a))
    assert [(s, n) for s, n, _ in steps] == [(s, 6) for s in range(1, 7)]
    assert all(note.startswith("loss ") and note.endswith(" tok/s") for _, _, note in steps)
    part = distill(fresh(), shape_pair, train, (), cfg, tmp_path / "ck", stop_after=3)
    assert json.loads((tmp_path / "ck" / "state.json").read_text())["step"] == 3
    resumed = distill(fresh(), shape_pair, train, (), cfg, tmp_path / "ck")
    assert part is not resumed
    for kind in ("key", "value"):
        np.testing.assert_allclose(
            np.array(getattr(resumed, kind)["weight"]),
            np.array(getattr(full, kind)["weight"]),
            atol=1e-6,
        )


def test_nan_loss_stops_and_keeps_checkpoint(shape_pair, shape_data, tmp_path):
    train, _ = shape_data
    tr = fit_closed_form(shape_pair, train[:10], Stage1Config())
    tr.value["weight"] = tr.value["weight"] * float("inf")
    with pytest.raises(TrainingDivergedError, match="at step 1"):
        distill(tr, shape_pair, train, (), Stage2Config(steps=3), tmp_path / "ck")
    assert (tmp_path / "ck" / "translator.safetensors").exists()


def test_evaluation_known_answer_and_raw(text_file, models, tiny_dir):
    """Source = the known-answer source with a perturbed output head: same cache, worse predictions."""
    from helpers import exact_translator

    pair = load_pair(load_model(tiny_dir["qwen3_head"]), models["known"])
    _, held = load_examples(text_file, pair.tokenizer, CFG)
    result = evaluate(pair, exact_translator(pair, tiny_dir["known_answer"]), held[:6])
    assert result["source"]["nll"] > result["native"]["nll"] + 0.1
    assert result["translated"]["gap_recovered"] == pytest.approx(1.0, abs=1e-3)
    assert result["translated"]["kl_native"] < 1e-4
    assert result["translated"]["agree_native"] == 1.0
    assert result["raw"]["kl_native"] > 0.05  # a raw cache does not reach the ceiling
    assert result["raw"]["agree_native"] < 0.5  # (its NLL on real text means little: random models)


def test_fit_many_equals_separate_fits(text_file, shape_pair):
    """Configs fitted together from one pass equal the same configs fitted alone."""
    from mlx_kvlingo.calibrate.closed_form import fit_many

    train, _ = load_examples(text_file, shape_pair.tokenizer, CFG)
    maps = [[0, 1]] * 3 + [[2, 3]] * 3
    cfgs = [Stage1Config(nu=1), Stage1Config(nu=2, key_layers=maps, value_layers=maps)]
    seen = []  # progress(done, total) after each example: mlx-lm's prompt progress shape
    together = fit_many(shape_pair, train[:6], cfgs, lambda d, t: seen.append((d, t)))
    assert seen == [(i, 6) for i in range(1, 7)]
    for cfg, tr in zip(cfgs, together):
        alone = fit_closed_form(shape_pair, train[:6], cfg)
        for kind in ("key", "value"):
            for name in ("weight", "bias"):
                np.testing.assert_allclose(
                    np.array(getattr(tr, kind)[name]),
                    np.array(getattr(alone, kind)[name]),
                    atol=1e-5,
                )


def test_stage2_keeps_the_heldout_best_and_stops_early(shape_pair, shape_data, tmp_path):
    train, held = shape_data
    start = fit_closed_form(shape_pair, train[:30], Stage1Config())
    before = {k: np.array(getattr(start, k)["weight"]) for k in ("key", "value")}
    # a learning rate this large only makes the fit worse: the best is the starting point,
    # returned unchanged, and patience 2 stops the run after two evaluations
    cfg = Stage2Config(steps=20, learning_rate=0.5, warmup=1, eval_every=1, eval_examples=4,
                       patience=2, save_every=100)  # fmt: skip
    tr = distill(start, shape_pair, train, held, cfg, tmp_path / "ck")
    s2 = tr.config.metadata["calibration"]["stage2"]
    assert s2["stopped_early"] == "patience" and s2["steps"] == 2
    assert s2["best"]["step"] == 0 and all(k >= s2["best"]["heldout_kl"] for _, k in s2["heldout_kl_history"])  # fmt: skip
    for kind in ("key", "value"):
        np.testing.assert_array_equal(np.array(getattr(tr, kind)["weight"]), before[kind])
    assert not (tmp_path / "ck" / "best.safetensors").exists()  # never improved on the start
    # "held-out" = the 4 training examples, so training improves it: the evaluated point with
    # the lowest KL is what comes back, and what best.safetensors holds
    tr = fit_closed_form(shape_pair, train[:30], Stage1Config())
    cfg = Stage2Config(steps=8, learning_rate=1e-3, warmup=1, eval_every=2, eval_examples=4)
    distill(tr, shape_pair, train[:4], train[:4], cfg, tmp_path / "ck2")
    s2 = tr.config.metadata["calibration"]["stage2"]
    points = [(0, s2["best"]["start_heldout_kl"]), *s2["heldout_kl_history"]]
    assert min(points, key=lambda p: p[1]) == (s2["best"]["step"], s2["best"]["heldout_kl"])
    assert s2["best"]["step"] > 0, points
    prepared = [prepare(shape_pair, e, "post_norm") for e in train[:4]]
    assert heldout_scores(tr, shape_pair, prepared)[0] == pytest.approx(
        s2["best"]["heldout_kl"], rel=1e-5
    )
    best = load_translator(tmp_path / "ck2" / "best.safetensors")
    np.testing.assert_allclose(np.array(best.key["weight"]), np.array(tr.key["weight"]), atol=1e-6)


@pytest.mark.parametrize("steps", [0, 2])
def test_build_scripts_evaluate_distill_and_save(shape_pair, shape_data, tmp_path, steps):
    """weights/build/translator_build.py, what both translator build steps run per translator."""
    from argparse import Namespace

    from helpers import build_module

    build = build_module("translator_build")
    train, held = shape_data
    tr = fit_closed_form(shape_pair, train[:30], Stage1Config())
    path, data = tmp_path / "t.safetensors", {"train": "test text", "examples": 30}
    args = Namespace(steps=steps, lr=1e-5, accumulate=1)
    row = build.evaluate_distill_save(tr, shape_pair, "t", train[30:], held[:4], held[4:8], args,
                                      path, data)  # fmt: skip
    loaded = load_translator(path, shape_pair)
    cal = loaded.config.metadata["calibration"]
    assert cal["data"] == data and cal["stage1"]["heldout"] == row["heldout"]["stage1"]
    assert row["stage2_steps"] == steps and row["bytes"] == path.stat().st_size
    assert row["sha256"] == build.sha256(path) and len(row["sha256"]) == 64
    if steps:
        assert (
            cal["stage2"]["steps"] == steps and cal["stage2"]["heldout"] == row["heldout"]["stage2"]
        )
    else:
        assert row["heldout"]["stage2"] is None and "heldout" not in cal.get("stage2", {})


def test_kv_error_is_zero_for_the_exact_maps_and_two_for_zero_maps(text_file, known_pair, tiny_dir):
    from helpers import exact_translator

    ex = load_examples(text_file, known_pair.tokenizer, CFG)[0][0]
    prep = prepare(known_pair, ex, "post_norm", native_kv=True)
    tr = exact_translator(known_pair, tiny_dir["known_answer"])
    assert kv_error(tr, prep).item() < 1e-5
    tr.key["weight"], tr.value["weight"] = (
        mx.zeros_like(tr.key["weight"]),
        mx.zeros_like(tr.value["weight"]),
    )
    assert kv_error(tr, prep).item() == pytest.approx(2.0, abs=1e-6)
    with pytest.raises(ValueError, match="native_kv"):
        kv_error(tr, prepare(known_pair, ex, "post_norm"))


def test_stage2_kv_weight_pulls_the_maps_toward_the_native_kv(text_file, known_pair, tiny_dir):
    from helpers import exact_translator

    train, held = load_examples(text_file, known_pair.tokenizer, CFG)
    probe = [prepare(known_pair, e, "post_norm", native_kv=True) for e in held[:4]]
    errors = {}
    for weight in (0.0, 10.0):
        tr = exact_translator(known_pair, tiny_dir["known_answer"])
        noise = mx.random.normal(tr.key["weight"].shape, key=mx.random.key(0)) * 0.01
        tr.key["weight"] = tr.key["weight"] + noise
        tr.value["weight"] = tr.value["weight"] + noise
        cfg = Stage2Config(steps=12, learning_rate=1e-3, warmup=1, eval_every=100, kv_weight=weight)
        distill(tr, known_pair, train, (), cfg)
        errors[weight] = float(np.mean([kv_error(tr, p).item() for p in probe]))
    assert errors[10.0] < 0.8 * errors[0.0]
    with pytest.raises(ValueError, match="kv_weight"):
        Stage2Config(kv_weight=-1.0)


def test_cli_steps_default_is_stage_2s():
    """`kvlingo calibrate --steps` states its default (its module imports no stage-2 code)."""
    from mlx_kvlingo.cli.calibrate import calibrate_cmd

    [steps] = [p for p in calibrate_cmd.params if p.name == "steps"]
    assert steps.default == Stage2Config.steps
