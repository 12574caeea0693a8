"""Experiments on the demo pair whose output is not shipped (see README.md here)."""
