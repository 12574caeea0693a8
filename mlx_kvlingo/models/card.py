"""A Hub model card for translator files, generated from their `kvlingo` metadata only (pair,
provenance, variant, calibration, held-out table): a card cannot claim more than the files record.
"""

from __future__ import annotations

import json


def _hub_id(name: str) -> str | None:
    """A name as `_shown` gives it, when it is a Hub id (org/name); else None."""
    return name if "/" in name else None


def _shown(name: str) -> str:
    """A Hub id as is, a local path by its last component (a card never shows local paths)."""
    if name.startswith(("/", ".", "~")) or name.count("/") > 1:
        return name.rstrip("/").rsplit("/", 1)[-1]
    return name


def _side(meta: dict, label: str) -> tuple[str, str | None]:
    """(name, revision) of one side: a Hub id as is, a local folder by its last component."""
    prov = meta.get("provenance") or {}
    name = str(prov.get(f"{label}_model") or (meta.get(label) or {}).get("name") or "?")
    return _shown(name), prov.get(f"{label}_revision")


def _geometry(d: dict) -> str:
    return f"{d.get('layers')}x{d.get('kv_heads')}x{d.get('head_dim')}"


def _heldout(meta: dict) -> tuple[str, dict] | None:
    cal = meta.get("calibration") or {}
    for stage in ("stage2", "stage1"):
        h = (cal.get(stage) or {}).get("heldout")
        if isinstance(h, dict) and "translated" in h:
            return stage, h
    return None


def _fmt(v) -> str:
    return f"{v:.3f}" if isinstance(v, float) else ("" if v is None else str(v))


def model_card(repo_id: str, metas: dict[str, dict], manifest: dict | None = None,
               license: str | None = None) -> str:  # fmt: skip
    """README.md for a repo holding the translator files `metas` ({file name: metadata})."""
    files = list(metas)
    default = ((manifest or {}).get("default") or {}).get("forward") or files[0]
    first = metas.get(default, metas[files[0]])
    src, src_rev = _side(first, "source")
    tgt, tgt_rev = _side(first, "target")
    bases = sorted({b for m in metas.values() for b in map(_hub_id, (_side(m, "source")[0],
                    _side(m, "target")[0])) if b})  # fmt: skip
    front = ["---", "library_name: mlx-kvlingo", "tags:", "- mlx", "- kv-cache", "- kv-lingo"]
    if license:
        front.append(f"license: {license}")
    if bases:
        front += ["base_model:"] + [f"- {b}" for b in bases]
    front.append("---")
    out = front + ["", f"# {repo_id}", "",
                   "KV-cache translators for mlx-kvlingo (MLX, mlx-lm): per target layer, a "
                   "linear map turns the source model's K/V into the target model's cache layout, "
                   "so the target decodes from the translated cache without prefilling the prompt "
                   "itself.", "", "## Files", "",
                   "| file | source → target | geometry (layers×kv heads×head dim) | variant | "
                   "nu (K/V) | key cut | dtype |", "|---|---|---|---|---|---|---|"]  # fmt: skip
    for f, m in metas.items():
        s, t = _side(m, "source")[0], _side(m, "target")[0]
        nu = f"{len(m['key_layers'][0])}/{len(m['value_layers'][0])}"
        star = " (default)" if f == default else ""
        out.append(
            f"| `{f}`{star} | {s} → {t} | {_geometry(m['source'])} → {_geometry(m['target'])} "
            f"| {m['variant']} | {nu} | {m['key_cut']} | {m.get('dtype')} |"
        )
    out += ["", "## Pair", "", f"- source: `{src}`" + (f" at `{src_rev}`" if src_rev else "")]
    out.append(f"- target: `{tgt}`" + (f" at `{tgt_rev}`" if tgt_rev else ""))
    out.append(f"- tokenizer fingerprint: `{first.get('tokenizer')}`")
    out.append("- key cut `post_norm`: keys after k_norm, before RoPE; `pre_norm`: `k_proj` "
               "outputs, the target's k_norm applied after the map. Values are `v_proj` outputs.")  # fmt: skip
    cal = first.get("calibration") or {}
    prov = first.get("provenance") or {}
    if cal:
        which = f" of `{default}`" if len(files) > 1 else ""
        out += ["", f"## Calibration{which}", ""]
        data = cal.get("data")
        if isinstance(data, str):
            data = _shown(data)
        if data:
            out.append(f"- data: {json.dumps(data)}")
        s1, s2 = cal.get("stage1") or {}, cal.get("stage2") or {}
        if s1:
            out.append(f"- stage 1 (closed-form ridge): {s1.get('examples')} examples, "
                       f"{s1.get('tokens')} tokens, alpha {s1.get('alpha')}")  # fmt: skip
        if s2:
            out.append(f"- stage 2 (KL self-distillation): {s2.get('steps')} steps, held-out KL "
                       f"{_fmt(s2.get('heldout_kl'))}")  # fmt: skip
    if prov:
        out += ["", "## Provenance", "", f"- converted from `{prov.get('layout')}` "
                f"(`{prov.get('input')}`, sha256 `{str(prov.get('input_sha256'))[:16]}…`)"]  # fmt: skip
        if prov.get("key_cut_override"):
            out.append(
                f"- key cut stated at conversion (original cut: {prov.get('original_cut')!r})"
            )
    rows, seen = [], set()
    for f, m in metas.items():
        h = _heldout(m)
        if h is None:
            continue
        stage, table = h
        n = f"{table.get('examples')} / {table.get('tokens')}"
        # the native and source-alone rows once per direction and held-out set
        key = (_side(m, "source")[0], _side(m, "target")[0], n)
        for arm in ("native", "translated", "source", "raw"):
            r = table.get(arm) or {}
            if "skipped" in r or not r or (arm != "translated" and (key, arm) in seen):
                continue
            seen.add((key, arm))
            cells = (
                r.get(k) for k in ("nll", "top1", "agree_native", "kl_native", "gap_recovered")
            )
            rows.append(f"| `{f}` | {stage} | {n} | {arm} | " + " | ".join(map(_fmt, cells)) + " |")
    if rows:
        out += ["", "## Held-out quality", "",
                "Teacher-forced on each file's held-out data (examples / tokens): NLL, top-1 "
                "accuracy, agreement with the native target, KL(native ‖ arm), fraction of the "
                "source-to-native NLL gap recovered. Rows on different held-out sets do not compare.",
                "", "| file | stage | held-out | arm | NLL | top-1 | agree | KL | gap recovered |",
                "|---|---|---|---|---|---|---|---|---|", *rows]  # fmt: skip
    s_arg, t_arg = _hub_id(src) or "SOURCE", _hub_id(tgt) or "TARGET"
    return (
        "\n".join(out)
        + f"""

## Usage

```bash
kvlingo chat --small {s_arg} --large {t_arg} --translator {repo_id}:{default}
kvlingo download {repo_id}          # into the Hub cache, for offline use
```

```python
from mlx_kvlingo import generate, load

pair = load("{s_arg}", "{t_arg}", translator="{repo_id}")
print(generate(pair, "Hello!"))
```

Pin a revision with `{repo_id}@<commit>`; `HF_HUB_OFFLINE=1` reads the cache only.
"""
    )
