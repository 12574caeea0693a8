"""How an answer is sampled: one config, resolved per answering model, built with mlx-lm.

Defaults come from the model folder's `generation_config.json` where it sets them (the
Hugging Face fields `do_sample`, `temperature`, `top_p`, `top_k`, `min_p`,
`repetition_penalty`), otherwise from `DEFAULTS`: temperature 0.7, top-p 0.9, min-p 0.05,
repetition penalty 1.1 over the last 256 tokens of the conversation's answers (the previous
answers included, small models copy them otherwise; the user's text excluded, which an answer
may need to repeat). Greedy decoding of small chat models loops
("I'm not sure how to do it." 40 times); these settings keep answers readable. Explicit
values always win: `resolve` merges them, the one place that does. `temp=0` is greedy; the
repetition penalty then applies only when given explicitly, so greedy stays plain argmax
decoding unless asked otherwise.
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
    seed: int | None = None  # seeds MLX's generator before the answer (None: leave it); a
    # conversation's answers add the number of assistant messages before them (api._seed)

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
    """The sampling fields of `folder/generation_config.json` as `Sampling` keywords ({} if none)."""
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
    for hf, ours, kind in (("top_p", "top_p", float), ("top_k", "top_k", int),
                           ("min_p", "min_p", float),
                           ("repetition_penalty", "repetition_penalty", float)):  # fmt: skip
        if isinstance(raw.get(hf), (int, float)) and not isinstance(raw.get(hf), bool):
            out[ours] = kind(raw[hf])
    return out


#: what a caller may pass as `sampling`: a whole `Sampling`, the fields to set (a dict, merged
#: over the answering model's defaults; None values count as not set), or None (all defaults)
Overrides = Sampling | Mapping[str, Any] | None


def resolve(model=None, sampling: Overrides = None) -> Sampling:
    """The one place sampling settings are merged, for `model` (a LoadedModel or None).

    `sampling` a `Sampling`: taken whole, as it is. A mapping of `Sampling` fields (values
    not None): those fields over the model's generation_config.json over `DEFAULTS`, e.g.
    `{"temp": 0.2}` keeps the model's top-p. None: the model's defaults. `temp=0` drops the
    default repetition penalty (greedy stays plain argmax) unless one is given. An unknown
    field is a ValueError that names the known ones."""
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
    """One line for banners: `temp 0.7 · top-p 0.9 · min-p 0.05 · rep 1.1/64`."""
    if cfg.temp == 0:
        head = "greedy"
    else:
        head = f"temp {cfg.temp:g} · top-p {cfg.top_p:g}" + (
            f" · top-k {cfg.top_k}" if cfg.top_k else ""
        )
        head += f" · min-p {cfg.min_p:g}"
    if cfg.repetition_penalty not in (None, 1.0):
        head += (
            f" · repetition penalty {cfg.repetition_penalty:g} over {cfg.repetition_context_size}"
        )
    return head + (f" · seed {cfg.seed}" if cfg.seed is not None else "")
