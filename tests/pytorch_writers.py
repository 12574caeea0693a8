"""Test fixtures written with exactly the structure the two public PyTorch writers produce.

Nothing here comes from our converters: every key, nesting, dtype and string follows the public
writer named next to it, so the converters are tested against what users really have.

knlp (mcgrof/knlp, research/kv_translate/published/):
    kv_lingo_train.py `translator_artifact`  -> `knlp_translator`
    kv_lingo_train.py `checkpoint_state`     -> `knlp_stage2_checkpoint`
    (the weights are `LinearTranslator.state_dict()` of kv_lingo.py: `key_weight`/`value_weight`,
    float32 [layers, target width, source width], applied with `F.linear`, equal depth)
semantic-router (vllm-project/semantic-router, src/training/kv_mapper/):
    artifact.py `write_artifact` / `Manifest.to_dict` / `CompatibilitySpec`, fit.py
    `write_fitted_artifact`, fit_run.py `fit_capture`, collect.py `ActivationRunMeta` -> `sr_mapper`
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np

# kv_lingo_train.py: CAPTURE_CUT, the only `cut` the knlp writer ever stores
KNLP_CUT = "pre-k_norm keys and v_proj values; target k_norm then RoPE"
# kv_lingo_train.py: PINS and DIRECTIONS
KNLP_PINS = {
    "Qwen/Qwen3-4B": "1cfa9a7208912126459214e8b04321603b3df60c",
    "Qwen/Qwen3-8B": "b968826d9c46dd6066d109eabc6255188de91218",
}
KNLP_DIRECTIONS = {
    "4b-to-8b": ("Qwen/Qwen3-4B", "Qwen/Qwen3-8B"),
    "8b-to-4b": ("Qwen/Qwen3-8B", "Qwen/Qwen3-4B"),
}


def knlp_geometry(layers: int, kv_heads: int, head_dim: int) -> dict:
    """kv_lingo_train.py `geometry_dict`: the CacheGeometry fields plus `width`."""
    return {
        "layers": layers,
        "kv_heads": kv_heads,
        "head_dim": head_dim,
        "width": kv_heads * head_dim,
    }


def _linear_translator(key_weight, value_weight):
    """An nn.Module whose state_dict is kv_lingo.py `LinearTranslator`'s: two float32
    Parameters `key_weight`, `value_weight` of shape [layers, target width, source width]."""
    import torch
    from torch import nn

    m = nn.Module()
    m.key_weight = nn.Parameter(torch.as_tensor(np.asarray(key_weight), dtype=torch.float32))
    m.value_weight = nn.Parameter(torch.as_tensor(np.asarray(value_weight), dtype=torch.float32))
    return m


def knlp_translator(
    path, key_weight, value_weight, source_geometry: dict, target_geometry: dict,
    direction: str = "4b-to-8b", source=None, target=None, stage: str = "stage1_closed_form",
    cut: str = KNLP_CUT, provenance: dict | None = None,
) -> Path:  # fmt: skip
    """`torch.save(translator_artifact(...))` (kv_lingo_train.py, via `atomic_torch_save`).

    `source`/`target`: (name, revision); by default the pair `direction` names in DIRECTIONS,
    pinned as in PINS (the writer always writes them that way)."""
    import torch

    names = KNLP_DIRECTIONS.get(direction, ("source/model", "target/model"))
    source = source or (names[0], KNLP_PINS.get(names[0], "main"))
    target = target or (names[1], KNLP_PINS.get(names[1], "main"))
    tr = _linear_translator(key_weight, value_weight)
    artifact = {
        "schema": "kv_lingo_translator_v1",
        "method_identity": "independent KV-Lingo reproduction",
        "direction": direction,
        "source": {"name": source[0], "revision": source[1]},
        "target": {"name": target[0], "revision": target[1]},
        "source_geometry": source_geometry,
        "target_geometry": target_geometry,
        "cut": cut,
        "parameter_dtype": "float32",
        "stage": stage,
        "state_dict": {k: v.detach().cpu() for k, v in tr.state_dict().items()},
        "provenance": provenance
        if provenance is not None
        else {  # run_stage1's provenance keys
            "samples": 8,
            "translated_prefix_positions": 1024,
            "relative_eigen_tolerance": 1e-8,
            "solve": [
                {"layer": layer, "component": c, "rank": 4, "width": 4, "finite": True}
                for layer in range(source_geometry["layers"])
                for c in ("key", "value")
            ],
            "train_rows_sha256": "0" * 64,
            "token_store_sha256": "1" * 64,
        },
    }
    torch.save(artifact, str(path))
    return Path(path)


def knlp_stage2_checkpoint(
    path, key_weight, value_weight, source_geometry: dict, target_geometry: dict,
    direction: str = "4b-to-8b", stage1_artifact: Path | None = None, global_step: int = 3,
) -> Path:  # fmt: skip
    """`torch.save(checkpoint_state(...))` (kv_lingo_train.py): the weights nested under
    `translator`, AdamW state under `optimizer`, RNG state, metrics; no `cut`, no model names."""
    import torch

    tr = _linear_translator(key_weight, value_weight)
    # load_stage2: AdamW(lr=LEARNING_RATE, weight_decay=0.0); a step with lr 0 fills its state
    # (exp_avg, exp_avg_sq, step) without moving the weights
    opt = torch.optim.AdamW(tr.parameters(), lr=0.0, weight_decay=0.0)
    (tr.key_weight.square().sum() + tr.value_weight.square().sum()).backward()
    opt.step()
    batch = 8  # EFFECTIVE_BATCH
    metrics = [
        {
            "step": s,
            "sample_cursor": s * batch,
            "mean_kl": 0.5 / s,
            "sample_kls": [0.5 / s] * batch,
            "sample_seconds": [0.1] * batch,
            "learning_rate": 3e-5 * s / 250,
            "gradient_norm_before_clip": 1.0,
            "prefix_tokens": [64] * batch,
            "continuation_tokens": [16] * batch,
            "world_size": 1,
            "rank_assignment": [list(range(batch))],
            "rank_compute_seconds": [0.8],
            "rank_reduction_seconds": [0.0],
            "global_step_seconds": 0.9,
        }
        for s in range(1, global_step + 1)
    ]
    stage1 = Path(stage1_artifact) if stage1_artifact else Path(f"stage1-{direction}.pt")
    state = {
        "schema": "kv_lingo_stage2_checkpoint_v1",
        "direction": direction,
        "global_step": global_step,
        "sample_cursor": global_step * batch,
        "total_schedule_steps": 5_000,
        "warmup_steps": 250,
        "effective_batch": batch,
        "learning_rate": 3e-5,
        "source_geometry": source_geometry,
        "target_geometry": target_geometry,
        "translator": {k: v.detach().cpu() for k, v in tr.state_dict().items()},
        "optimizer": opt.state_dict(),
        # rng_state(): torch.get_rng_state() and torch.cuda.get_rng_state_all() (no GPU here)
        "rng": {"cpu": torch.get_rng_state(), "cuda": []},
        "stage1_artifact": {
            "path": str(stage1),
            "sha256": hashlib.sha256(stage1.read_bytes()).hexdigest()
            if stage1.is_file()
            else "0" * 64,
        },
        "metrics": metrics,
    }
    torch.save(state, str(path))
    return Path(path)


# -- semantic-router ----------------------------------------------------------------------


def sr_tensors(key_maps, value_maps, key_bias=None, value_bias=None) -> dict[str, np.ndarray]:
    """fit.py `fit_full_head` / distill.py `LinearMapper.export`: `target.{t}.{k,v}.{W,b}`,
    float32, W [nu*H*D, H*D] applied as `x @ W + b`; every layer has both W and b."""
    out = {}
    for t in range(len(key_maps)):
        for ch, maps, bias in (("k", key_maps, key_bias), ("v", value_maps, value_bias)):
            w = np.asarray(maps[t], np.float32)
            out[f"target.{t}.{ch}.W"] = w
            b = np.zeros(w.shape[1], np.float32) if bias is None else bias[t]
            out[f"target.{t}.{ch}.b"] = np.asarray(b, np.float32)
    return out


def sr_mapper(
    folder, tensors: dict, layers_per_target: list[list[int]], num_kv_heads: int, head_dim: int,
    source_model: str = "Qwen/Qwen3-14B", target_model: str = "Qwen/Qwen3-32B",
    source_revision: str = "a" * 40, target_revision: str = "b" * 40, precision: str = "bf16",
    ridge_alpha: float = 0.01, variant: str = "full_head", **manifest_changes,
) -> Path:  # fmt: skip
    """artifact.py `write_artifact` of the Manifest fit.py `write_fitted_artifact` builds."""
    from safetensors.numpy import save_file

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    mapping = {str(t): list(r) for t, r in enumerate(layers_per_target)}
    src_rev, tgt_rev = source_revision[-12:], target_revision[-12:]  # mapper_id._revision_token
    manifest = {  # Manifest.to_dict(): asdict, with `compatibility` nested
        "mapper_id": f"pair-{variant}-{precision}-tp1-h{num_kv_heads}-s{src_rev}-t{tgt_rev}-b1",
        "compatibility": {  # CompatibilitySpec
            "source_model": source_model,
            "source_revision": source_revision,
            "target_model": target_model,
            "target_revision": target_revision,
            "variant": variant,
            "precision": precision,
            "source_tp": 1,
            "target_tp": 1,
            "head_order": "contiguous",
            "num_kv_heads": num_kv_heads,
            "head_dim": head_dim,
        },
        "topk": max(len(r) for r in layers_per_target),
        "ridge_alpha": ridge_alpha,
        "centered_inputs": True,
        "rope_stripped_on_keys": True,
        "source_layers_per_target": {"k": mapping, "v": mapping},  # fit_run: one shared list
        "calibration": {  # collect.py ActivationRunMeta.to_dict()
            "corpus": "synthetic",
            "dataset_config": "default",
            "dataset_revision": "c" * 40,
            "source_model": source_model,
            "source_revision": source_revision,
            "target_model": target_model,
            "target_revision": target_revision,
            "seed": 0,
            "seq_len": 64,
            "window_stride": 64,
            "fitting_token_step": 4,
            "token_sha256": "d" * 64,
            "num_sequences": 4,
            "source_layers": sorted({s for r in layers_per_target for s in r}),
            "target_layers": list(range(len(layers_per_target))),
            "num_kv_heads": num_kv_heads,
            "head_dim": head_dim,
            "precision": precision,
            "rope_stripped_on_keys": True,
            "document_window_policy": "within_document",
        },
        "evaluation_report": None,
        "schema_version": 1,
    }
    for key, value in manifest_changes.items():  # "a__b" reaches into nested objects
        *path, last = key.split("__")
        d = manifest
        for p in path:
            d = d[p]
        d[last] = value
    save_file(tensors, str(folder / "weights.safetensors"))
    (folder / "manifest.json").write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n")
    sr_checksums(folder)
    return folder


def sr_checksums(folder) -> None:
    """artifact.py `_write_checksums`: `<sha256>  <name>` for manifest.json then weights."""
    folder = Path(folder)
    lines = [
        f"{hashlib.sha256((folder / n).read_bytes()).hexdigest()}  {n}"
        for n in ("manifest.json", "weights.safetensors")
        if (folder / n).is_file()
    ]
    (folder / "SHA256SUMS").write_text("\n".join(lines) + "\n")
