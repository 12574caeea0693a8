"""Calibration: stage 1 (closed-form ridge), stage 2 (KL self-distillation)."""

from mlx_kvlingo.calibrate.closed_form import Stage1Config, fit_closed_form

__all__ = ["Stage1Config", "fit_closed_form"]
