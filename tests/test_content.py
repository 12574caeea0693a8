"""The content benchmark: tasks, scoring, exactness with a known-answer translator, the CLI,
and the content calibration data (prefix-gain weights, target-answered examples)."""

import dataclasses
import json

from mlx_kvlingo.cli import cli
from mlx_kvlingo.data.content_tasks import DEFAULT_KINDS, FACT_TYPES, TaskBuilder, build_tasks
from mlx_kvlingo.eval.content import (
    Chat,
    chat_kv,
    contains,
    evaluate_content,
    fitting_tasks,
    native_kv,
    recall,
    rouge_l,
    to_json,
)
from mlx_kvlingo.kv.scoring import kl, native_logp, prefix_gain
from mlx_kvlingo.models.files import load_translator, save_translator

import mlx.core as mx
import pytest
from click.testing import CliRunner
from helpers import exact_translator

TEXT = (
    "The river rose slowly through the night. Farmers moved their cattle to the hills. "
    "By morning the bridge was under water and the school was closed. "
    "Volunteers filled sandbags near the old mill while the rain kept falling. "
    "The mayor asked everyone to stay at home until the water went down. "
    "Two days later the sun came out and the fields began to dry. "
) * 6


@pytest.fixture(scope="module")
def pair(known_pair):
    return known_pair


@pytest.fixture(scope="module")
def exact(pair, tiny_dir):
    return exact_translator(pair, tiny_dir["known_answer"])


def test_scores_known_values():
    assert contains("July 3", "It is on july 3, I think.")
    assert not contains("July 3", "It is on July 30.")  # word boundaries
    assert not contains("", "anything")
    assert recall("The red fox sleeps", "a fox that sleeps") == pytest.approx(2 / 3)
    assert recall("the a of", "x") != recall("the a of", "x")  # NaN: no content words
    assert rouge_l("a b c d", "a b c d") == 1.0
    assert rouge_l("a b c d", "a c") == pytest.approx(2 * (1 * 0.5) / 1.5)
    assert rouge_l("a b", "c d") == 0.0


def test_tasks_are_seeded_and_state_their_answer(pair):
    a = build_tasks(pair.tokenizer, [TEXT], [96], 2, seed=3)
    b = build_tasks(pair.tokenizer, [TEXT], [96], 2, seed=3)
    c = build_tasks(pair.tokenizer, [TEXT], [96], 2, seed=4)
    assert [t.tokens for t in a] == [t.tokens for t in b]
    assert [t.tokens for t in a] != [t.tokens for t in c]
    assert [t.kind for t in a] == [k for k in DEFAULT_KINDS for _ in range(2)]
    for t in a:
        text = pair.tokenizer.decode(list(t.tokens))
        assert t.question in text
        if t.kind in ("fact", "copy"):
            assert t.answer and t.answer in text  # the answer is only in what is read
            assert t.answer not in t.question
        assert abs(len(t.tokens) - 96) <= 24, (t.kind, len(t.tokens))


def test_three_facts_are_read_and_one_is_asked(pair):
    """Each "facts" prompt states three values of three types at three depths and asks for one
    of them: the task's answer is in exactly one stated sentence, at the task's depth."""
    filler = {" ".join(x.split()).rstrip(".") for x in TEXT.split(". ")} - {""}
    asked = set()
    for seed in range(6):
        (t,) = build_tasks(pair.tokenizer, [TEXT], [400], 1, ("facts",), seed=seed)
        user = pair.tokenizer.decode(list(t.tokens)).split("Question:")[0]
        sents = [x.strip().rstrip(".") for x in user.split(". ") if x.strip()]
        sents = [x for x in sents if not any(x.endswith(f) for f in filler)]
        stated = [x for x in sents if x.split("<|im_start|>")[-1].strip()]
        assert len(stated) == 3, stated
        holding = [i for i, x in enumerate(stated) if t.answer in x]
        assert len(holding) == 1 and t.answer not in t.question
        assert t.detail in FACT_TYPES and 0.1 <= t.depth <= 0.9
        asked.add(holding[0])
    assert len(asked) > 1  # not always the first (or last) of the three asked


