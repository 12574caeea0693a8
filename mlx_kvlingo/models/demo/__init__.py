"""The demo pairs: SmolLM2-135M-Instruct (dense, or its exact MoE upcycle) and a pruned, healed
small model."""

#: the demo pairs (`pair.py`): the same small source, a dense or an MoE large target
DEMO_PAIRS = ("dense", "moe")


def check_demo_pair(name: str) -> None:
    if name not in DEMO_PAIRS:
        raise ValueError(f"unknown demo pair {name!r} (known: {', '.join(DEMO_PAIRS)})")
