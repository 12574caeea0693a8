"""The demo's build as one ordered pipeline (weights/build/rebuild.py): the plan lists every step
in order, every step module exists and takes the arguments the runner gives it, the order
respects what each step reads, and a missing step, a missing input or a failing step is
reported instead of run past."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import build_module

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def rb():
    return build_module("rebuild")


def _plan_names(out: str) -> list[str]:
    return [line.split("] ", 1)[1].split(" ", 1)[0] for line in out.splitlines()
            if line.startswith("[") and "] " in line]  # fmt: skip


def test_dry_run_lists_every_step_in_order(rb):
    out = subprocess.run(
        [sys.executable, "-m", "weights.build.rebuild", "--dry-run"],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert out.returncode == 0, out.stdout + out.stderr
    assert _plan_names(out.stdout) == [s.name for s in rb.STEPS]
    assert "dry run: nothing was run" in out.stdout
    for s in rb.STEPS:  # what it runs, reads, writes and the expected time, each step
        assert f"python -m {s.module}" in out.stdout and s.expected in out.stdout
    assert "expected: " in out.stdout and "min measured" in out.stdout


def test_every_step_module_exists_and_takes_its_arguments(rb):
    assert rb.problems(rb.STEPS) == []
    import importlib

    for s in rb.STEPS:
        module = importlib.import_module(s.module)
        assert callable(module.main), s.name
        module.parser().parse_args([rb.expand(a) for a in s.args])  # exits on a bad argument


def test_the_order_respects_what_each_step_reads(rb):
    """From scratch: every input in weights/ or the cache is written by an earlier step; the
    rest (the Python docs package) comes from outside."""
    for i, s in enumerate(rb.STEPS):
        for r in s.reads:
            if r.startswith(("weights/", "$CACHE")):
                assert rb.writer(r, rb.STEPS[:i]), (s.name, r)
            else:
                assert rb.writer(r, rb.STEPS) is None, (s.name, r)


def test_selection(rb, capsys):
    names = [s.name for s in rb.STEPS]

    def chosen(*argv):
        return [s.name for s in rb.select(rb.STEPS, *argv, error=pytest.fail)]

    assert chosen(None, None, None) == names
    assert chosen(None, "stage2_assistant", None) == names[names.index("stage2_assistant") :]
    assert chosen(None, None, "moe,source") == ["source", "moe"]  # in the pipeline's order
    assert chosen("moe", None, None) == ["moe"]  # the MoE reads the dense pair's translators
    assert {s.pair for s in rb.STEPS} == {"dense", "moe"}
    with pytest.raises(SystemExit) as e:
        rb.main(["--only", "nope", "--dry-run"])
    assert e.value.code == 2 and "no step 'nope'" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        rb.main(["--pair", "moe", "--from", "translators", "--dry-run"])
    assert "not a moe step" in capsys.readouterr().err


def test_a_missing_step_or_entry_is_reported_and_nothing_runs(rb, capsys, monkeypatch):
    ghost = rb.Step("ghost", "weights.build.ghost", (), "a step whose module is gone", (), (), "-")
    no_main = rb.Step("helper", "weights.build.manifest", (), "a helper, no main", (), (), "-")
    steps = (*rb.STEPS[:2], ghost, no_main)
    assert rb.problems(steps) == [
        "step 'ghost': module weights.build.ghost not found",
        "step 'helper': weights.build.manifest has no main(argv)",
    ]
    assert rb.problems((*steps[:2], steps[0])) == ["step 'source' is listed twice"]
    monkeypatch.setattr(rb, "run_step", lambda step: pytest.fail(f"{step.name} was run"))
    assert rb.main(["--dry-run"], steps=steps) == 1
    err = capsys.readouterr().err
    assert "cannot run" in err and "weights.build.ghost not found" in err
    assert rb.main([], steps=steps) == 1


def test_a_missing_input_stops_the_rebuild_before_it_starts(rb, capsys, monkeypatch):
    needs = rb.Step("late", "weights.build.source", (), "reads what nothing writes",
                    ("weights/no-such-input.bin",), (), "-")  # fmt: skip
    monkeypatch.setattr(rb, "run_step", lambda step: pytest.fail(f"{step.name} was run"))
    assert rb.main([], steps=(rb.STEPS[0], needs)) == 1
    assert "'late' reads weights/no-such-input.bin, which is missing" in capsys.readouterr().err
    assert rb.main(["--dry-run"], steps=(rb.STEPS[0], needs)) == 0  # the plan is still shown
    assert "before a real run" in capsys.readouterr().out


def test_steps_run_in_order_with_their_times_and_a_failure_stops_them(rb, tmp_path, monkeypatch,
                                                                      capsys):  # fmt: skip
    calls_file = tmp_path / "calls.jsonl"
    (tmp_path / "fake_ok.py").write_text(
        "import json\n"
        "def main(argv):\n"
        f"    with open({str(calls_file)!r}, 'a') as f:\n"
        "        f.write(json.dumps(argv) + '\\n')\n"
    )
    (tmp_path / "fake_bad.py").write_text("def main(argv):\n    raise SystemExit(3)\n")
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))  # the children import them
    monkeypatch.syspath_prepend(str(tmp_path))  # the check before running finds them
    monkeypatch.setenv("KVLINGO_CACHE", str(tmp_path / "cache"))
    one = rb.Step("one", "fake_ok", ("$CACHE/x", "--n", "1"), "first", (), (), "1 min measured")
    two = rb.Step("two", "fake_ok", ("2",), "second", (), (), "not recorded")
    bad = rb.Step("bad", "fake_bad", (), "fails", (), (), "-")
    three = rb.Step("three", "fake_ok", ("3",), "never", (), (), "-")
    assert rb.main([], steps=(one, two)) == 0
    out = capsys.readouterr().out
    assert "== one: done in" in out and "measured (expected 1 min measured)" in out
    assert "| one | " in out and "| two | " in out  # the summary: measured beside expected
    calls = [json.loads(x) for x in (tmp_path / "calls.jsonl").read_text().splitlines()]
    assert calls == [[str(tmp_path / "cache" / "x"), "--n", "1"], ["2"]]
    assert rb.main([], steps=(one, bad, three)) == 1
    err = capsys.readouterr().err
    assert "bad: failed (exit 3)" in err and "--from bad" in err
    assert len((tmp_path / "calls.jsonl").read_text().splitlines()) == 3  # three never ran


def test_braces_and_writers(rb):
    assert rb.braces("a/{x,y}-{1,2}.t") == ["a/x-1.t", "a/x-2.t", "a/y-1.t", "a/y-2.t"]
    assert rb.writer("weights/translators/forward-mixing-nu2.safetensors", rb.STEPS).name == (
        "translators"
    )
    assert rb.writer("weights/nothing", rb.STEPS) is None


def test_add_translator_evaluate_option():
    add = build_module("add_translator")
    assert add.parse_evaluate("dialogues=:40") == ("dialogues", "", 40)
    assert add.parse_evaluate("prose=weights/data/p.jsonl:24") == ("prose", "weights/data/p.jsonl", 24)  # fmt: skip
    for bad in ("dialogues", "dialogues=x", "=x:3", "d=x:n"):
        with pytest.raises(ValueError, match="DOMAIN=DATA:N"):
            add.parse_evaluate(bad)


def test_assistant_step_writes_the_heldout_mix(tmp_path, monkeypatch):
    gen = build_module("assistant_data")
    monkeypatch.setenv("KVLINGO_CACHE", str(tmp_path))
    data = tmp_path / "data"
    (data / "assistant").mkdir(parents=True)
    (data / "chitchat-train.jsonl").write_text('{"messages": []}\n')
    (data / "chitchat-heldout.jsonl").write_text('{"messages": [{"role": "user"}]}\n')
    (data / "assistant" / "heldout.jsonl").write_text('{"messages": [{"role": "assistant"}]}\n')
    folder = gen.write_heldout_mix(data / "assistant")
    assert folder == data / "heldout-assistant-mix"
    assert sorted(p.name for p in folder.iterdir()) == ["assistant-heldout.jsonl",
                                                        "chitchat-heldout.jsonl"]  # fmt: skip
    assert (folder / "chitchat-heldout.jsonl").read_text() == (
        data / "chitchat-heldout.jsonl"
    ).read_text()


def test_the_readme_step_table_is_the_pipeline(rb):
    """weights/README.md's "Rebuild from scratch" table: every step, in the runner's order."""
    text = (ROOT / "weights" / "README.md").read_text()
    section = text.split("## Rebuild from scratch", 1)[1].split("\n## ", 1)[0]
    assert "python -m weights.build.rebuild --dry-run" in section
    rows = [line.split("|")[2].strip() for line in section.splitlines() if line.startswith("| ")]
    named = [r.split("`")[1] for r in rows if r.startswith("`")]
    assert named == [s.name for s in rb.STEPS]
    for s in rb.STEPS:
        assert (ROOT / "weights" / "build" / f"{s.module.rsplit('.', 1)[1]}.py").is_file()


def test_a_source_can_keep_its_first_layers_the_targets_own():
    """`source.py --freeze-first N`: healing trains only the kept layers after the first N
    (and the final norm), so those N stay the target's own and a translator can pass their
    K/V through exactly. After one optimizer step, the frozen layers equal the teacher's bit
    for bit and the others moved."""
    import argparse

    from mlx_kvlingo.data import synthetic as syn

    import mlx.core as mx
    import numpy as np
    from mlx.utils import tree_flatten

    source = build_module("source")
    cfg = syn.model_config("llama", 32, num_hidden_layers=4, tie_word_embeddings=True)
    teacher = syn.build_model(cfg, seed=0)
    teacher.freeze()
    student = source.make_student(teacher, cfg, [0, 1, 3], frozen=2)
    trainable = {k.split(".")[2] for k, _ in tree_flatten(student.trainable_parameters())
                 if k.startswith("model.layers.")}  # fmt: skip
    assert trainable == {"2"}
    windows = np.random.default_rng(0).integers(0, 32, size=(4, 9)).astype(np.int32)
    args = argparse.Namespace(lr=1e-2, steps=1, warmup=1, seed=0, batch=2, max_minutes=5)
    source.distill(student, teacher, windows, args)
    for i, k in enumerate([0, 1, 3]):
        for (name, w), (_, t) in zip(tree_flatten(student.model.layers[i].parameters()),
                                     tree_flatten(teacher.model.layers[k].parameters())):  # fmt: skip
            same = bool(mx.array_equal(w, t))
            assert same == (i < 2), (i, name)


def test_add_translator_stores_its_copy_in_float16_or_8_bit(tiny_dir, tmp_path):
    """The shipped copy: float16 tensors, metadata `dtype` float16 and otherwise unchanged,
    loaded for float32 compute on the CPU; in place too (the defaults were converted so)."""
    from mlx_kvlingo.eval.presets import random_translator
    from mlx_kvlingo.models.files import (
        load_translator,
        read_header,
        read_metadata,
        save_translator,
    )
    from mlx_kvlingo.models.pair import load_pair

    import mlx.core as mx
    from safetensors import safe_open

    add = build_module("add_translator")
    pair = load_pair(tiny_dir["qwen3"], tiny_dir["qwen3_moe"])
    full = save_translator(random_translator(pair, seed=1), tmp_path / "full.safetensors", pair)
    half = add.copy_stored(full, tmp_path / "half.safetensors")
    with safe_open(str(half), "numpy") as f:
        assert {str(f.get_tensor(k).dtype) for k in f.keys()} == {"float16"}
    read_header(half)  # a well-formed file
    before, after = read_metadata(full), read_metadata(half)
    assert (before["dtype"], after["dtype"]) == ("float32", "float16")
    assert {**before, "dtype": "float16"} == after
    assert half.stat().st_size < 0.6 * full.stat().st_size
    ref, got = load_translator(full, pair), load_translator(half, pair)
    assert got.key["weight"].dtype == mx.float32  # computed in float32 on the CPU
    err = mx.abs(got.key["weight"] - ref.key["weight"]).max().item()
    assert 0 < err <= mx.abs(ref.key["weight"]).max().item() * 2**-11
    q8 = add.copy_stored(full, tmp_path / "q8.safetensors", bits=8)
    assert read_metadata(q8) == {**after, "quantization": {"group_size": 32, "bits": 8}}
    w16 = ref.key["weight"].astype(mx.float16)
    assert mx.array_equal(load_translator(q8, pair).key["weight"],
                          mx.dequantize(*mx.quantize(w16, 32, 8), 32, 8).astype(mx.float32))  # fmt: skip
    add.copy_stored(full, full)  # in place
    assert read_metadata(full) == after and full.read_bytes() == half.read_bytes()