def test_unknown_kind_and_empty_text_are_refused(pair):
    with pytest.raises(ValueError, match="unknown task kind"):
        TaskBuilder(pair.tokenizer, [TEXT]).build("poem", 64)
    with pytest.raises(ValueError, match="no usable sentences"):
        TaskBuilder(pair.tokenizer, ["too short"])


def _replies(res, condition):
    return [r["reply"] for r in res.records if r["condition"] == condition]


def test_known_answer_translator_answers_as_native(pair, exact):
    """An exact translator gives the native replies token for token: every score is perfect,
    and a wrong one does not (the benchmark can fail)."""
    tasks = build_tasks(pair.tokenizer, [TEXT], [64], 1, seed=0)
    wrong = exact_translator(pair, {"key_maps": [m[::-1] for m in _maps(exact, "key")],
                                    "value_maps": [m[::-1] for m in _maps(exact, "value")]})  # fmt: skip
    res = evaluate_content(pair, tasks, {"translated": exact, "wrong": wrong})
    assert _replies(res, "translated") == _replies(res, "native")
    assert any(r for r in _replies(res, "native"))  # the tiny target does say something
    cells = res.cells()
    for kind in DEFAULT_KINDS:
        assert cells["translated"][kind][64]["rouge_l"] == 1.0
    assert _replies(res, "wrong") != _replies(res, "native")


def test_only_native_right_skips_the_other_paths_where_native_is_wrong(pair):
    """With `only_native_right`, a condition reads only the tasks native answered right (here
    the first, its answer set to native's own reply); the other task keeps its native record."""
    tasks = build_tasks(pair.tokenizer, [TEXT], [64], 1, seed=0, kinds=["fact"]) * 2
    (reply, _) = _replies(evaluate_content(pair, tasks, {}, small=False), "native")
    tasks = [dataclasses.replace(tasks[0], answer=reply), tasks[1]]
    calls = []

    def as_native(pair, task, native):
        calls.append(task.answer)
        return native

    res = evaluate_content(pair, tasks, {"c": as_native}, small=False, only_native_right=True)
    assert calls == [reply]
    read = [(r["task"], r["condition"]) for r in res.records]
    assert read == [(0, "native"), (0, "c"), (1, "native")]
    assert _replies(res, "c") == [reply]


def _maps(tr, kind):
    import numpy as np

    return [np.array(w) for w in getattr(tr, kind)["weight"]]


def test_reused_replies_give_the_same_table_and_only_new_methods_run(pair, exact, monkeypatch):
    """The side-by-side experiment reusing an earlier run's replies (`known_replies`) scores
    exactly as a run that computes everything, translating for the new condition only; other
    tasks are refused."""
    import mlx_kvlingo.eval.content as content

    from weights.experiments.content_side_by_side import known_replies, side_by_side

    tasks = build_tasks(pair.tokenizer, [TEXT], [64], 1, ("fact", "summary"), seed=5)
    wrong = exact_translator(pair, {"key_maps": [m[::-1] for m in _maps(exact, "key")],
                                    "value_maps": [m[::-1] for m in _maps(exact, "value")]})  # fmt: skip
    full = to_json(evaluate_content(pair, tasks, {"A": exact, "B": wrong}), pair)
    earlier = to_json(evaluate_content(pair, tasks, {"A": exact}), pair)
    calls = []
    real = content.translated_kv
    monkeypatch.setattr(content, "translated_kv", lambda *a: calls.append(a) or real(*a))
    monkeypatch.setattr("weights.experiments.content_side_by_side.condition", lambda spec, p: wrong)
    again = side_by_side(pair, tasks, {"B": "wrong.safetensors"}, known_replies(earlier, tasks))
    assert len(calls) == len(tasks)  # B's translations only
    assert again.conditions == ["native", "A", "B", "small"]
    same = json.dumps(again.cells(), sort_keys=True)  # NaN (nothing to retain) == NaN here
    assert same == json.dumps(full["cells"], sort_keys=True)
    other = build_tasks(pair.tokenizer, [TEXT], [64], 1, ("fact", "summary"), seed=6)
    with pytest.raises(ValueError, match="differs"):
        known_replies(earlier, other)


