"""The CPU buffer cache is raised at model load, never lowered, and can be turned off."""

import mlx_kvlingo  # noqa: F401  (OpenBLAS before mlx)
from mlx_kvlingo import _buffer_cache

import mlx.core as mx
import pytest


@pytest.fixture
def restore_limit():
    previous = mx.set_cache_limit(32 << 20)
    yield
    mx.set_cache_limit(previous)


def test_raises_the_default_and_keeps_a_higher_limit(restore_limit, monkeypatch):
    monkeypatch.delenv("KVLINGO_CPU_CACHE_LIMIT", raising=False)
    wanted = _buffer_cache.target_limit()
    assert wanted > 32 << 20
    assert _buffer_cache.raise_cpu_cache_limit() == wanted
    assert mx.set_cache_limit(wanted) == wanted  # what is in force now
    mx.set_cache_limit(2 * wanted)  # the user's own, higher
    assert _buffer_cache.raise_cpu_cache_limit() == 2 * wanted
    assert mx.set_cache_limit(2 * wanted) == 2 * wanted


def test_opt_out_leaves_the_limit_alone(restore_limit, monkeypatch):
    monkeypatch.setenv("KVLINGO_CPU_CACHE_LIMIT", "0")
    assert _buffer_cache.raise_cpu_cache_limit() is None
    assert mx.set_cache_limit(32 << 20) == 32 << 20


def test_loading_a_model_raises_it(restore_limit, monkeypatch, tiny_dir):
    from mlx_kvlingo.pair import load_model

    monkeypatch.delenv("KVLINGO_CPU_CACHE_LIMIT", raising=False)
    load_model(tiny_dir["qwen3"])
    assert mx.set_cache_limit(32 << 20) == _buffer_cache.target_limit()
