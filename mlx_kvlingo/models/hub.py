"""Translators on the Hugging Face Hub: `org/name[@revision][:file]` -> a local file.

    org/name                    the repo's default translator (manifest.json `default`, else its
                                only .safetensors file)
    org/name@v1.0               the same at a branch, tag or commit (pinned)
    org/name:forward.safetensors, org/name@abc123:sub/dir/file.safetensors   one file

An existing local path always wins over a Hub id. Files come through `huggingface_hub` into its
cache (`HF_HUB_OFFLINE=1`: the cache only). An upload folder holds the translator file(s), their
`manifest.json` and a model card generated from their `kvlingo` metadata only (pair, provenance,
variant, calibration, held-out table): a card cannot claim more than the files record.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass
from pathlib import Path

__all__ = ["HubError", "HubSpec", "parse_spec", "resolve_translator", "download", "upload"]

SPEC = re.compile(r"^(?P<repo>[\w.-]+/[\w.-]+)(?:@(?P<rev>[^:@\s]+))?(?::(?P<file>\S+))?$")
ALLOW = ["*.safetensors", "manifest.json", "README.md"]


class HubError(ValueError):
    """A translator that cannot be fetched from the Hub (offline, missing, not a translator)."""


@dataclass(frozen=True)
class HubSpec:
    repo_id: str
    revision: str | None = None
    filename: str | None = None

    def __str__(self) -> str:
        rev = f"@{self.revision}" if self.revision else ""
        return f"{self.repo_id}{rev}" + (f":{self.filename}" if self.filename else "")


def parse_spec(text: str) -> HubSpec | None:
    """`org/name[@revision][:file]` -> HubSpec, or None when `text` is not a Hub id."""
    m = SPEC.match(str(text).strip())
    if m is None or str(text).startswith((".", "/", "~")):
        return None
    return HubSpec(m["repo"], m["rev"], m["file"])


def explain(e: Exception, named: str, fetch: str = "give a local folder") -> str | None:
    """One line for a failed Hub lookup of `named` (None: not a Hub error); `fetch` says what
    to do when it is not in the cache while offline."""
    from huggingface_hub import constants, errors

    if isinstance(e, errors.LocalEntryNotFoundError | errors.OfflineModeIsEnabled):
        if constants.HF_HUB_OFFLINE:
            return (f"{named}: not in the Hub cache ({constants.HF_HUB_CACHE}) and "
                    f"HF_HUB_OFFLINE=1 is set: {fetch}")  # fmt: skip
        return (f"{named}: not in the Hub cache and {constants.ENDPOINT} cannot be reached: "
                f"check the connection, or {fetch}")  # fmt: skip
    if isinstance(e, errors.RevisionNotFoundError):
        return f"{named}: no such revision on the Hub"
    if isinstance(e, errors.RepositoryNotFoundError):  # GatedRepoError too
        return (f"{named}: no such repository on {constants.ENDPOINT} (or it is private or "
                "gated: log in with `hf auth login`)")  # fmt: skip
    if isinstance(e, errors.EntryNotFoundError):
        return f"{named}: no such file in the repository"
    if isinstance(e, errors.HfHubHTTPError):
        return f"{named}: the Hub answered with an error: {' '.join(str(e).split())[:300]}"
    return None


def download(spec: str | HubSpec, local_dir: str | Path | None = None) -> Path:
    """The repo's translator files (and card, manifest) in the Hub cache or `local_dir`."""
    from huggingface_hub import hf_hub_download, snapshot_download

    spec = spec if isinstance(spec, HubSpec) else _parse(spec)
    try:
        if spec.filename:
            return Path(hf_hub_download(spec.repo_id, spec.filename, revision=spec.revision,
                                        local_dir=local_dir))  # fmt: skip
        return Path(snapshot_download(spec.repo_id, revision=spec.revision, allow_patterns=ALLOW,
                                      local_dir=local_dir))  # fmt: skip
    except Exception as e:  # noqa: BLE001 - huggingface_hub and httpx raise many kinds
        fetch = f"fetch it once online: kvlingo download {spec}"
        raise HubError(explain(e, str(spec), fetch) or f"{spec}: {type(e).__name__}: {e}") from None


def _parse(text: str) -> HubSpec:
    spec = parse_spec(text)
    if spec is None:
        raise HubError(
            f"{text!r} is neither a local file nor a Hub id (org/name[@revision][:file])"
        )
    return spec


def resolve_translator(text: str | Path, reverse: bool = False) -> Path:
    """A local translator path, or the Hub file `text` names (downloaded or from the cache):
    without `:file`, the manifest's default for the direction, else the repo's only file."""
    path = Path(text).expanduser()
    if path.exists():
        return path
    spec = _parse(str(text))
    got = download(spec)
    if spec.filename:
        return got
    manifest = got / "manifest.json"
    if manifest.is_file():
        default = json.loads(manifest.read_text()).get("default") or {}
        default = default.get("backward" if reverse else "forward")
        if default and (got / default).is_file():
            return got / default
    files = sorted(p.name for p in got.glob("*.safetensors"))
    if len(files) == 1:
        return got / files[0]
    if not files:
        raise HubError(f"{spec}: the repository holds no .safetensors translator")
    named = ", ".join(f"{spec}:{f}" for f in files[:6])
    raise HubError(
        f"{spec}: {len(files)} translators and no manifest.json default; name one: {named}"
    )


