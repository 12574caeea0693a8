"""Calibration: data streams, stage 1 (closed-form ridge), stage 2 (KL self-distillation)."""

from .closed_form import Stage1Config, fit_closed_form
from .data import DataConfig, DataError, Example, load_examples

__all__ = [
    "DataConfig", "DataError", "Example", "load_examples",
    "Stage1Config", "fit_closed_form",
]  # fmt: skip
