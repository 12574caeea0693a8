"""The demo pairs: SmolLM2-135M-Instruct (dense, or its exact MoE upcycle) and a pruned, healed
small model."""

#: the demo pairs (`pair.py`): the same small source, a dense or an MoE large target
DEMO_PAIRS = ("dense", "moe")