def build_repo_folder(
    files, folder: str | Path, repo_id: str, manifest: str | Path | None = None,
    license: str | None = None,
) -> Path:  # fmt: skip
    """`folder` with the translator `files` (hard-linked, else copied; each at its path below
    the files' common folder, or below a `translators/` folder beside `manifest`), a manifest.json
    (the given one, whose default must be among the files, or one listing them) and a model card
    generated from their metadata."""
    from mlx_kvlingo._platform.atomic import link_or_copy
    from mlx_kvlingo.models.files import read_metadata

    paths = list(dict.fromkeys(Path(f).resolve() for f in files))
    if not paths:
        raise HubError("no translator files given")
    root = Path(os.path.commonpath([p.parent for p in paths]))
    shipped = Path(manifest).resolve().parent / "translators" if manifest else None
    if shipped is not None and shipped in (root, *root.parents):
        root = shipped  # a demo manifest names its files below its `translators/` folder
    names = {p: p.relative_to(root).as_posix() for p in paths}
    man = json.loads(Path(manifest).read_text()) if manifest else None
    default = (man or {}).get("default") or {}
    missing = sorted({default.get(k) for k in ("forward", "backward")} - {None, *names.values()})
    if missing:
        given = ", ".join(sorted(names.values())[:6])
        raise HubError(f"{manifest}: its default {', '.join(missing)} is not among the files "
                       f"given (paths below {root}: {given})")  # fmt: skip
    folder, metas = Path(folder), {}
    for f, name in names.items():
        try:
            metas[name] = read_metadata(f)
        except ValueError as e:
            raise HubError(f"{f}: not a translator file ({e})") from None
        dest = folder / name
        dest.parent.mkdir(parents=True, exist_ok=True)
        if dest.resolve() != f:
            link_or_copy(f, dest)
    if man is None:
        listed = list(metas)
        man = {"default": {"forward": listed[0]}, "translators": [{"file": n} for n in listed]}
    (folder / "manifest.json").write_text(json.dumps(man, indent=1) + "\n")
    (folder / "README.md").write_text(model_card(repo_id, metas, man, license=license))
    return folder


def upload(folder: str | Path, repo_id: str, private: bool = False,
           message: str | None = None) -> str:  # fmt: skip
    """Create the repo if needed and push `folder` to its main branch with `upload_folder`;
    returns the commit URL (its last path component is the revision to pin)."""
    from huggingface_hub import HfApi

    api = HfApi()
    try:
        api.create_repo(repo_id, private=private, exist_ok=True)
        info = api.upload_folder(repo_id=repo_id, folder_path=str(folder),
                                 commit_message=message or "Upload mlx-kvlingo translator")  # fmt: skip
    except Exception as e:  # noqa: BLE001
        raise HubError(explain(e, repo_id) or f"{repo_id}: {type(e).__name__}: {e}") from None
    return str(info)


def _shown(name: str) -> str:
    """A Hub id as is, a local path by its last component (a card never shows local paths)."""
    if name.startswith(("/", ".", "~")) or name.count("/") > 1:
        return name.rstrip("/").rsplit("/", 1)[-1]
    return name


def _side(meta: dict, label: str) -> str:
    """One side's model: a Hub id (with a "/" still) as is, a local folder by its last component."""
    prov = meta.get("provenance") or {}
    return _shown(str(prov.get(f"{label}_model") or (meta.get(label) or {}).get("name") or "?"))


def _geometry(d: dict) -> str:
    return f"{d.get('layers')}x{d.get('kv_heads')}x{d.get('head_dim')}"


def _fmt(v) -> str:
    return f"{v:.3f}" if isinstance(v, float) else ("" if v is None else str(v))


def model_card(repo_id: str, metas: dict[str, dict], manifest: dict | None = None,
               license: str | None = None) -> str:  # fmt: skip
    """README.md for a repo holding the translator files `metas` ({file name: metadata})."""
    files = list(metas)
    default = ((manifest or {}).get("default") or {}).get("forward") or files[0]
    first = metas.get(default, metas[files[0]])
    src, tgt = _side(first, "source"), _side(first, "target")
    cal, prov = first.get("calibration") or {}, first.get("provenance") or {}
    bases = sorted({n for m in metas.values() for n in (_side(m, "source"), _side(m, "target"))})
    bases = [n for n in bases if "/" in n]
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
        s, t = _side(m, "source"), _side(m, "target")
        nu = f"{len(m['key_layers'][0])}/{len(m['value_layers'][0])}"
        star = " (default)" if f == default else ""
        out.append(
            f"| `{f}`{star} | {s} → {t} | {_geometry(m['source'])} → {_geometry(m['target'])} "
            f"| {m['variant']} | {nu} | {m['key_cut']} | {m.get('dtype')} |"
        )
    src_rev, tgt_rev = prov.get("source_revision"), prov.get("target_revision")
    out += ["", "## Pair", "", f"- source: `{src}`" + (f" at `{src_rev}`" if src_rev else "")]
    out.append(f"- target: `{tgt}`" + (f" at `{tgt_rev}`" if tgt_rev else ""))
    out.append(f"- tokenizer fingerprint: `{first.get('tokenizer')}`")
    out.append("- key cut `post_norm`: keys after k_norm, before RoPE; `pre_norm`: `k_proj` "
               "outputs, the target's k_norm applied after the map. Values are `v_proj` outputs.")  # fmt: skip
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
        for stage in ("stage2", "stage1"):  # the last stage's held-out table
            table = ((m.get("calibration") or {}).get(stage) or {}).get("heldout")
            if isinstance(table, dict) and "translated" in table:
                break
        else:
            continue
        n = f"{table.get('examples')} / {table.get('tokens')}"
        # the native and source-alone rows once per direction and held-out set
        key = (_side(m, "source"), _side(m, "target"), n)
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
    s_arg, t_arg = (src if "/" in src else "SOURCE"), (tgt if "/" in tgt else "TARGET")
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