def test_the_chat_condition_reads_its_tail_itself(pair, exact):
    """`Chat(translator, tail, 0)`: the conversation's own hand-off. Prompt positions before
    the cut (the last `tail` tokens) are the translator's, those after it the target's own
    (layer 0's K/V depend on the token alone, so they equal the native ones exactly there, and
    are zero before it under zero maps); with an exact translator the replies are native."""
    tasks = build_tasks(pair.tokenizer, [TEXT], [64], 1, ("fact", "qa"), seed=2)
    zero = exact_translator(pair, {"key_maps": [m * 0 for m in _maps(exact, "key")],
                                   "value_maps": [m * 0 for m in _maps(exact, "value")]})  # fmt: skip
    for task in tasks:
        nk, nv = native_kv(pair.target, list(task.tokens[:-1]))
        for tail in (1, 5, 12):
            cut = len(task.tokens) - tail
            keys, values = chat_kv(pair, Chat(zero, tail, 0.0), task)
            assert keys[0].shape == nk[0].shape
            for got, ref in ((keys[0], nk[0]), (values[0], nv[0])):
                assert mx.all(got[..., :cut, :] == 0).item()
                assert mx.allclose(got[..., cut:, :], ref[..., cut:, :], atol=1e-5).item()
    res = evaluate_content(pair, tasks, {"t1": Chat(exact, 1, 0.0), "t5": Chat(exact, 5, 0.1)},
                           small=False)  # fmt: skip
    assert _replies(res, "t1") == _replies(res, "native") == _replies(res, "t5")


def test_source_alone_is_the_small_row_under_its_own_label(pair, monkeypatch):
    """A "source" condition of the side-by-side experiment answers with the source model on
    its own cache, as the "small" row does, beside a reused "small" row (which it does not
    replace)."""
    import mlx_kvlingo.eval.content as content

    from weights.experiments.content_side_by_side import known_replies, side_by_side

    tasks = build_tasks(pair.tokenizer, [TEXT], [64], 1, ("fact", "qa"), seed=3)
    earlier = to_json(evaluate_content(pair, tasks, {}), pair)
    models = []  # which model each read ran

    def spy(model, tokens):
        models.append("source" if model is pair.source else "target")
        return native_kv(model, tokens)

    monkeypatch.setattr(content, "native_kv", spy)
    res = side_by_side(pair, tasks, {"own": "source"}, known_replies(earlier, tasks))
    assert res.conditions == ["native", "own", "small"]
    assert models == ["target", "source"] * len(tasks)
    replies = {c: [r["reply"] for r in res.records if r["condition"] == c] for c in res.conditions}
    assert replies["own"] == replies["small"] and any(replies["own"])


def test_noisy_native_reference_has_the_error_it_names(pair):
    """`NoisyNative(rel)`: no noise is the native cache bit for bit (and the native replies);
    otherwise each layer's relative error is about `rel`, the same for the same seed."""
    from weights.experiments.content_side_by_side import NoisyNative

    task = build_tasks(pair.tokenizer, [TEXT], [64], 1, ("fact",), seed=2)[0]
    native = native_kv(pair.target, list(task.tokens[:-1]))
    same = NoisyNative(0.0)(pair, task, native)
    for got, ref in zip(same[0] + same[1], native[0] + native[1]):
        assert mx.array_equal(got, ref).item()
    a, b = NoisyNative(0.3)(pair, task, native), NoisyNative(0.3)(pair, task, native)
    for got, again, ref in zip(a[0] + a[1], b[0] + b[1], native[0] + native[1]):
        assert mx.array_equal(got, again).item()
        err = (mx.linalg.norm((got - ref).flatten()) / mx.linalg.norm(ref.flatten())).item()
        assert 0.27 < err < 0.33, err
    res = evaluate_content(pair, [task], {"n0": NoisyNative(0.0)}, small=False)
    assert _replies(res, "n0") == _replies(res, "native")


