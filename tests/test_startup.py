"""Starts like mlx-lm (issue 49): the rates the warm-up measures are kept in the cache folder,
keyed by the machine, the pair's files and the library versions; a later start with the same
key reuses them (no measuring and no scratch turn: one probe read per model), a changed key
measures again, a corrupt or foreign file is ignored. On the tiny known-answer pair, each test with its own
cache folder."""

import json
import os
import subprocess
import sys
from pathlib import Path

import mlx_kvlingo.conversation.warmup as warmup_module
from mlx_kvlingo import Conversation
from mlx_kvlingo.api import Pair
from mlx_kvlingo.models.files import save_translator
from mlx_kvlingo.models.pair import load_model, load_pair

import mlx.core as mx
import pytest
from helpers import exact_translator, fixed_costs, inverse

ROOT = Path(__file__).resolve().parents[1]
LENGTHS = (8, 24)


@pytest.fixture
def cache(tmp_path, monkeypatch):
    """A private cache folder (KVLINGO_CACHE), empty."""
    folder = tmp_path / "cache"
    monkeypatch.setenv("KVLINGO_CACHE", str(folder))
    return folder


@pytest.fixture
def measures(monkeypatch):
    """Counts the measuring warm-ups."""
    calls = []
    real = warmup_module.warm_up

    def counting(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(warmup_module, "warm_up", counting)
    return calls


def fresh_runtime(tiny_dir, forward_answer=None) -> Pair:
    """A runtime over a freshly loaded pair (its own costs, as in a new process)."""
    pair = load_pair(tiny_dir["qwen3"], tiny_dir["known"])
    answer = tiny_dir["known_answer"] if forward_answer is None else forward_answer
    forward = exact_translator(pair, answer)
    backward = exact_translator(pair.reversed(), inverse(tiny_dir["known_answer"]))
    return Pair(pair, forward, backward)


def rate_files(cache: Path) -> list[Path]:
    return sorted((cache / "rates").glob("*.json"))


def test_a_second_start_reuses_the_stored_rates(tiny_dir, cache, measures):
    from mlx_kvlingo.conversation.reader import costs_of

    first = fresh_runtime(tiny_dir)
    first.warm_up(lengths=LENGTHS)
    assert len(measures) == 1
    second = fresh_runtime(tiny_dir)
    assert second.models is not first.models
    seconds = second.warm_up(lengths=LENGTHS)
    assert len(measures) == 1, "the second start measured again"

    assert first.rates == "measured"
    assert second.rates == "cached" and second.warmup_s == seconds > 0
    (stored,) = rate_files(cache)
    costs, measured = costs_of(second.models), costs_of(first.models).to_dict()
    # as stored, but for each model's probe, which this start read again (and replaced)
    got = costs.to_dict()
    assert costs.origin == "cached"
    for name in measured:
        assert not_probe(got[name]) == not_probe(measured[name])
        assert len(got[name]) - len(not_probe(got[name])) == PROBED[name]
    assert costs.target_read.ready and costs.forward.ready and costs.backward.ready
    # each translator's map reading is the one measured on the first start
    assert second.forward.reading.chosen == first.forward.reading.chosen != {}
    assert second.backward.reading.chosen == first.backward.reading.chosen
    assert rate_files(cache) == [stored]
    # reader auto decides by the reused rates from the first turn on, and answers as usual
    conv = Conversation(second)
    text = " ".join(["def parse_args(argv):", "class Foo(object):", "print(x)"] * 8)
    done = [e for e in conv.send(text, model="large", max_tokens=4)][-1]
    assert done.finish_reason and done.handoff.alternative_ttft_s is not None
    # reuse=False measures again and stores the new rates over the old
    second.warm_up(lengths=LENGTHS, reuse=False)
    assert len(measures) == 2 and second.rates == "measured" and rate_files(cache) == [stored]


#: the probe samples per cost: each model's read over a long scratch cache (the small model's
#: with a forward translator)
PROBED = {"source_read": 1, "forward": 0, "backward": 0, "target_read": 1, "target_step": 0}


def not_probe(samples: list) -> list:
    return [x for x in samples if x[0] != warmup_module.PROBE_READ or x[2] < LENGTHS[-1] * 4]


def probe_at(loaded) -> int:
    """Where a model's probe reads: PROBE_AT, or half its context where that is shorter."""
    return min(warmup_module.PROBE_AT, (loaded.context_length or 1 << 30) // 2)


class Counting:
    """A model that records its reads: (tokens, positions its cache held)."""

    def __init__(self, model, at: int):
        self.wrapped, self.at, self.reads = model, at, []

    def __call__(self, x, cache=None, **kwargs):
        self.reads.append((x.shape[1], cache[0].offset if cache else 0))
        return self.wrapped(x, cache=cache, **kwargs)

    def __getattr__(self, name):
        return getattr(self.wrapped, name)


def test_a_reusing_start_reads_one_probe_per_model(tiny_dir, cache, measures):
    """A start that reuses stored rates reads each model once, over a long scratch cache (its
    attention term), and nothing else (no scratch turn); that read replaces the stored one: the
    only sample that changes. Its prediction of a long turn then follows this start's probe."""
    from mlx_kvlingo.conversation.reader import costs_of

    first = fresh_runtime(tiny_dir)
    first.warm_up(lengths=LENGTHS)
    stored = costs_of(first.models).to_dict()
    second = fresh_runtime(tiny_dir)
    models = [Counting(m.model, probe_at(m)) for m in (second.models.source, second.models.target)]
    second.models.source.model, second.models.target.model = models
    second.warm_up(lengths=LENGTHS)
    assert len(measures) == 1 and second.rates == "cached"
    for m in models:
        assert m.reads == [(warmup_module.PROBE_READ, m.at)]
    costs = costs_of(second.models)
    got = costs.to_dict()
    for name in ("source_read", "target_read"):
        (old,) = [x for x in stored[name] if x not in not_probe(stored[name])]
        (new,) = [x for x in got[name] if x not in not_probe(got[name])]
        assert new[0::2] == old[0::2] and new[1] > 0 and new == got[name][-1]  # the newest
    # a slower probe this start: a long read is predicted slower, a short one about the same
    before = (costs.target_read.predict(4000), costs.target_read.predict(16))
    (n, s, at) = got["target_read"][-1]
    costs.target_read.observe(n, 10 * s, at, again=True)
    assert costs.target_read.predict(4000) > 2 * before[0]
    assert len(costs.target_read.samples) == len(got["target_read"])  # replaced, not added


def test_both_starts_prime_the_recompute(tiny_dir, cache, measures):
    """A measuring start and a reusing one each look up the tokenizer's sentence ends (a scan
    of its vocabulary) for the large model's recompute, so the first turn the small model reads
    does not."""
    from mlx_kvlingo import ReaderPolicy
    from mlx_kvlingo.kv import recompute

    for origin in ("measured", "cached"):
        recompute.sentence_ends.cache_clear()
        rt = fresh_runtime(tiny_dir)
        rt.warm_up(lengths=LENGTHS)
        assert rt.rates == origin and recompute.sentence_ends.cache_info().currsize == 1
    conv = Conversation(rt, policy=ReaderPolicy(reader="small", reader_min_tokens=1))
    text = " ".join(["def parse_args(argv):", "class Foo(object):", "print(x)"] * 8)
    done = [e for e in conv.send(text, model="large", max_tokens=2)][-1]
    assert done.finish_reason and conv.cache.last_turn.switch.recomputed > 0
    assert recompute.sentence_ends.cache_info().misses == 1  # the start's, none since


def test_a_changed_key_measures_again(tiny_dir, cache, measures, monkeypatch):
    import mlx_kvlingo
    from mlx_kvlingo.conversation import reader

    fresh_runtime(tiny_dir).warm_up(lengths=LENGTHS)
    assert len(measures) == 1
    # another library version
    real = mlx_kvlingo.__version__
    monkeypatch.setattr(mlx_kvlingo, "__version__", "9.9.9")
    rt = fresh_runtime(tiny_dir)
    rt.warm_up(lengths=LENGTHS)
    assert len(measures) == 2 and rt.rates == "measured"
    monkeypatch.setattr(mlx_kvlingo, "__version__", real)
    rt = fresh_runtime(tiny_dir)
    rt.warm_up(lengths=LENGTHS)
    assert len(measures) == 2 and rt.rates == "cached"
    # another translator file (its weights differ): another fingerprint
    answer = dict(tiny_dir["known_answer"])
    answer["key_maps"] = [-k for k in answer["key_maps"]]
    rt = fresh_runtime(tiny_dir, forward_answer=answer)
    rt.warm_up(lengths=LENGTHS)
    assert len(measures) == 3 and rt.rates == "measured"
    # another machine: its platform
    monkeypatch.setattr(reader.platform, "platform", lambda *a, **k: "M9 Ultra")
    rt = fresh_runtime(tiny_dir)
    rt.warm_up(lengths=LENGTHS)
    assert len(measures) == 4 and rt.rates == "measured"
    # other warm-up lengths
    rt.warm_up(lengths=(8, 16))
    assert len(measures) == 5 and len(rate_files(cache)) == 5


@pytest.mark.parametrize(
    "damage",
    ["garbage", "truncated", "not_a_dict", "foreign_key", "other_schema", "bad_costs",
     "bad_reading", "unreadable"],
)  # fmt: skip
def test_a_corrupt_or_foreign_file_is_ignored(tiny_dir, cache, measures, damage):
    fresh_runtime(tiny_dir).warm_up(lengths=LENGTHS)
    (path,) = rate_files(cache)
    good = json.loads(path.read_text())
    bad = json.loads(path.read_text())
    if damage == "garbage":
        path.write_bytes(os.urandom(300) + b"\xff\xfe")
    elif damage == "truncated":
        path.write_text(path.read_text()[:200])
    elif damage == "not_a_dict":
        path.write_text("[1, 2, 3]")
    elif damage == "unreadable":
        path.unlink()
        path.mkdir()  # a folder where the file should be: reading it is an OSError
    else:
        if damage == "foreign_key":  # another machine's file under this name
            bad["key"]["machine"][2] = 4096  # its CPU count
        elif damage == "other_schema":
            bad["schema"] = "mlx-kvlingo/rates-99"
        elif damage == "bad_costs":
            bad["costs"]["forward"] = [[16, -1.0], [64, "fast"]]
        elif damage == "bad_reading":
            bad["map_reading"]["forward"] = {"key:64": "sideways"}
        path.write_text(json.dumps(bad))
    rt = fresh_runtime(tiny_dir)
    rt.warm_up(lengths=LENGTHS)  # no traceback: measured again
    assert len(measures) == 2 and rt.rates == "measured"
    if damage != "unreadable":  # and written anew, whole
        again = json.loads(path.read_text())
        assert again["key"] == good["key"] and again["schema"] == good["schema"]
        assert fresh_runtime(tiny_dir).warm_up(lengths=LENGTHS) and len(measures) == 2


def test_a_cache_folder_that_cannot_be_written_only_measures(tiny_dir, tmp_path, monkeypatch,
                                                             measures):  # fmt: skip
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    monkeypatch.setenv("KVLINGO_CACHE", str(blocker))
    for n in (1, 2):
        rt = fresh_runtime(tiny_dir)
        assert rt.warm_up(lengths=LENGTHS) > 0 and rt.rates == "measured" and len(measures) == n


def test_rates_round_trip_and_malformed_ones_are_refused():
    from mlx_kvlingo.conversation.reader import ReadCosts
    from mlx_kvlingo.kv.translator import MapReading

    costs = fixed_costs(source_read=(0.01, 0.001), target_read=(0.02, 0.01))
    again = ReadCosts.from_dict(json.loads(json.dumps(costs.to_dict())))
    assert again.to_dict() == costs.to_dict() and not again.target_read.frozen
    assert again.large_reads(40) == pytest.approx(costs.large_reads(40))
    for bad in (
        None, [], {}, {**costs.to_dict(), "extra": []}, {**costs.to_dict(), "forward": [[0, 1.0, 0]]},
        {**costs.to_dict(), "forward": [[1.5, 1.0, 0]]}, {**costs.to_dict(), "forward": [[1, 1e999, 0]]},
        {**costs.to_dict(), "forward": [[True, 1.0, 0]]}, {**costs.to_dict(), "forward": [[1, 2]]},
        {**costs.to_dict(), "forward": [[1, 2, 3, 4]]}, {**costs.to_dict(), "forward": [[1, 2, -1]]},
        {**costs.to_dict(), "forward": [[1, 2, 0.5]]}, {**costs.to_dict(), "forward": [[1e999, 1.0, 0]]},
        {**costs.to_dict(), "forward": "x"}, {**costs.to_dict(), "forward": [[1, 1.0, 0]] * 100},
    ):  # fmt: skip
        with pytest.raises(ValueError):
            ReadCosts.from_dict(bad)
    reading = MapReading({("key", 64): "gathered", ("value", 256): "in_place"})
    assert MapReading.from_dict(reading.to_dict()).chosen == reading.chosen
    for bad in (None, {"key:x": "gathered"}, {"keys:64": "gathered"}, {"key:64": "fast"},
                {"key:²": "gathered"}):  # fmt: skip
        with pytest.raises(ValueError):
            MapReading.from_dict(bad)


def test_a_fresh_process_reuses_what_the_first_one_measured(tiny_dir, tmp_path):
    """Two processes, one cache folder: the key is the same across processes (the fingerprints
    of the models and translator files, the machine, the versions)."""
    pair = load_pair(tiny_dir["qwen3"], tiny_dir["known"])
    answer = tiny_dir["known_answer"]
    save_translator(exact_translator(pair, answer), tmp_path / "fwd.safetensors", pair)
    back = pair.reversed()
    save_translator(exact_translator(back, inverse(answer)), tmp_path / "bwd.safetensors", back)
    code = (
        "import sys\n"
        "from mlx_kvlingo import load\n"
        "rt = load(*sys.argv[1:5])\n"
        "print(rt.rates, rt.load_s >= rt.warmup_s > 0)\n"
    )
    args = [str(tiny_dir["qwen3"]), str(tiny_dir["known"]), str(tmp_path / "fwd.safetensors"),
            str(tmp_path / "bwd.safetensors")]  # fmt: skip
    env = {**os.environ, "KVLINGO_CACHE": str(tmp_path / "cache"),
           "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}  # fmt: skip
    said = []
    for _ in range(2):
        out = subprocess.run([sys.executable, "-c", code, *args], env=env, cwd=tmp_path,
                             capture_output=True, text=True, timeout=300)  # fmt: skip
        assert out.returncode == 0, out.stderr[-2000:]
        said.append(out.stdout.split()[-2:])
    assert said == [["measured", "True"], ["cached", "True"]]
    mx.clear_cache()


def test_the_startup_bench_times_both_sides_in_fresh_processes(tiny_dir, tmp_path, monkeypatch):
    """`kvlingo bench --startup` on the tiny pair, one round: mlx-lm's start, kvlingo's with the
    rates reused (its untimed start stored them) and on a new cache folder (measured)."""
    from mlx_kvlingo.cli.bench import bench_cmd

    from click.testing import CliRunner

    pair = load_pair(tiny_dir["qwen3"], tiny_dir["known"])
    save_translator(exact_translator(pair, tiny_dir["known_answer"]), tmp_path / "fwd.safetensors",
                    pair)  # fmt: skip
    monkeypatch.setenv("KVLINGO_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    out = tmp_path / "out"
    result = CliRunner().invoke(
        bench_cmd,
        ["--startup", "-n", "1", "--source", str(tiny_dir["qwen3"]), "--target",
         str(tiny_dir["known"]), "--translator", str(tmp_path / "fwd.safetensors"), "-o", str(out)],
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    got = json.loads((out / "startup.json").read_text())
    runs = got["runs"]
    assert [r["rates"] for r in runs["kvlingo"]] == ["cached"]
    assert [r["rates"] for r in runs["kvlingo-new"]] == ["measured"]
    assert runs["mlx-lm"][0]["start_s"] > runs["mlx-lm"][0]["load_s"] > 0
    for side in ("kvlingo", "kvlingo-new"):
        r = runs[side][0]
        assert r["start_s"] > r["load_s"] >= r["warmup_s"] > 0 and r["ttft_s"] > 0
        assert got["summary"][side]["vs_mlx_lm"]["median"] > 0
    assert (
        "vs mlx-lm" in result.output and "kvlingo on a machine that ran it before" in result.output
    )
    # the user's cache folder keeps its own rates; the new one was removed
    assert len(rate_files(tmp_path / "cache")) == 1
    bad = CliRunner().invoke(bench_cmd, ["--startup", "--conversation"])
    assert bad.exit_code == 2 and "--startup" in bad.output


def test_a_pair_whose_folders_build_the_same_tokenizer_loads_it_once(tiny_dir, tmp_path):
    import shutil

    from mlx_kvlingo.models.pair import tokenizer_identity

    pair = load_pair(tiny_dir["qwen3"], tiny_dir["known"])
    assert tokenizer_identity(tiny_dir["qwen3"]) == tokenizer_identity(tiny_dir["known"])
    assert pair.source.tokenizer is pair.target.tokenizer is pair.tokenizer
    text = "def parse_args(argv):"
    alone = load_model(tiny_dir["known"]).tokenizer  # built from its own files
    assert pair.tokenizer.encode(text) == alone.encode(text)
    assert pair.tokenizer.apply_chat_template([{"role": "user", "content": text}]) == (
        alone.apply_chat_template([{"role": "user", "content": text}])
    )
    # a tokenizer file that differs: each model builds its own (and the pair is checked)
    other = shutil.copytree(tiny_dir["known"], tmp_path / "known")
    config = json.loads((other / "tokenizer_config.json").read_text())
    (other / "tokenizer_config.json").write_text(json.dumps({**config, "model_max_length": 77}))
    assert tokenizer_identity(other) != tokenizer_identity(tiny_dir["qwen3"])
    two = load_pair(tiny_dir["qwen3"], other)
    assert two.source.tokenizer is not two.target.tokenizer
    # another model type (mlx-lm may set its tokenizer up by type), a hub id: not compared
    llama = shutil.copytree(tiny_dir["qwen3"], tmp_path / "as-llama")
    config = json.loads((llama / "config.json").read_text())
    (llama / "config.json").write_text(json.dumps({**config, "model_type": "llama"}))
    assert tokenizer_identity(llama) != tokenizer_identity(tiny_dir["qwen3"])
    assert tokenizer_identity("org/not-a-folder") is None
