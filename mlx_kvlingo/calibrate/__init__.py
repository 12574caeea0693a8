"""Calibration: stage 1 (closed-form ridge), stage 2 (KL self-distillation)."""
