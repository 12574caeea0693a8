"""Add a translator file to weights/translators and weights/manifest.json with its held-out
figures (the JSON of `kvlingo eval --json`, per domain), and optionally make it the default.

    python weights/add_translator.py weights/stage2-runs/forward-mixing-nu2-longer.safetensors \
        --eval dialogues=d.json --eval prose=p.json --eval technical=t.json --default
"""

from __future__ import annotations

import argparse
import hashlib
import json
import shutil
from pathlib import Path

import mlx_kvlingo  # noqa: F401  (OpenBLAS before mlx)
from mlx_kvlingo.format import read_metadata

from manifest import merge_rows

HERE = Path(__file__).resolve().parent


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("file", type=Path)
    ap.add_argument("--eval", action="append", default=[], help="DOMAIN=kvlingo-eval.json")
    ap.add_argument("--default", action="store_true")
    ap.add_argument("--note", default="")
    ap.add_argument("--training-data", default=None, help="what stage 2 trained on, in words")
    ap.add_argument("--pair", choices=("dense", "moe"), default="dense")
    args = ap.parse_args()
    meta = read_metadata(args.file)
    sub = "moe/" if args.pair == "moe" else ""
    dest = HERE / "translators" / sub / args.file.name
    shutil.copyfile(args.file, dest)
    evals = {}
    for item in args.eval:
        domain, path = item.split("=", 1)
        evals[domain] = json.loads(Path(path).read_text())
    cal = meta["calibration"]
    direction = "forward" if meta["target"]["layers"] > meta["source"]["layers"] else "backward"
    nu = len(meta["key_layers"][0])
    row = {
        "file": sub + dest.name, "direction": direction, "variant": meta["variant"], "nu": nu,
        "key_cut": meta["key_cut"], "source": Path(meta["source"]["name"]).name,
        "target": Path(meta["target"]["name"]).name,
        "training_data": {"stage1": cal.get("data"), "stage2": args.training_data}
        if args.training_data else cal.get("data"),
        "stage2_steps": cal.get("stage2", {}).get("steps", 0),
        "continued_from": cal.get("stage2", {}).get("continued_from"),
        "composed": cal.get("composed"),
        "note": args.note,
        "heldout": {"stage1": None, "stage2": evals.get("dialogues")},
        "heldout_by_domain": evals, "sha256": hashlib.sha256(dest.read_bytes()).hexdigest(),
        "bytes": dest.stat().st_size,
    }  # fmt: skip
    section = "moe" if args.pair == "moe" else None
    merge_rows(HERE / "manifest.json", [row], section=section,
               default={direction: row["file"]} if args.default else None)  # fmt: skip
    print(json.dumps({k: row[k] for k in ("file", "direction", "sha256")}, indent=1))


if __name__ == "__main__":
    main()