def test_swapping_every_layer_native_restores_native(pair, exact):
    """The diagnosis swap: a wrong translator with all target layers native is native exactly;
    with none swapped it is the wrong translator's own answer."""
    from weights.experiments.content_diagnosis import Swap

    tasks = build_tasks(pair.tokenizer, [TEXT], [64], 1, ("fact", "copy"), seed=1)
    wrong = exact_translator(pair, {"key_maps": [m * 0 for m in _maps(exact, "key")],
                                    "value_maps": [m * 0 for m in _maps(exact, "value")]})  # fmt: skip
    L = pair.target.geometry.layers
    swaps = {
        "all": Swap("all", wrong, frozenset(range(L))),
        "none": Swap("none", wrong, frozenset()),
    }
    res = evaluate_content(pair, tasks, {"wrong": wrong, **swaps}, small=False)
    assert _replies(res, "all") == _replies(res, "native")
    assert _replies(res, "none") == _replies(res, "wrong")


def test_prompts_near_the_context_are_built_to_fit_it(pair):
    """A read length whose prompts could overrun the pair's context with their answer is built
    shorter and keeps its label; the shorter lengths' draws are `build_tasks`' own; a length
    beyond the context is refused."""
    from types import SimpleNamespace

    side = SimpleNamespace(context_length=300)
    small = SimpleNamespace(source=side, target=side, tokenizer=pair.tokenizer)
    tasks = fitting_tasks(small, [TEXT], [64, 300], 1, seed=4)
    assert [t.length for t in tasks] == [64] * 4 + [300] * 4
    assert all(len(t.tokens) + 40 <= 300 for t in tasks)
    plain = build_tasks(pair.tokenizer, [TEXT], [64], 1, seed=4)
    assert [t.tokens for t in tasks[:4]] == [t.tokens for t in plain]
    with pytest.raises(ValueError, match="up to the pair's context, 300"):
        fitting_tasks(small, [TEXT], [64, 400], 1)


def test_eval_task_content_cli(pair, exact, tiny_dir, tmp_path):
    path = tmp_path / "exact.safetensors"
    save_translator(exact, path, pair)
    data = tmp_path / "text.txt"
    data.write_text(TEXT)
    out, png = tmp_path / "content.json", tmp_path / "content.png"
    args = ["eval", "--task", "content", "--source", str(tiny_dir["qwen3"]), "--target",
            str(tiny_dir["known"]), "--translator", str(path), "--data", str(data),
            "--lengths", "64", "--per-kind", "1", "--json", str(out), "--plot", str(png)]  # fmt: skip
    r = CliRunner().invoke(cli, args)
    assert r.exit_code == 0, r.output
    result = json.loads(out.read_text())
    assert result["conditions"] == ["native", "translated", "chat", "small"]
    assert result["cells"]["translated"]["qa"]["64"]["rouge_l"] == 1.0
    assert result["cells"]["chat"]["qa"]["64"]["rouge_l"] == 1.0  # exact: native either way
    assert png.stat().st_size > 1000
    assert "summary: recall" in r.output
    bad = CliRunner().invoke(cli, args[:-4] + ["--lengths", "8"])
    assert bad.exit_code != 0 and "at least 32" in bad.output
    # the chat's reading with other settings: the last N tokens, then the recompute
    r = CliRunner().invoke(cli, args + ["--large-reads-last", "8", "--recompute", "0.5"])
    assert r.exit_code == 0, r.output
    result = json.loads(out.read_text())
    assert result["conditions"] == ["native", "translated", "chat", "small"]
    assert result["cells"]["chat"]["qa"]["64"]["rouge_l"] == 1.0
    misplaced = CliRunner().invoke(cli, ["eval", "--recompute", "0.5"])
    assert misplaced.exit_code != 0 and "go with --task content" in misplaced.output


