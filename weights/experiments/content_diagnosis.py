"""Where is the content lost? Three measurements on the content tasks (`content.py`).

swaps      the translated cache with some target layers' K/V replaced by native ones:
           which layers, made native, restore the stated facts and copies
positions  the translation's relative error ||T - N|| / ||N|| per target layer, keys and
           values, at the tokens of the stated answer against every other read token
small      the source model alone on the same tasks (in every content run)

  python -m weights.experiments.content_diagnosis --per-kind 6 --json diag.json
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass
from pathlib import Path

from mlx_kvlingo.data.content_tasks import ContentTask, build_tasks
from mlx_kvlingo.eval.content import (
    evaluate_content,
    native_kv,
    tables,
    to_json,
    translated_kv,
)

import mlx.core as mx
import numpy as np
from rich.console import Console


@dataclass(frozen=True)
class Swap:
    """A content condition (`content.evaluate_content`): `method`'s translated cache with these
    target layers' K/V replaced by the native ones."""

    label: str
    method: object
    native_layers: frozenset[int]

    def __call__(self, pair, task, native):
        key = (id(self.method), task.tokens)
        if key not in _TRANSLATED:  # one translation per task for all its swaps
            _TRANSLATED.clear()
            _TRANSLATED[key] = translated_kv(pair, self.method, task.tokens[:-1])
        k, v = _TRANSLATED[key]
        layers = range(len(k))
        return ([native[0][i] if i in self.native_layers else k[i] for i in layers],
                [native[1][i] if i in self.native_layers else v[i] for i in layers])  # fmt: skip


_TRANSLATED: dict = {}


def layer_swaps(layers: int, step: int, method) -> list[Swap]:
    """Native first k layers, native last k layers, and native bands of `step` layers."""
    out = []
    for k in range(step, layers, step):
        out.append(Swap(f"native 0-{k - 1}", method, frozenset(range(k))))
        out.append(Swap(f"native {k}-{layers - 1}", method, frozenset(range(k, layers))))
    for a in range(0, layers, step):
        out.append(Swap(f"band {a}-{min(a + step, layers) - 1}", method,
                        frozenset(range(a, min(a + step, layers)))))  # fmt: skip
    seen, unique = set(), []
    for s in out:  # a band may equal a first-k or last-k set
        if s.native_layers not in seen:
            seen.add(s.native_layers)
            unique.append(s)
    return unique


def answer_positions(tokenizer, task: ContentTask) -> list[int]:
    """Token positions of the stated answer in the prompt (by per-token decoded offsets)."""
    toks = list(task.tokens)
    pieces = [tokenizer.decode([t]) for t in toks]
    text = "".join(pieces)
    at = text.find(task.answer)
    if not task.answer or at < 0:
        return []
    ends = np.cumsum([len(p) for p in pieces])
    first = int(np.searchsorted(ends, at, side="right"))
    last = int(np.searchsorted(ends, at + len(task.answer) - 1, side="right"))
    return list(range(first, min(last + 1, len(toks) - 1)))


def position_errors(pair, method, tasks) -> dict:
    """Per target layer, mean relative error of translated K and V at answer vs other tokens."""
    sums = {}
    for task in tasks:
        pos = answer_positions(pair.tokenizer, task)
        if not pos:
            continue
        toks = list(task.tokens)[:-1]
        nk, nv = native_kv(pair.target, toks)
        tk, tv = translated_kv(pair, method, toks)
        mask = np.zeros(len(toks), bool)
        mask[pos] = True
        mask[0] = False  # the anchor token is native by construction
        for kind, nat, tra in (("key", nk, tk), ("value", nv, tv)):
            for layer, (n, t) in enumerate(zip(nat, tra)):
                n = np.array(n[0].astype(mx.float32))  # (H, T, D)
                t = np.array(t[0].astype(mx.float32))
                err = np.linalg.norm(t - n, axis=(0, 2)) / (np.linalg.norm(n, axis=(0, 2)) + 1e-9)
                for where, m in (("answer", mask), ("other", ~mask)):
                    m = m.copy()
                    m[0] = False
                    s = sums.setdefault((kind, layer, where), [0.0, 0])
                    s[0] += float(err[m].sum())
                    s[1] += int(m.sum())
    out: dict = {"key": {}, "value": {}}
    for (kind, layer, where), (total, n) in sums.items():
        out[kind].setdefault(layer, {})[where] = total / max(n, 1)
    return out


