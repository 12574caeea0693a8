"""Stage 2: self-distillation. The target is its own teacher.

loss = KL( target's next-token distribution with its native cache
         || the same with the translated cache ),  averaged over continuation tokens
     [+ kv_weight * scoring.kv_error: translated vs the target's own K/V of the prefix]

Only the translator is trained; both models stay frozen. A fresh target cache is built inside
the loss on every call, so gradients flow through the translated cache contents.
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from mlx_kvlingo._platform.atomic import atomic_write, link_or_copy, write_text
from mlx_kvlingo.kv.scoring import heldout_scores, kl, kv_error, prepare, student_logp
from mlx_kvlingo.models.files import load_translator, save_translator

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
import numpy as np
from mlx.utils import tree_flatten, tree_map, tree_unflatten


class TrainingDivergedError(RuntimeError):
    pass


@dataclass
class Stage2Config:
    steps: int = 100
    learning_rate: float = 1e-4
    warmup: int = 10
    weight_decay: float = 0.0
    grad_clip: float = 1.0
    accumulate: int = 1  # examples per optimizer step
    eval_every: int = 25
    eval_examples: int = 16
    save_every: int = 25
    seed: int = 0
    keep_best: bool = True  # return the parameters of the lowest held-out KL
    patience: int | None = None  # stop after this many evaluations without a new best
    max_seconds: float | None = None  # stop after the step that crosses this wall time
    # share of multi-turn examples whose earlier replies the target reads itself (reader mode)
    reader_share: float = 0.0
    # weight each training token's KL by `scoring.prefix_gain` (the held-out KL stays a mean)
    gain_weights: bool = False
    kv_weight: float = 0.0  # weight of `scoring.kv_error` added to the KL

    def __post_init__(self):
        if self.patience is not None and self.patience < 1:
            raise ValueError(f"patience must be >= 1 evaluations (got {self.patience})")
        if not 0.0 <= self.reader_share <= 1.0:
            raise ValueError(f"reader_share must be in [0, 1] (got {self.reader_share})")
        if not self.kv_weight >= 0.0:  # NaN fails too
            raise ValueError(f"kv_weight must be >= 0 (got {self.kv_weight})")


def _reader_mode(index: int, cfg: Stage2Config) -> bool:
    """Whether example `index` is prepared in reader mode: a fixed, evenly spread choice."""
    share = cfg.reader_share
    return share > 0 and int(index * share) != int((index + 1) * share)


def _example_at(position: int, n: int, seed: int) -> int:
    """The example at `position` of the training order: a fresh permutation per epoch."""
    epoch, i = divmod(position, n)
    return int(np.random.default_rng(seed * 1_000_003 + epoch).permutation(n)[i])


def save_checkpoint(
    folder: Path, translator, optimizer, step: int, cfg, history, pair=None, best=None
) -> None:
    """Write a resumable checkpoint; a process killed at any point leaves the previous one:
    the step's files (named after it) first, then `state.json`, which names them (the commit),
    then `translator.safetensors` linked to the new translator and the old step's files removed."""
    folder.mkdir(parents=True, exist_ok=True)
    names = {"translator": f"translator-{step:07d}.safetensors",
             "optimizer": f"optimizer-{step:07d}.safetensors"}  # fmt: skip
    save_translator(translator, folder / names["translator"], pair)
    with atomic_write(folder / names["optimizer"]) as tmp:
        mx.save_safetensors(str(tmp), dict(tree_flatten(optimizer.state)))
    meta = {"step": step, "config": asdict(cfg), "history": history, "files": names}
    if best is not None:  # the held-out best (its parameters are in best.safetensors)
        meta["best"] = best
    write_text(folder / "state.json", json.dumps(meta, indent=1))  # the commit
    link_or_copy(folder / names["translator"], folder / "translator.safetensors")
    keep = {*names.values(), "translator.safetensors", "best.safetensors"}
    for old in [*folder.glob("translator-*.safetensors"), *folder.glob("optimizer-*.safetensors")]:
        if old.name not in keep:
            old.unlink(missing_ok=True)


