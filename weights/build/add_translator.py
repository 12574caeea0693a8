"""Add a translator file to weights/translators and weights/manifest.json with its held-out
figures (the JSON of `kvlingo eval --json`, per domain), and optionally make it the default.
The copy in translators/ stores its tensors in float16, or with `--bits 8` its maps quantized
(`copy_stored`): half or a quarter of the float32 bytes; loading computes in float32 on a CPU. The
held-out figures are those of that copy.

    python -m weights.build.add_translator weights/stage2-runs/forward-mixing-nu2-longer.safetensors \
        --eval dialogues=d.json --eval prose=p.json --eval technical=t.json --default

`--evaluate DOMAIN=DATA:N` runs `kvlingo eval --translator FILE --data DATA -n N --json ...` on
the copied file (an empty DATA: the demo's held-out dialogues; `--pair` is passed on) instead of
reading a JSON made before: the `register_*` steps of `python -m weights.build.rebuild`.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import mlx_kvlingo  # noqa: F401  (OpenBLAS before mlx)
from mlx_kvlingo._platform.atomic import atomic_write
from mlx_kvlingo.models.demo.pair import demo_data, demo_models, source_for
from mlx_kvlingo.models.demo.smollm2 import DEMO_SOURCES
from mlx_kvlingo.models.files import (
    load_translator,
    quantize,
    read_metadata,
    translator_tensors,
)

import mlx.core as mx

from .manifest import merge_rows

WEIGHTS = Path(__file__).resolve().parents[1]


def copy_stored(src: Path, dest: Path, bits: int | None = None) -> Path:
    """Write the translator file `src` to `dest` (may be `src` itself) with its tensors in
    float16 (with `bits`, its maps then quantized as `save_translator(bits=)` does) and the
    metadata saying so; the rest of the metadata as it was."""
    meta = read_metadata(src)
    tensors = translator_tensors(load_translator(src, dtype=mx.float16))
    meta["dtype"] = "float16"
    meta.pop("quantization", None)
    if bits:
        tensors, meta["quantization"] = quantize(tensors, bits)
    with atomic_write(dest) as tmp:
        mx.save_safetensors(str(tmp), tensors, metadata={"kvlingo": json.dumps(meta)})
    return dest


def kvlingo_eval(translator: Path, data: str, examples: int, pair: str,
                 backward: bool = False) -> dict:  # fmt: skip
    """`kvlingo eval --json` on one held-out set, in a child process (its own memory).

    A backward file is scored on the demo pair's folders swapped (large -> small)."""
    if backward:
        small, large = demo_models(pair, source_for(str(translator), pair, reverse=True))
        models = ["--source", str(large), "--target", str(small)]
        data = data or str(demo_data()[1])
    else:
        models = ["--pair", pair]
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "eval.json"
        cmd = [sys.executable, "-c", "from mlx_kvlingo.cli import main; main()", "eval",
               *models, "--translator", str(translator), "-n", str(examples),
               "--json", str(out)] + (["--data", data] if data else [])  # fmt: skip
        subprocess.run(cmd, check=True)
        return json.loads(out.read_text())


def parse_evaluate(item: str) -> tuple[str, str, int]:
    """ "DOMAIN=DATA:N" -> (domain, data, n); DATA may be empty (the demo's held-out dialogues)."""
    domain, sep, rest = item.partition("=")
    data, colon, n = rest.rpartition(":")
    if not (sep and colon and domain and n.isdigit()):
        raise ValueError(f"--evaluate {item!r}: expected DOMAIN=DATA:N (DATA may be empty)")
    return domain, data, int(n)


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("file", type=Path)
    ap.add_argument("--eval", action="append", default=[], help="DOMAIN=kvlingo-eval.json")
    ap.add_argument("--evaluate", action="append", default=[],
                    help="DOMAIN=DATA:N: run kvlingo eval on the copied file")  # fmt: skip
    ap.add_argument("--default", action="store_true")
    ap.add_argument("--bits", type=int, choices=(8,), default=None,
                    help="store the maps quantized (default: float16)")  # fmt: skip
    ap.add_argument("--note", default="")
    ap.add_argument("--training-data", default=None, help="what stage 2 trained on, in words")
    ap.add_argument("--demo-source", choices=tuple(DEMO_SOURCES), default="source",
                    help="the demo small model the file reads (weights/<folder>); other than "
                         "'source', the file goes to translators/<folder>/")  # fmt: skip
    ap.add_argument("--default-source", action="store_true",
                    help="with --default: make --demo-source the pair's default small model")  # fmt: skip
    return ap


def main(argv: list[str] | None = None) -> None:
    ap = parser()
    args = ap.parse_args(argv)
    try:
        evaluate = [parse_evaluate(item) for item in args.evaluate]
    except ValueError as e:
        ap.error(str(e))
    meta = read_metadata(args.file)
    sub = "" if args.demo_source == "source" else f"{args.demo_source}/"
    dest = WEIGHTS / "translators" / sub / args.file.name
    dest.parent.mkdir(parents=True, exist_ok=True)
    copy_stored(args.file, dest, args.bits)
    evals = {}
    for item in args.eval:
        domain, path = item.split("=", 1)
        evals[domain] = json.loads(Path(path).read_text())
    direction = "forward" if meta["target"]["layers"] > meta["source"]["layers"] else "backward"
    for domain, data, n in evaluate:
        evals[domain] = kvlingo_eval(dest, data, n, "dense", direction == "backward")
    cal = meta["calibration"]
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
        "note": args.note, "demo_source": args.demo_source,
        "heldout": {"stage1": None, "stage2": evals.get("dialogues")},
        "heldout_by_domain": evals, "sha256": hashlib.sha256(dest.read_bytes()).hexdigest(),
        "bytes": dest.stat().st_size,
    }  # fmt: skip
    merge_rows(WEIGHTS / "manifest.json", [row],
               default={direction: row["file"]} if args.default else None,
               demo_source=args.demo_source, default_source=args.default_source)  # fmt: skip
    print(json.dumps({k: row[k] for k in ("file", "direction", "sha256")}, indent=1))


if __name__ == "__main__":
    main()
