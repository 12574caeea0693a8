"""How an answer is sampled: one config, resolved per answering model, built with mlx-lm's
`make_sampler` and `make_logits_processors`.

`resolve` is the one place settings merge: explicit values over the model folder's
`generation_config.json` (`do_sample`, `temperature`, `top_p`, `top_k`, `min_p`,
`repetition_penalty`) over `DEFAULTS`, whose repetition penalty covers the conversation's
answers (decode.py), never the user's text. `temp=0` is greedy and stays plain argmax: the
default repetition penalty then applies only when given explicitly.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from mlx_lm.sample_utils import make_logits_processors, make_sampler


@dataclass(frozen=True)
class Sampling:
    temp: float = 0.7
    top_p: float = 0.9
    top_k: int = 0  # 0: off
    min_p: float = 0.05
    repetition_penalty: float = 1.1  # 1.0: off
    repetition_context_size: int = 256  # the last answer and the new turn, not only this one
    seed: int | None = None  # seeds MLX before the answer (None: leave it; stream.seed)

    def sampler(self):
        """mlx-lm's sampler for these settings (argmax when temp is 0)."""
        return make_sampler(temp=self.temp, top_p=self.top_p, min_p=self.min_p, top_k=self.top_k)

    def logits_processors(self) -> list:
        """mlx-lm's repetition penalty over the last `repetition_context_size` tokens, if on."""
        if self.repetition_penalty in (None, 1.0):
            return []
        return make_logits_processors(
            repetition_penalty=self.repetition_penalty,
            repetition_context_size=self.repetition_context_size,
        )

    def as_dict(self) -> dict:
        return asdict(self)


DEFAULTS = Sampling()
GREEDY = Sampling(temp=0.0, top_p=0.0, top_k=0, min_p=0.0, repetition_penalty=1.0)
FIELDS = tuple(DEFAULTS.as_dict())


def generation_config(folder: str | Path | None) -> dict:
    """The sampling fields of `folder/generation_config.json` as `Sampling` keywords ({}: none)."""
    if folder is None:
        return {}
    path = Path(folder) / "generation_config.json"
    try:
        raw = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    if not isinstance(raw, dict):
        return {}
    out = {}
    if raw.get("do_sample") is False:
        out["temp"] = 0.0
    elif isinstance(raw.get("temperature"), (int, float)):
        out["temp"] = float(raw["temperature"])
    kinds = {"top_p": float, "top_k": int, "min_p": float, "repetition_penalty": float}
    for k, kind in kinds.items():
        if isinstance(raw.get(k), (int, float)) and not isinstance(raw.get(k), bool):
            out[k] = kind(raw[k])
    return out


def resolve(model=None, sampling: Sampling | Mapping[str, Any] | None = None) -> Sampling:
    """The settings for `model` (a LoadedModel or None): a `Sampling` taken whole; a mapping's
    fields (None: not set) over the model's generation_config.json over `DEFAULTS` (`{"temp":
    0.2}` keeps the model's top-p); None: the model's defaults. An unknown field is a ValueError
    naming the known ones."""
    if isinstance(sampling, Sampling):
        return sampling
    if sampling is None:
        sampling = {}
    if not isinstance(sampling, Mapping):
        raise TypeError(
            f"sampling must be a Sampling, a dict of its fields or None, "
            f"not {type(sampling).__name__}"
        )
    unknown = set(sampling) - set(FIELDS)
    if unknown:
        hint = " (temperature is 'temp')" if "temperature" in unknown else ""
        raise ValueError(
            f"unknown sampling settings {sorted(map(str, unknown))}{hint}; known: "
            f"{', '.join(FIELDS)}"
        )
    explicit = {k: v for k, v in sampling.items() if v is not None}
    base = replace(DEFAULTS, **generation_config(getattr(model, "folder", None)))
    if explicit.get("temp") == 0 or (base.temp == 0 and "temp" not in explicit):
        base = replace(base, repetition_penalty=1.0)  # greedy stays plain unless asked
    return replace(base, **explicit)


def describe(cfg: Sampling) -> str:
    """One line for banners: `temp 0.7 · top-p 0.9 · min-p 0.05 · repetition penalty 1.1 over
    256`."""
    head = "greedy" if cfg.temp == 0 else f"temp {cfg.temp:g} · top-p {cfg.top_p:g}"
    if cfg.temp != 0:
        head += (f" · top-k {cfg.top_k}" if cfg.top_k else "") + f" · min-p {cfg.min_p:g}"
    if cfg.repetition_penalty not in (None, 1.0):
        head += f" · repetition penalty {cfg.repetition_penalty:g} over "
        head += f"{cfg.repetition_context_size}"
    return head + (f" · seed {cfg.seed}" if cfg.seed is not None else "")
