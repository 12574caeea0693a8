"""The demo pairs: SmolLM2-135M-Instruct (dense, or its exact MoE upcycle) and a pruned, healed
small model."""
