"""Laptop latency benchmark: does translating the KV cache beat re-prefilling, here?

    python apps/laptop_bench.py                      # the demo pair
    python apps/laptop_bench.py --preset "qwen3-0.6b>qwen3-30b-a3b-scaled" --lengths 64,256,1024
    python apps/laptop_bench.py --help

Same as `kvlingo bench`; results land in ./bench-results (bench.md, bench.json, ttft.png).
"""

import mlx_kvlingo  # noqa: F401  (OpenBLAS before mlx)
from mlx_kvlingo.cli.bench import bench_cmd

if __name__ == "__main__":
    bench_cmd(prog_name="laptop_bench.py")
