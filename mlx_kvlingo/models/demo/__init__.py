"""Real demo model pair: SmolLM2-135M-Instruct (target) and a pruned, healed source."""

from mlx_kvlingo.models.demo.smollm2 import ensure_demo_source, ensure_smollm2, find_gguf

__all__ = ["ensure_demo_source", "ensure_smollm2", "find_gguf"]
