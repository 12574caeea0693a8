"""Robustness, seeded and bounded: every loader fuzzed (tests/fuzzing.py), saves killed with
SIGKILL mid-write (tests/crashsafe.py), the public API under concurrent random operations
(tests/stress.py), and the memory check made before loading. The full-size runs are
`tests/tools/fuzz_loaders.py`, `tests/tools/kill_saves.py`, `tests/tools/stress_api.py` and
`python -m weights.experiments.memory_estimate`."""

import json
import os
import sys

import mlx_kvlingo  # noqa: F401
from mlx_kvlingo import load
from mlx_kvlingo.models.pair import InsufficientMemoryError, estimate_bytes, load_model, load_pair

import crashsafe
import fuzzing
import pytest
import stress

FUZZ_PER_LOADER = 40  # x 10 loaders; tests/tools/fuzz_loaders.py runs 10,000 each


@pytest.fixture(scope="module")
def fixtures(tmp_path_factory):
    pytest.importorskip("torch", reason="the fuzz seeds include PyTorch files ('.[torch]')")
    return fuzzing.build_fixtures(tmp_path_factory.mktemp("robust"))


@pytest.fixture(scope="module")
def worker(fixtures, tmp_path_factory):
    w = fuzzing.Worker(fixtures, tmp_path_factory.mktemp("fuzzbox"))
    yield w
    w.stop()


def test_seed_inputs_load(fixtures, worker):
    """Unmutated, every seed input is accepted: the fuzzer starts from valid files."""
    for loader in fuzzing.LOADERS:
        for i, (name, files) in enumerate(fuzzing.seed_inputs(fixtures, loader)):
            inp = fuzzing.Input(loader, i, {} if loader == "chat" else dict(files),
                                files.get("line"), name, "seed", with_pair=True)  # fmt: skip
            outcome, detail = worker.run(inp, 60)
            assert outcome == "ok", f"{loader} seed {name}: {outcome} {detail}"


@pytest.mark.parametrize("loader", fuzzing.LOADERS)
def test_fuzz_loader(loader, fixtures, worker):
    """A seeded few dozen mutated inputs per loader: only documented refusals, no hang, no
    crash, nothing written outside the output path."""
    report = fuzzing.fuzz(loader, worker, fixtures, seed=18, count=FUZZ_PER_LOADER, limit=30)
    assert report.total == FUZZ_PER_LOADER
    assert not report.findings, "\n\n".join(
        f"#{i} {outcome} ({how}): {detail}" for i, outcome, how, detail in report.findings
    )


def test_mutations_are_reproducible(fixtures):
    seeds = fuzzing.seed_inputs(fixtures, "translator")
    a, b = (fuzzing.mutate("translator", seeds, 7, 123) for _ in range(2))
    assert a.files == b.files and a.mutation == b.mutation and a.with_pair == b.with_pair
    assert fuzzing.mutate("translator", seeds, 7, 124).files != a.files


@pytest.mark.skipif(not hasattr(os, "fork"), reason="the kill test forks its savers (POSIX)")
def test_kill_during_saves_leaves_previous_file(fixtures, tmp_path):
    """50 saves killed with SIGKILL at random moments: the file always loads, whole."""
    zygote = crashsafe.Zygote(fixtures)
    verifier = crashsafe.Verifier(fixtures)
    try:
        reports = [
            crashsafe.kill_campaign(
                kind, n, tmp_path, fixtures, seed=18, size_mb=2, zygote=zygote, verifier=verifier
            )  # fmt: skip
            for kind, n in (("translator", 34), ("session", 8), ("checkpoint", 8))
        ]
    finally:
        zygote.close()
    assert sum(r.kills for r in reports) == 50
    for r in reports:
        assert not r.failures, (r.kind, r.failures)
        assert r.intact == r.kills
    assert sum(r.previous for r in reports) > 0  # some kills did land in the middle of a save


def test_api_under_stress(fixtures, tmp_path):
    """Threads doing random operations on several conversations of one pair."""
    f = fixtures
    runtime = load(f / "qwen3", f / "known", f / "fwd.safetensors", f / "bwd.safetensors")
    report = stress.stress(runtime, tmp_path, threads=4, ops=20, seed=18, timeout=120)
    assert not report.deadlocked
    assert not report.failures, report.failures[:5]
    assert report.total == 4 * 20
    assert not runtime.busy


