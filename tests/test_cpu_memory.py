"""CPU memory reuse: glibc's malloc thresholds are set at model load, MLX's cache limit is left
as MLX or the user set it, the tuning can be turned off, and a reserved translation serves the
first translation at each shorter length."""

import mlx_kvlingo  # noqa: F401  (OpenBLAS before mlx)
from mlx_kvlingo import _cpu_memory

import mlx.core as mx
import pytest


@pytest.fixture
def default_limit(monkeypatch):
    monkeypatch.delenv("KVLINGO_CPU_MEMORY", raising=False)
    previous = mx.set_cache_limit(32 << 20)
    yield
    mx.set_cache_limit(previous)


def test_leaves_the_mlx_cache_limit_alone(default_limit):
    """A larger MLX cache made the first translation at each new length fault fresh pages in
    (it keeps buffers for requests of nearly their size only): tune must not raise it."""
    assert _cpu_memory.tune()["cache_limit"] == 32 << 20
    assert mx.set_cache_limit(32 << 20) == 32 << 20
    mx.set_cache_limit(64 << 30)  # the user's own
    assert _cpu_memory.tune()["cache_limit"] == 64 << 30
    assert mx.set_cache_limit(32 << 20) == 64 << 30


def test_malloc_is_tuned_on_glibc(default_limit):
    import platform

    expected = "tuned" if platform.libc_ver()[0] == "glibc" else None
    got = _cpu_memory.tune()["malloc"]
    assert got == expected or (expected is None and got != "tuned")


def test_opt_out_leaves_malloc_alone(default_limit, monkeypatch):
    monkeypatch.setattr(_cpu_memory, "state", {})
    monkeypatch.setenv("KVLINGO_CPU_MEMORY", "default")
    assert _cpu_memory.tune() == {}


def test_loading_a_model_tunes_malloc(default_limit, tiny_dir, monkeypatch):
    from mlx_kvlingo.pair import load_model

    monkeypatch.setattr(_cpu_memory, "state", {})
    load_model(tiny_dir["qwen3"])
    assert "malloc" in _cpu_memory.state
    assert mx.set_cache_limit(32 << 20) == 32 << 20


_FIRST_AT_A_NEW_LENGTH = """
import json, resource, sys
import mlx_kvlingo
import mlx.core as mx
from mlx_kvlingo.capture import SpanKV
from mlx_kvlingo.decode import reserve_translation_memory, translate_into
from mlx_kvlingo.kvcache import new_cache
from mlx_kvlingo.pair import load_pair
sys.path.insert(0, "tests")
from helpers import exact_translator
from mlx_kvlingo import synthetic as syn
import pathlib
d = pathlib.Path(sys.argv[1])
tok = syn.build_tokenizer(d / "tokenizer")
source = syn.make_model_folder(d / "qwen3", "qwen3", tok, seed=0)
answer = syn.known_answer_target(source, d / "known", seed=4)
pair = load_pair(source, d / "known")
tr = exact_translator(pair, answer)
s = tr.config.source

def faults(n):  # minor page faults of one translation of n tokens into a fresh cache
    shape = (s.layers, 1, s.kv_heads, n, s.head_dim)
    span = SpanKV(mx.random.normal(shape), mx.random.normal(shape), start=0)
    mx.eval(span.keys, span.values)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    cache = new_cache(pair.target)
    translate_into(pair, tr, span, cache)
    mx.eval([c.state for c in cache])
    after = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    del cache
    mx.clear_cache()
    return after - before

faults(64)
grown = faults(1024)  # a first translation at a longer length: its pages are new
ran = reserve_translation_memory(pair.target, tr, 4096)
print(json.dumps({"ran": ran, "grown": grown, "after_reserve": faults(2048)}))
"""


@pytest.mark.skipif(
    __import__("platform").libc_ver()[0] != "glibc", reason="malloc thresholds are glibc's"
)
def test_reserved_memory_serves_the_first_translation_at_a_new_length(tmp_path):
    """After `reserve_translation_memory(n)`, the first translation at a new length below n
    faults (almost) no page in; without it, one at twice the length of the last faults more
    pages than that one did. In a fresh process: glibc's state is process-wide."""
    import json
    import subprocess
    import sys

    got = subprocess.run([sys.executable, "-c", _FIRST_AT_A_NEW_LENGTH, str(tmp_path)],
                         capture_output=True, text=True, check=True)  # fmt: skip
    result = json.loads(got.stdout.strip().splitlines()[-1])
    assert result["ran"]
    assert result["grown"] > 500  # the control: growing faults pages in
    assert result["after_reserve"] < result["grown"] / 4, result