def write_prefix_source(target: str | Path, n_layers: int, out: str | Path) -> Path:
    """An mlx-lm folder holding the target's first `n_layers` layers unchanged (its embedding,
    final norm and tokenizer too): its K/V for those layers equal the target's exactly."""
    import shutil

    target, out = Path(target), Path(out)
    config = json.loads((target / "config.json").read_text())
    if not 0 < n_layers < config["num_hidden_layers"]:
        raise ValueError(f"keep 1 to {config['num_hidden_layers'] - 1} layers, not {n_layers}")
    out.mkdir(parents=True, exist_ok=True)
    weights = {}
    for f in sorted(target.glob("*.safetensors")):
        for k, v in mx.load(str(f)).items():
            if not k.startswith("model.layers.") or int(k.split(".")[2]) < n_layers:
                weights[k] = v
    mx.save_safetensors(str(out / "model.safetensors"), weights)
    config["num_hidden_layers"] = n_layers
    (out / "config.json").write_text(json.dumps(config, indent=1))
    for f in target.iterdir():
        if f.name.startswith(("tokenizer", "special_tokens", "generation_config")):
            shutil.copy2(f, out / f.name)
    return out


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--translator", default=None, help="file or demo name (default: demo default)")
    ap.add_argument("--source", help="source model folder (with --target; default: the demo pair)")
    ap.add_argument("--target")
    ap.add_argument(
        "--write-prefix-source",
        nargs=2,
        metavar=("N", "DIR"),
        help="write the target's first N layers as a source model to DIR, and stop",
    )
    ap.add_argument("--errors-only", action="store_true",
                    help="only the translation error at the answer's tokens (no decoding)")  # fmt: skip
    ap.add_argument("--lengths", default="128,512")
    ap.add_argument("--per-kind", type=int, default=6)
    ap.add_argument("--step", type=int, default=5, help="layers per swapped band")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", dest="json_out")
    args = ap.parse_args(argv)

    from mlx_kvlingo.data.examples import read_texts
    from mlx_kvlingo.models.demo.pair import demo_content_texts, load_demo
    from mlx_kvlingo.models.files import load_translator
    from mlx_kvlingo.models.pair import load_pair

    console = Console()
    if args.write_prefix_source:
        from mlx_kvlingo.models.demo.pair import demo_models

        n, out = args.write_prefix_source
        path = write_prefix_source(args.target or demo_models()[1], int(n), out)
        console.print(f"wrote {path}")
        return
    if args.source and args.target and args.translator:
        pair = load_pair(args.source, args.target)
        tr = load_translator(args.translator, pair)
    else:
        pair, tr = load_demo(args.translator)
    texts = [t for p in demo_content_texts() for t in read_texts(p)]
    lengths = [int(x) for x in args.lengths.split(",")]
    tasks = build_tasks(pair.tokenizer, texts, lengths, args.per_kind, ("fact", "copy"), args.seed)
    if args.errors_only:
        result = {"pair": {"source": pair.source.name, "target": pair.target.name}}
    else:
        swaps = layer_swaps(pair.target.geometry.layers, args.step, tr)
        res = evaluate_content(pair, tasks, {"translated": tr, **{s.label: s for s in swaps}})
        result = to_json(res, pair, {"diagnosis": "swaps"})
        for t in tables(result):
            console.print(t)
    result["position_errors"] = position_errors(pair, tr, [t for t in tasks if t.kind == "fact"])
    for kind in ("key", "value"):
        rows = result["position_errors"][kind]
        line = " ".join(f"{layer}:{r.get('answer', 0):.2f}/{r.get('other', 0):.2f}"
                        for layer, r in sorted(rows.items()))  # fmt: skip
        console.print(f"{kind} rel. error answer/other per layer: {line}")
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
