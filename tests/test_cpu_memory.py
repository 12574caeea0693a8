"""CPU memory reuse: the MLX cache limit is raised at model load, never lowered, and the
whole tuning can be turned off."""

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


def test_raises_the_default_and_keeps_a_higher_limit(default_limit):
    wanted = _cpu_memory.cache_target()
    assert wanted > 32 << 20
    assert _cpu_memory.tune()["cache_limit"] == wanted
    assert mx.set_cache_limit(wanted) == wanted  # what is in force now
    mx.set_cache_limit(2 * wanted)  # the user's own, higher
    assert _cpu_memory.tune()["cache_limit"] == 2 * wanted
    assert mx.set_cache_limit(2 * wanted) == 2 * wanted


def test_malloc_is_tuned_on_glibc(default_limit):
    import platform

    expected = "tuned" if platform.libc_ver()[0] == "glibc" else None
    got = _cpu_memory.tune()["malloc"]
    assert got == expected or (expected is None and got != "tuned")


def test_opt_out_leaves_the_limit_alone(default_limit, monkeypatch):
    monkeypatch.setenv("KVLINGO_CPU_MEMORY", "default")
    _cpu_memory.tune()
    assert mx.set_cache_limit(32 << 20) == 32 << 20


def test_loading_a_model_raises_it(default_limit, tiny_dir):
    from mlx_kvlingo.pair import load_model

    load_model(tiny_dir["qwen3"])
    assert mx.set_cache_limit(32 << 20) == _cpu_memory.cache_target()
