"""Calibration: stage 1 (closed-form ridge), stage 2 (KL self-distillation)."""

from mlx_kvlingo.calibrate.closed_form import Stage1Config, fit_closed_form


def fit_kvlingo(pair, train, nu: int = 1, native_first: bool = True, progress: bool = True):
    """Stage 1 with the defaults at `nu` source layers per target layer (for comparisons)."""
    return fit_closed_form(pair, train, Stage1Config(nu=nu, native_first=native_first), progress)


__all__ = ["Stage1Config", "fit_closed_form", "fit_kvlingo"]