def load_checkpoint(folder: Path) -> tuple[dict, Path, Path]:
    """(state, translator file, optimizer file) of the checkpoint `state.json` commits to."""
    state = json.loads((folder / "state.json").read_text())
    if "files" not in state:
        raise ValueError(f"{folder}: a checkpoint from before 0.2.0: start over with --no-resume")
    return state, folder / state["files"]["translator"], folder / state["files"]["optimizer"]


def distill(
    translator,
    pair,
    train,
    heldout=(),
    cfg: Stage2Config = Stage2Config(),
    checkpoint_dir: str | Path | None = None,
    resume: bool = True,
    progress=None,
    stop_after: int | None = None,
):
    """Train `translator` in place; returns it with `metadata['calibration']['stage2']` filled.

    With `checkpoint_dir`, saves every `save_every` steps, on Ctrl-C, and when the loss turns
    NaN (`TrainingDivergedError`); `resume` continues exactly (weights, optimizer moments, data
    position); `stop_after` ends after that many steps in this call. `progress(step, steps,
    note)` after each step. With held-out examples, every `eval_every` steps records the
    held-out KL and top-1 agreement; `keep_best` returns (and saves as `best.safetensors`) the
    lowest held-out KL's parameters, the start included; `patience`: evaluations without one.
    """
    ckpt = Path(checkpoint_dir) if checkpoint_dir else None
    key_cut = translator.config.key_cut
    warm, lr = max(cfg.warmup, 1), cfg.learning_rate  # linear warm-up, then cosine to lr / 10
    decay = optim.cosine_decay(lr, max(cfg.steps - warm, 1), lr * 0.1)
    schedule = optim.join_schedules([optim.linear_schedule(0.0, lr, warm), decay], [warm])
    optimizer = optim.AdamW(learning_rate=schedule, weight_decay=cfg.weight_decay)
    optimizer.init(translator.trainable_parameters())
    step, history = 0, []
    if ckpt and resume and (ckpt / "state.json").exists():
        state, tr_file, opt_file = load_checkpoint(ckpt)
        loaded = load_translator(tr_file)
        translator.update({"key": loaded.key, "value": loaded.value})
        optimizer.state = tree_unflatten(list(mx.load(str(opt_file)).items()))
        step, history = state["step"], state["history"]
    held = [
        prepare(pair, ex, key_cut, reader_mode=_reader_mode(i, cfg))
        for i, ex in enumerate(list(heldout)[: cfg.eval_examples])
    ]
    best = _Best.start(translator, pair, held, history, ckpt) if held else None

    def loss(p):
        value = kl(p.teacher_logp, student_logp(translator, pair, p), p.weights)
        return value + cfg.kv_weight * kv_error(translator, p) if cfg.kv_weight else value

    loss_and_grad = nn.value_and_grad(translator, loss)

    def save():
        if ckpt:
            record = best and {"step": best.step, "heldout_kl": best.kl,
                               "start_heldout_kl": best.start_kl}  # fmt: skip
            save_checkpoint(ckpt, translator, optimizer, step, cfg, history, pair, record)

    stopped_early = None  # or why the run ended before cfg.steps

    start_step, t0, tokens = step, time.perf_counter(), 0
    try:
        while step < cfg.steps and (stop_after is None or step - start_step < stop_after):
            grads, total = None, 0.0
            for j in range(cfg.accumulate):
                i = _example_at(step * cfg.accumulate + j, len(train), cfg.seed)
                prep = prepare(pair, train[i], key_cut, reader_mode=_reader_mode(i, cfg),
                               gain_weights=cfg.gain_weights,
                               native_kv=cfg.kv_weight > 0)  # fmt: skip
                loss, g = loss_and_grad(prep)
                mx.eval(loss, g)
                if not math.isfinite(loss.item()):
                    save()
                    where = f"; last good state saved in {ckpt}" if ckpt else ""
                    raise TrainingDivergedError(
                        f"stage-2 loss is {loss.item()} at step {step + 1}{where}"
                    )
                total += loss.item() / cfg.accumulate
                tokens += len(train[i].continuation)
                g = tree_map(lambda x: x / cfg.accumulate, g)
                grads = g if grads is None else tree_map(mx.add, grads, g)
            grads, _ = optim.clip_grad_norm(grads, cfg.grad_clip)
            optimizer.update(translator, grads)
            mx.eval(translator.parameters(), optimizer.state)
            step += 1
            record = {"step": step, "loss": total}
            if held and (step % cfg.eval_every == 0 or step == cfg.steps):
                record["heldout_kl"], record["heldout_agree"] = heldout_scores(
                    translator, pair, held
                )
                best.offer(translator, step, record["heldout_kl"], pair, ckpt)
            history.append(record)
            tps = tokens / (time.perf_counter() - t0)
            if progress:
                progress(step, cfg.steps, f"loss {total:.4f} · {tps:.0f} tok/s")
            if ckpt and step % cfg.save_every == 0:
                save()
            if cfg.patience and best and best.evals_since >= cfg.patience:
                stopped_early = "patience"
                break
            if cfg.max_seconds is not None and time.perf_counter() - t0 > cfg.max_seconds:
                stopped_early = "time budget"
                break
    except KeyboardInterrupt:
        save()
        raise
    save()
    evals = [h for h in history if "heldout_kl" in h]
    cal = translator.config.metadata.setdefault("calibration", {})
    cal["stage2"] = {
        "steps": step, "config": asdict(cfg), "stopped_early": stopped_early,
        "final_train_loss": history[-1]["loss"] if history else None,
        "heldout_kl": evals[-1]["heldout_kl"] if evals else None,
        "heldout_kl_history": [(h["step"], h["heldout_kl"]) for h in evals],
        "heldout_agree_history": [(h["step"], h.get("heldout_agree")) for h in evals],
    }  # fmt: skip
    if best is not None:
        cal["stage2"]["best"] = {"step": best.step, "heldout_kl": best.kl,
                                 "kept": cfg.keep_best, "start_heldout_kl": best.start_kl}  # fmt: skip
        if cfg.keep_best:
            translator.update(best.params)
            cal["stage2"]["heldout_kl"] = best.kl
    return translator


