"""The method: capture RoPE-free K/V from the small model, translate it per layer, re-rotate it
into the large model's cache, recompute what drifted, and hand off (`handoff.py`)."""
