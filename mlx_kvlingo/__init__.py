"""mlx-kvlingo: KV-cache translation between two language models on MLX."""

from . import _blas

_blas.preload()  # must run before the first `import mlx`

__version__ = "0.1.0"
