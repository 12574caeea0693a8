"""What a calibration will cost on this machine, said before it starts.

The rates come from a short measurement on the loaded pair (one source prefill, one target
prefill and one target decode step at a probe length, after a warm-up call of each), so the
estimate is for this machine, backend and dtype; costs grow linearly with tokens, which holds
well below a few thousand tokens. Peak memory is MLX's own peak (both models' weights and a
forward pass at twice the longest example) plus 20 % for stage 2's gradients and optimizer state.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from mlx_kvlingo.kv.cache import new_cache

import mlx.core as mx


@dataclass
class Rates:
    source_ms_per_token: float
    target_ms_per_token: float
    decode_step_ms: float


@dataclass
class CalibrationPlan:
    stage1_examples: int  # 0 when stage 2 starts from a given translator
    train_examples: int  # ordinary examples in stage 2's pool, beside the content ones
    heldout_examples: int
    content_examples: int
    stage2_steps: int
    accumulate: int
    mean_prefix: float
    mean_content_prefix: float
    rates: Rates
    peak_bytes: int
    content_to_answer: int | None = None  # None: all; fewer when a resume finds answers cached

    def seconds(self) -> dict[str, float]:
        r = self.rates
        read = lambda n: n * (r.source_ms_per_token + r.target_ms_per_token) / 1e3  # noqa: E731
        # answers decode in batches of 16 (mlx-lm batch_generate): a batched step costs about
        # two single ones on a memory-bound backend; cached answers (a resume) cost nothing
        todo = self.content_examples if self.content_to_answer is None else self.content_to_answer
        answers = todo * (self.mean_content_prefix * r.target_ms_per_token
                          + 32 * 2 * r.decode_step_ms / 16) / 1e3  # fmt: skip
        pool = (self.train_examples * self.mean_prefix
                + self.content_examples * self.mean_content_prefix) / max(
            self.train_examples + self.content_examples, 1)  # fmt: skip
        # a stage-2 step: the source's trace and the teacher, then forward + backward (~3x)
        step = read(pool) + 3 * pool * r.target_ms_per_token / 1e3
        return {
            "content answers": answers,
            "stage 1": 1.3 * self.stage1_examples * read(self.mean_prefix),
            "stage 2": self.stage2_steps * self.accumulate * step,
        }

    def describe(self) -> str:
        secs = self.seconds()
        parts = " · ".join(f"{k} ~{_dur(v)}" for k, v in secs.items() if v > 0)
        return (
            f"plan: {self.stage1_examples} stage-1 and {self.train_examples} ordinary stage-2 "
            f"examples (mean prefix {self.mean_prefix:.0f} tokens), {self.heldout_examples} held out, {self.content_examples} content "
            f"examples (mean prompt {self.mean_content_prefix:.0f} tokens), {self.stage2_steps} "
            f"stage-2 steps x {self.accumulate}\n"
            f"estimated on this machine: {parts} · total ~{_dur(sum(secs.values()))} · peak "
            f"memory ~{self.peak_bytes / 2**30:.1f} GiB"
        )


def _dur(s: float) -> str:
    return f"{s:.0f} s" if s < 90 else (f"{s / 60:.0f} min" if s < 5400 else f"{s / 3600:.1f} h")


def _timed(fn) -> float:
    fn()  # warm-up: compiled kernels, first allocations
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def measure_rates(pair, probe_tokens: int = 128) -> Rates:
    """Per-token prefill cost of both models and one target decode step, measured here."""
    tokens = (mx.arange(probe_tokens) % 1000 + 10)[None]  # ordinary token ids; content is moot

    def read(model) -> list:
        cache = new_cache(model)
        model.model(tokens, cache=cache)
        mx.eval([c.keys for c in cache])
        return cache

    cache = read(pair.target)

    def step():
        mx.eval(pair.target.model(tokens[:, :1], cache=cache))
        for c in cache:
            c.offset -= 1  # stay at the probe length (the decode step is the probe)

    src, tgt = _timed(lambda: read(pair.source)), _timed(lambda: read(pair.target))
    dec = _timed(step)
    return Rates(1e3 * src / probe_tokens, 1e3 * tgt / probe_tokens, 1e3 * dec)


def probe_peak(fn) -> int:
    """MLX's peak memory while `fn` runs (a stage-2 step on the longest example)."""
    mx.reset_peak_memory()
    fn()
    return int(mx.get_peak_memory())