def test_retention_pools_facts_and_copies_the_native_answer_got_right():
    from mlx_kvlingo.eval.content import retention

    def rec(task, cond, kind, length, correct):
        return {"task": task, "condition": cond, "kind": kind, "length": length,
                "correct": correct}  # fmt: skip

    records = [
        rec(0, "native", "fact", 64, True), rec(0, "chat", "fact", 64, True),
        rec(1, "native", "copy", 64, True), rec(1, "chat", "copy", 64, False),
        rec(2, "native", "fact", 64, False), rec(2, "chat", "fact", 64, True),  # not counted
        rec(3, "native", "fact", 128, True), rec(3, "chat", "fact", 128, False),
        rec(4, "native", "qa", 128, None), rec(4, "chat", "qa", 128, None),
        rec(5, "native", "fact", 256, False), rec(5, "chat", "fact", 256, False),
    ]  # fmt: skip
    assert retention({"records": records}) == [(64, 1, 2), (128, 0, 1)]


def test_eval_task_content_times_each_read_and_stores_the_retention_auto_weighs(
    pair, exact, tiny_dir, tmp_path, monkeypatch
):
    """Each condition's read is timed in the same run, and the chat condition's retention of
    facts and copies per length is stored where the runtime finds it for those settings (the
    tiny pair knows no facts: every reply is scored right here, so each length keeps 1.0)."""
    from mlx_kvlingo.api import Pair
    from mlx_kvlingo.config import ReaderPolicy
    from mlx_kvlingo.eval import content
    from mlx_kvlingo.eval.content import read_times, retention

    monkeypatch.setattr(content, "contains", lambda answer, reply: True)

    path = tmp_path / "exact.safetensors"
    save_translator(exact, path, pair)
    data = tmp_path / "text.txt"
    data.write_text(TEXT)
    out = tmp_path / "content.json"
    args = ["eval", "--task", "content", "--source", str(tiny_dir["qwen3"]), "--target",
            str(tiny_dir["known"]), "--translator", str(path), "--data", str(data),
            "--lengths", "48,96", "--per-kind", "2", "--kinds", "fact,copy", "--json", str(out),
            "--large-reads-last", "8"]  # fmt: skip
    r = CliRunner().invoke(cli, args)
    assert r.exit_code == 0, r.output
    result = json.loads(out.read_text())
    assert {rec["kind"] for rec in result["records"]} == {"fact", "copy"}
    times = read_times(result)
    assert set(times) == {"native", "translated", "chat"} and set(times["chat"]) == {48, 96}
    assert all(s > 0 for by in times.values() for s in by.values())
    assert "reading the prompt: median seconds" in r.output
    assert retention(result) == [(48, 4, 4), (96, 4, 4)]  # 2 facts and 2 copies, all right
    said = " ".join(r.output.split())
    assert "retention stored for reader auto" in said and "48 tok 4/4, 96 tok 4/4" in said
    rt = Pair(pair, load_translator(path, pair))
    stored = rt.retention(ReaderPolicy(large_reads_last=8))
    assert stored is not None and stored.points == ((48, 1.0), (96, 1.0))
    assert rt.retention(ReaderPolicy()) is None  # measured with a tail of 8, not 32
    bad = CliRunner().invoke(cli, args[:-2] + ["--kinds", "fact,poem"])
    assert (
        bad.exit_code == 2 and "poem: expected some of fact, facts, copy, qa, summary" in bad.output
    )


def test_prefix_gain_weights(pair):
    from mlx_kvlingo.data.examples import Example

    toks = pair.tokenizer.encode(TEXT)[:40]
    ex = Example(tuple(toks[:30]), tuple(toks[30:]), "t")
    w = prefix_gain(pair.target, ex, context=4)
    assert w.shape == (10,) and float(w.mean()) == pytest.approx(1.0, abs=1e-5)
    # a context as long as the prefix: no gain anywhere, every token weighs the same
    flat = prefix_gain(pair.target, ex, context=30)
    assert mx.allclose(flat, mx.ones(10), atol=1e-5).item()
    t = native_logp(pair.target, ex)
    s = t + 0.01 * mx.random.normal(t.shape, key=mx.random.key(0))
    assert kl(t, s, mx.ones(10)).item() == pytest.approx(kl(t, s).item(), rel=1e-5)
    spike = mx.zeros(10).at[3].add(1.0)
    per_token = (mx.exp(t) * (t - s)).sum(-1)
    assert kl(t, s, spike).item() == pytest.approx(per_token[3].item(), rel=1e-5)