class _Best:
    """The held-out best so far: parameters (in memory and `best.safetensors`), step, KL."""

    def __init__(self, params, step: int, kl_value: float, start_kl: float):
        self.params, self.step, self.kl, self.start_kl = params, step, kl_value, start_kl
        self.evals_since = 0

    @classmethod
    def start(cls, translator, pair, held, history, ckpt) -> _Best:
        """The starting point counts (a run that only gets worse returns its input); on a
        resume, the best recorded in the history and its file."""
        evals = [h for h in history if "heldout_kl" in h]
        if ckpt and evals and (ckpt / "best.safetensors").exists():
            b = json.loads((ckpt / "state.json").read_text())["best"]
            loaded = load_translator(ckpt / "best.safetensors")
            params = {"key": loaded.key, "value": loaded.value}
            best = cls(params, b["step"], b["heldout_kl"], b["start_heldout_kl"])
            last = max((h["step"] for h in evals if h["heldout_kl"] <= best.kl), default=0)
            best.evals_since = sum(1 for h in evals if h["step"] > last)
            return best
        start_kl, _ = heldout_scores(translator, pair, held)
        return cls(_snapshot(translator), 0, start_kl, start_kl)

    def offer(self, translator, step: int, kl_value: float, pair, ckpt) -> None:
        if kl_value < self.kl:
            self.params, self.step, self.kl = _snapshot(translator), step, kl_value
            self.evals_since = 0
            if ckpt:
                ckpt.mkdir(parents=True, exist_ok=True)
                save_translator(translator, ckpt / "best.safetensors", pair)
        else:
            self.evals_since += 1


def _snapshot(translator) -> dict:
    """A copy of the trainable parameters (arrays are immutable: the tree copy suffices)."""
    return tree_map(lambda x: x, {"key": dict(translator.key), "value": dict(translator.value)})
