"""`kvlingo info`: the machine (backend, BLAS, measured GEMM speed) and models' KV geometry."""

from __future__ import annotations

import platform
import time

from mlx_kvlingo._platform import blas, cpu_memory
from mlx_kvlingo.cli._params import ModelSpec

import click
import mlx.core as mx
from rich.console import Console
from rich.table import Table


def gemm_gflops(n: int = 1024, repeats: int = 5) -> float:
    a = mx.random.normal((n, n))
    b = mx.random.normal((n, n))
    mx.eval(a @ b)
    t = time.perf_counter()
    for _ in range(repeats):
        mx.eval(a @ b)
    return 2 * n**3 * repeats / (time.perf_counter() - t) / 1e9


@click.command("info")
@click.argument("models", nargs=-1, type=ModelSpec())
def info_cmd(models):
    """Backend, BLAS and float32 GEMM speed; KV geometry of MODELS (hub ids or folders)."""
    console = Console()
    device = "Metal GPU" if mx.metal.is_available() else "CPU"
    console.print(f"mlx {mx.__version__} on {device} ({platform.system()} {platform.machine()})")
    if platform.system() == "Linux":
        loaded = blas.loaded_path and f"OpenBLAS preloaded ({blas.loaded_path})"
        console.print(f"BLAS: {loaded or f'no preload: {blas.reason}'}")
    if device == "CPU" and (state := cpu_memory.tune()):
        console.print(
            f"memory reuse: malloc thresholds: {state['malloc']}; MLX buffer cache up "
            f"to {state['cache_limit'] / 2**20:.0f} MB"
        )
    elif device == "CPU":
        console.print("memory reuse: as MLX and the C library set it (KVLINGO_CPU_MEMORY=default)")
    console.print(f"float32 GEMM 1024^3: {gemm_gflops():.1f} GFLOP/s")
    if not models:
        return
    from mlx_kvlingo.models.pair import describe_model, load_model

    described = [describe_model(load_model(name, dtype=None)) for name in models]
    table = Table("", *[d["name"] for d in described])
    rope = "{kind} dims={dims} base={base} traditional={traditional}".format
    for key in ("model_type", "layers", "kv_heads", "head_dim", "rope", "has_k_norm", "dtype",
                "parameters_MB", "kv_bytes_per_token"):  # fmt: skip
        table.add_row(key, *[rope(**d[key]) if key == "rope" else str(d[key]) for d in described])
    console.print(table)