def test_content_examples_are_the_targets_answers_and_resume(pair, tmp_path, monkeypatch):
    """Each continuation is the target's own greedy answer on its native cache (batched answers
    equal one-by-one decoding), and a resume makes only what the cache file lacks."""
    import mlx_kvlingo.calibrate.content_data as cd

    from helpers import native_tokens

    cache = tmp_path / "answers.jsonl"
    first = cd.content_examples(pair, [TEXT], 4, lengths=(64,), cache_file=cache, batch=3)
    assert len(first) == 4
    eos = pair.tokenizer.eos_token_id
    for ex in first:
        n = cd.ANSWER_TOKENS[ex.source.split(":")[1].split("@")[0]]
        alone = native_tokens(pair.target.model, pair.tokenizer, list(ex.prefix), n)
        assert list(ex.continuation) in (alone, alone + [eos])
    calls = []
    monkeypatch.setattr(cd, "native_answers", lambda p, ts: calls.extend(ts) or [[1]] * len(ts))
    again = cd.content_examples(pair, [TEXT], 4, lengths=(64,), cache_file=cache)
    assert calls == [] and again == first  # all four answers came from the cache
    cache.write_text(cache.read_text()[:-20])  # the last line cut short by an interruption
    cd.content_examples(pair, [TEXT], 4, lengths=(64,), cache_file=cache)
    assert len(calls) == 1


def test_calibrate_without_data_plans_resumes_and_reports(tiny_dir, tmp_path, monkeypatch):
    """`kvlingo calibrate` with two models and no data: the shipped text, content examples
    answered by the target, a plan first, a resumable checkpoint, content figures at the end."""
    monkeypatch.setenv("KVLINGO_CACHE", str(tmp_path / "cache"))
    out = tmp_path / "t.safetensors"
    args = ["calibrate", "--source", str(tiny_dir["qwen3"]), "--target", str(tiny_dir["known"]),
            "--content", "6", "--content-lengths", "64", "--max-examples", "12", "--steps", "2",
            "--eval-examples", "4", "-o", str(out)]  # fmt: skip
    r = CliRunner().invoke(cli, args)
    assert r.exit_code == 0, r.output
    assert "plan:" in r.output and "estimated on this machine" in r.output
    assert "6 training and 4 held-out content examples" in r.output
    assert "fact: retained" in r.output  # the closing content figures
    ckpt = tmp_path / "t.ckpt"
    answers = (ckpt / "content-answers.jsonl").read_text().splitlines()
    assert len(answers) == 10
    state = json.loads((ckpt / "state.json").read_text())
    assert state["step"] == 2 and state["config"]["gain_weights"] is True
    import mlx_kvlingo.calibrate.content_data as cd
    import mlx_kvlingo.cli.calibrate as calibrate_module

    made, reported = [], []
    monkeypatch.setattr(cd, "native_answers", lambda p, ts: made.extend(ts) or [[1]] * len(ts))
    # the closing figures were checked above: the rerun only records that it reaches them
    monkeypatch.setattr(calibrate_module, "_content_report", lambda *a: reported.append(a))
    again = CliRunner().invoke(cli, args)  # a rerun resumes: no answer is made twice
    assert again.exit_code == 0, again.output
    assert made == [] and len(reported) == 1
    assert "content answers ~" in r.output and "content answers ~" not in again.output


def test_diagnosis_finds_the_answer_and_measures_zero_error_for_an_exact_translator(pair, exact):
    from weights.experiments.content_diagnosis import answer_positions, layer_swaps, position_errors

    tasks = build_tasks(pair.tokenizer, [TEXT], [64], 2, ("fact",), seed=2)
    for t in tasks:
        pos = answer_positions(pair.tokenizer, t)
        assert pos and t.answer.split()[0] in pair.tokenizer.decode([t.tokens[i] for i in pos])
    err = position_errors(pair, exact, tasks)
    worst = max(v for rows in err.values() for r in rows.values() for v in r.values())
    assert worst < 1e-4  # the known-answer translator is exact at every token
    swaps = layer_swaps(6, 3, exact)
    assert len({s.native_layers for s in swaps}) == len(swaps)  # no set measured twice