def test_memory_estimate_and_refusal(tiny_dir, monkeypatch):
    """The estimate before loading is what the weights take; a pair that does not fit is
    refused before anything is loaded, naming the estimate and what the machine has."""
    from mlx_kvlingo.models import pair as pair_mod

    for kind in ("qwen3", "qwen3_moe"):
        assert estimate_bytes(tiny_dir[kind]) == load_model(tiny_dir[kind]).nbytes()
    need = estimate_bytes(tiny_dir["qwen3"]) + estimate_bytes(tiny_dir["known"])
    monkeypatch.setattr(pair_mod, "physical_memory", lambda: need)  # 85% of it is allowed
    loaded = []
    monkeypatch.setattr(pair_mod, "load_model", lambda *a, **k: loaded.append(a))
    with pytest.raises(InsufficientMemoryError) as e:
        load_pair(tiny_dir["qwen3"], tiny_dir["known"])
    msg = str(e.value)
    assert f"{need / 2**30:.1f} GiB once loaded" in msg and f"has {need / 2**30:.1f} GiB" in msg
    assert "85%" in msg and not loaded


def test_checkpoint_commits_through_state_json(tmp_path):
    """state.json names the step's files; older step files go once it is replaced."""
    from mlx_kvlingo.calibrate.distill import Stage2Config, load_checkpoint, save_checkpoint
    from mlx_kvlingo.kv.translator import Side, Translator, TranslatorConfig
    from mlx_kvlingo.models.files import load_translator

    import mlx.core as mx
    import mlx.optimizers as optim

    side = Side(2, 1, 4, 4)
    tr = Translator(TranslatorConfig("mixing", side, side, ((0,), (1,)), ((0,), (1,))))
    opt = optim.AdamW(learning_rate=1e-3)
    opt.init(tr.trainable_parameters())
    for step in (5, 10):
        tr.key["weight"] = mx.full(tr.key["weight"].shape, float(step))
        save_checkpoint(tmp_path, tr, opt, step, Stage2Config(), [])
    state, tr_file, opt_file = load_checkpoint(tmp_path)
    assert state["step"] == 10 and tr_file.name == "translator-0000010.safetensors"
    assert float(load_translator(tr_file).key["weight"][0, 0, 0]) == 10.0
    assert float(load_translator(tmp_path / "translator.safetensors").key["weight"][0, 0, 0]) == 10
    names = sorted(p.name for p in tmp_path.iterdir())
    assert names == ["optimizer-0000010.safetensors", "state.json",
                     "translator-0000010.safetensors", "translator.safetensors"]  # fmt: skip
    # a checkpoint from before state.json named its files (before 0.2.0) is refused, saying so
    legacy = json.loads((tmp_path / "state.json").read_text())
    del legacy["files"]
    (tmp_path / "state.json").write_text(json.dumps(legacy))
    with pytest.raises(ValueError, match="before 0.2.0"):
        load_checkpoint(tmp_path)


def test_atomic_write_keeps_the_old_file_on_error(tmp_path):
    from mlx_kvlingo._platform.atomic import atomic_write

    target = tmp_path / "f.safetensors"
    target.write_bytes(b"old")
    with pytest.raises(RuntimeError), atomic_write(target) as tmp:
        tmp.write_bytes(b"half")
        raise RuntimeError("killed")
    assert target.read_bytes() == b"old" and sorted(os.listdir(tmp_path)) == ["f.safetensors"]
    with atomic_write(target) as tmp:
        assert tmp.parent == target.parent and tmp.name.startswith(".f.safetensors.")
        tmp.write_bytes(b"new")
    assert target.read_bytes() == b"new" and sorted(os.listdir(tmp_path)) == ["f.safetensors"]
    # a name near the file-name limit still gets a temporary file (found by fuzzing /save)
    long = tmp_path / ("x" * 240 + ".safetensors")
    with atomic_write(long) as tmp:
        tmp.write_bytes(b"ok")
    assert long.read_bytes() == b"ok"
    # an mlx saver that cannot open its file raises OSError (the chat prints it, goes on)
    import mlx.core as mx

    with pytest.raises(OSError), atomic_write(tmp_path / "no" / "dir.safetensors") as tmp:
        mx.save_safetensors(str(tmp), {"a": mx.zeros(1)})


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))