def test_prefix_source_shares_the_targets_first_layers_exactly(pair, tmp_path):
    from mlx_kvlingo.models.pair import load_model

    from weights.experiments.content_diagnosis import write_prefix_source

    out = write_prefix_source(pair.target.folder, 2, tmp_path / "prefix")
    prefix = load_model(out)
    toks = pair.tokenizer.encode(TEXT)[:20]
    nk, nv = native_kv(pair.target, toks)
    pk, pv = native_kv(prefix, toks)
    assert len(pk) == 2
    for i in range(2):
        assert mx.array_equal(pk[i], nk[i]).item() and mx.array_equal(pv[i], nv[i]).item()
    with pytest.raises(ValueError, match="keep 1 to"):
        write_prefix_source(pair.target.folder, 99, tmp_path / "bad")


def test_calibration_tasks_state_other_facts_than_the_benchmark(pair):
    """The same seed must not give calibration and evaluation the same stated facts."""
    from mlx_kvlingo.calibrate.content_data import SEED_OFFSET

    bench = build_tasks(pair.tokenizer, [TEXT], [64], 6, ("fact",), seed=0)
    calib = build_tasks(pair.tokenizer, [TEXT], [64], 6, ("fact",), seed=SEED_OFFSET + 0)
    assert not {t.question + t.answer for t in bench} & {t.question + t.answer for t in calib}


def test_plan_counts_only_what_is_left_to_do():
    from mlx_kvlingo.calibrate.plan import CalibrationPlan, Rates

    rates = Rates(source_ms_per_token=1.0, target_ms_per_token=3.0, decode_step_ms=20.0)
    plan = CalibrationPlan(100, 100, 10, 50, 4, 1, 80.0, 300.0, rates, 2**30)
    secs = plan.seconds()
    assert secs["stage 1"] == pytest.approx(1.3 * 100 * 80 * 4.0 / 1e3)
    assert secs["content answers"] == pytest.approx(50 * (300 * 3.0 + 32 * 2 * 20.0 / 16) / 1e3)
    plan.content_to_answer = 0  # every answer cached: a resume
    assert plan.seconds()["content answers"] == 0
    assert "stage 1 ~42 s" in plan.describe() and "1.0 GiB" in plan.describe()


def test_the_content_benchmark_reads_a_turn_as_the_chat_does(pair, exact):
    """The benchmark's cache for a turn is, bit for bit, the cache a `Conversation` builds
    for the same turn (the small model reads, translation, the large model's tail read and
    its recompute, then mlx-lm's prefill up to the last token): one hand-off, not a copy."""
    from mlx_kvlingo import Conversation, ReaderPolicy
    from mlx_kvlingo.api import Pair
    from mlx_kvlingo.data.content_tasks import ContentTask

    # an inexact map, so that what the recompute rewrites shows in the cache
    half = exact_translator(pair, {"key_maps": [0.5 * m for m in _maps(exact, "key")],
                                   "value_maps": [0.5 * m for m in _maps(exact, "value")]})  # fmt: skip
    conv = Conversation(Pair(pair, half), policy=ReaderPolicy(reader="small"))
    list(conv.send(TEXT[:700] + " When did the sun come out?", max_tokens=2, temp=0))
    session = conv.cache
    turn = session.turns[-1]
    assert turn.read is not None and turn.switch.recomputed > 0  # the whole path ran
    n0 = len(session.tokens) - turn.generation_tokens
    task = ContentTask("qa", n0, tuple(session.tokens[:n0]), "", "")
    keys, values = chat_kv(pair, Chat(half), task)
    chat = session.cache("target")
    for k, v, c in zip(keys, values, chat):
        assert k.shape[2] == n0 - 1
        assert mx.array_equal(k, c.keys[..., : n0 - 1, :]).item()
        assert mx.array_equal(v, c.values[..., : n0 - 1, :]).item()
