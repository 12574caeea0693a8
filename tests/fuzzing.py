"""Mutation fuzzing of every loader: translator and session files, the three PyTorch
layouts, mapper directories, JSONL and text data, and the chat's command parser.

    input i of loader L under seed S = mutate(Random(f"{S}:{L}:{i}"), L's seed input i mod n)

A seed input is a valid input as our writers (or the public PyTorch writers,
`tests/pytorch_writers.py`) make it; one mutation is applied: bit flips, truncation, byte
insertion or deletion, a field of a safetensors header (or of the JSON inside its metadata)
changed, deleted or retyped, a member of a `torch.save` zip corrupted, a value inside a torch
checkpoint replaced (another shape, dtype, NaN, a string), a JSON field of a manifest, sidecar
or JSONL record changed, a chat command garbled. Every input runs in a worker process under a
time limit, and its outcome is one of

    ok        the loader accepted it (and what it returned works: a translator translates, a
              restored session answers)
    refused   it raised one of the loader's documented error classes (`DOCUMENTED`)
    bug       any other exception: the loader must be fixed to refuse it by name
    hang      no answer within the time limit (the worker is killed and replaced)
    crash     the worker died (a segfault, out of memory)
    wrote     a file appeared outside the output path (inputs, the working directory, the
              temporary and cache directories are watched)

so the bar is: no bug, hang, crash or wrote. Inputs are made in the parent, deterministically,
so any one reproduces alone: `python tests/tools/fuzz_loaders.py --loaders L --seed S --start i
--count 1`. Nothing is ever unpickled: PyTorch files are read with `torch.load(weights_only=True)`
by the converters, and by the mutator here.
"""

from __future__ import annotations

import copy
import io
import json
import math
import multiprocessing as mp
import os
import random
import shutil
import struct
import sys
import tempfile
import time
import traceback
import zipfile
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OUTCOMES = ("ok", "refused", "bug", "hang", "crash", "wrote")
FAILURES = ("bug", "hang", "crash", "wrote")

#: the error classes each loader documents (module path, class name); subclasses count
DOCUMENTED = {
    "translator": [("mlx_kvlingo.models.files", "TranslatorFileError")],
    "session": [("mlx_kvlingo.conversation.stream", "SessionFileError")],
    "knlp-translator": [("converters.common", "ConversionError")],
    "knlp-checkpoint": [("converters.common", "ConversionError")],
    "linear-state-dict": [("converters.common", "ConversionError")],
    "mapper-dir": [("converters.common", "ConversionError")],
    "data-jsonl": [("mlx_kvlingo.data.examples", "DataError")],
    "data-text": [("mlx_kvlingo.data.examples", "DataError")],
    "chat": [],  # ChatApp.handle prints what it refuses and never raises
}
LOADERS = tuple(DOCUMENTED)
WHAT = {
    "translator": "translator file (`load_translator`, with and without the pair)",
    "session": "session file (`Session.load`, then one answer)",
    "knlp-translator": "knlp `kv_lingo_translator_v1` torch file (`kvlingo convert`)",
    "knlp-checkpoint": "knlp stage-2 checkpoint torch file (`kvlingo convert`)",
    "linear-state-dict": "linear `state_dict` torch file + JSON sidecar (`kvlingo convert`)",
    "mapper-dir": "semantic-router mapper directory (`kvlingo convert`)",
    "data-jsonl": "JSONL data (`validate_data`, `load_examples`)",
    "data-text": "text data (`validate_data`, `load_examples`)",
    "chat": "a line typed into `kvlingo chat` (`ChatApp.handle`)",
}


# -- inputs ----------------------------------------------------------------------------------


@dataclass
class Input:
    """Files (name -> bytes) or a chat line, plus which seed it came from and how it was made."""

    loader: str
    index: int
    files: dict[str, bytes] = field(default_factory=dict)
    line: str | None = None
    seed_name: str = ""
    mutation: str = ""
    with_pair: bool = False


# -- the mutator -----------------------------------------------------------------------------

INTS = [0, 1, -1, 2, 3, 7, 255, 256, 65535, 2**31 - 1, 2**31, 2**32, 2**53, 2**63 - 1, -(2**63),
        2**64, 10**30]  # fmt: skip
FLOATS = [0.0, -0.0, 0.5, -1.5, 1e-300, 1e308, math.inf, -math.inf, math.nan]
STRINGS = ["", "x", "0", "-1", "true", "null", "float32", "F16", "I64", "BOOL", "pre_norm",
           "post_norm", "mixing", "headwise", "qwen3", "../../etc/passwd", "/", "\u00e9\u4e2d",
           "\x00", "a" * 5000, "{}", "[]", "nan", "1e999"]  # fmt: skip
TOKENS = [b"\x00", b"\xff", b"\xff\xfe", b"\x80", b"\xc3\x28", b"\xed\xa0\x80", b"{", b"}", b"[",
          b"]", b'"', b",", b":", b"\n", b"\r\n", b"\\", b"NaN", b"Infinity", b"-0", b"1e999",
          b"null", b"PK\x03\x04", b"\x80\x02", b"\x80\x04\x95", b"c__builtin__\neval\n"]  # fmt: skip


DEEP = "\x00deep:"


def dumps(obj) -> str:
    """json.dumps, where a string DEEP + n stands for n nested lists (json.dumps cannot)."""
    text = json.dumps(obj, allow_nan=True)
    marker = json.dumps(DEEP)[:-1]
    while marker in text:
        i = text.index(marker)
        j = text.index('"', i + len(marker))
        n = int(text[i + len(marker) : j])
        text = text[:i] + "[" * n + "]" * n + text[j + 1 :]
    return text


class Mutator:
    """One seeded random mutation of bytes, JSON values, safetensors, torch files, chat lines."""

    def __init__(self, rng: random.Random):
        self.rng = rng

    # bytes ---------------------------------------------------------------------------------

    def raw(self, data: bytes) -> tuple[bytes, str]:
        r, b = self.rng, bytearray(data)
        op = r.choice(["flip", "flip", "set", "truncate", "truncate", "insert", "delete",
                       "duplicate", "zero", "empty", "append"])  # fmt: skip
        n = len(b)
        if op == "empty" or not n:
            return b"", "empty"
        if op == "flip":
            for _ in range(r.choice([1, 1, 2, 4, 8, 32])):
                i = r.randrange(n)
                b[i] ^= 1 << r.randrange(8)
        elif op == "set":
            for _ in range(r.choice([1, 2, 4])):
                b[r.randrange(n)] = r.choice([0, 0xFF, 0x7F, 0x80, 0x20, 0x22, 0x7B])
        elif op == "truncate":
            cut = r.choice([r.randrange(n), r.randrange(min(n, 64)), n - 1, max(0, n - 8), n // 2])
            b = b[:cut]
        elif op == "insert":
            at = r.randrange(n + 1)
            piece = r.choice(TOKENS) if r.random() < 0.5 else r.randbytes(r.choice([1, 4, 64]))
            b[at:at] = piece
        elif op == "delete":
            at = r.randrange(n)
            del b[at : at + r.choice([1, 2, 8, 64, 4096])]
        elif op == "duplicate":
            at = r.randrange(n)
            piece = b[at : at + r.choice([1, 8, 256, 4096])]
            b[at:at] = piece
        elif op == "zero":
            at = r.randrange(n)
            k = r.choice([4, 64, 1024])
            b[at : at + k] = bytes(len(b[at : at + k]))
        elif op == "append":
            b += r.choice(TOKENS) * r.choice([1, 100])
        return bytes(b), f"bytes:{op}"

    # JSON ----------------------------------------------------------------------------------

    def value(self, depth: int = 0):
        r = self.rng
        kind = r.choice(["none", "bool", "int", "int", "float", "str", "str", "list", "dict",
                         "deep"] if depth < 2 else ["int", "str", "none"])  # fmt: skip
        if kind == "none":
            return None
        if kind == "bool":
            return r.random() < 0.5
        if kind == "int":
            return r.choice(INTS) if r.random() < 0.7 else r.randint(-5, 100)
        if kind == "float":
            return r.choice(FLOATS)
        if kind == "str":
            return r.choice(STRINGS)
        if kind == "list":
            return [self.value(depth + 1) for _ in range(r.choice([0, 1, 2, 3]))]
        if kind == "dict":
            return {
                r.choice(STRINGS[:12]): self.value(depth + 1) for _ in range(r.choice([0, 1, 2]))
            }
        return f"{DEEP}{r.choice([50, 2000, 100_000])}"  # deeply nested lists, see dumps()

    def _nodes(self, obj, path=()):
        yield path
        if isinstance(obj, dict):
            for k, v in obj.items():
                yield from self._nodes(v, (*path, k))
        elif isinstance(obj, list):
            for i, v in enumerate(obj[:64]):
                yield from self._nodes(v, (*path, i))

    def json(self, obj, leaf=None) -> tuple[object, str]:
        """One structural change at a random place of a JSON value (`leaf`: value factory)."""
        r = self.rng
        obj = copy.deepcopy(obj)
        nodes = list(self._nodes(obj))
        path = r.choice(nodes[1:] if len(nodes) > 1 else nodes)
        if not path:
            return (leaf or self.value)(), "json:replace-root"
        parent = obj
        for p in path[:-1]:
            parent = parent[p]
        key = path[-1]
        old = parent[key]
        op = r.choice(["delete", "replace", "replace", "retype", "list", "rename", "add"])
        if op == "delete":
            del parent[key]
        elif op == "replace":
            parent[key] = (leaf or self.value)()
        elif op == "retype":
            if isinstance(old, bool) or old is None:
                parent[key] = r.choice([0, "true", 1.5])
            elif isinstance(old, int):
                parent[key] = r.choice([str(old), float(old), old + r.choice([-1, 1]), -old, [old]])
            elif isinstance(old, float):
                parent[key] = r.choice([str(old), int(old) if math.isfinite(old) else 0, math.nan])
            elif isinstance(old, str):
                parent[key] = r.choice([len(old), old.upper(), old[: len(old) // 2], [old], None])
            else:
                parent[key] = r.choice(["x", 3, None])
        elif op == "list":
            if isinstance(old, list) and old:
                parent[key] = r.choice([old[:-1], old + old[-1:], old[::-1], []])
            else:
                parent[key] = [old]
        elif op == "rename" and isinstance(parent, dict):
            parent[str(key) + r.choice(["_", "X", " "])] = parent.pop(key)
        else:
            target = old if isinstance(old, dict) else parent
            if isinstance(target, dict):
                target[r.choice(STRINGS[:12])] = self.value()
            elif isinstance(target, list):
                target.insert(r.randrange(len(target) + 1), self.value())
        return obj, f"json:{op}:{'.'.join(map(str, path))[:60]}"

    def json_bytes(self, data: bytes) -> tuple[bytes, str]:
        try:
            obj = json.loads(data)
        except ValueError:
            return self.raw(data)
        new, how = self.json(obj)
        return dumps(new).encode(), how

    # safetensors ---------------------------------------------------------------------------

    def safetensors(self, data: bytes) -> tuple[bytes, str]:
        r = self.rng
        if r.random() < 0.35 or len(data) < 8:
            return self.raw(data)
        (n,) = struct.unpack("<Q", data[:8])
        try:
            header = json.loads(data[8 : 8 + n])
        except ValueError:
            return self.raw(data)
        body = data[8 + n :]
        op = r.random()
        if op < 0.1:  # a lying length prefix
            k = r.choice([0, 1, n - 1, n + 1, len(data), 2**40, 2**64 - 1])
            return struct.pack("<Q", k % 2**64) + data[8:], "safetensors:length"
        if op < 0.25:  # tensor bytes: NaN, Inf or noise in the data
            b = bytearray(body)
            if b:
                at = r.randrange(0, len(b) - 3) & ~3 if len(b) > 4 else 0
                b[at : at + 4] = r.choice(
                    [b"\x00\x00\xc0\x7f", b"\x00\x00\x80\x7f", r.randbytes(4)]
                )
            return data[: 8 + n] + bytes(b), "safetensors:data"
        meta = header.get("__metadata__") or {}
        inner = [k for k, v in meta.items() if isinstance(v, str) and _is_json(v)]
        if inner and op < 0.7:  # the JSON inside a metadata string (kvlingo, session)
            key = r.choice(inner)
            new, how = self.json(json.loads(meta[key]))
            header["__metadata__"][key] = dumps(new) if r.random() < 0.95 else "{"
            how = f"metadata[{key}]:{how}"
        else:
            header, how = self.json(header)
            how = f"header:{how}"
        try:
            text = dumps(header).encode()
        except (TypeError, ValueError, RecursionError):
            return self.raw(data)
        return struct.pack("<Q", len(text)) + text + body, f"safetensors:{how}"

    # torch files ---------------------------------------------------------------------------

    def torch_zip(self, data: bytes) -> tuple[bytes, str]:
        """Corrupt one member of a `torch.save` zip (or drop or duplicate one), rewrite it."""
        r = self.rng
        try:
            src = zipfile.ZipFile(io.BytesIO(data))
            members = [(i.filename, src.read(i)) for i in src.infolist()]
        except (zipfile.BadZipFile, OSError, ValueError):
            return self.raw(data)
        k = r.randrange(len(members))
        name, body = members[k]
        op = r.choice(["corrupt", "corrupt", "corrupt", "drop", "duplicate", "empty"])
        if op == "corrupt":
            body, how = self.raw(body)
            members[k] = (name, body)
        elif op == "drop":
            del members[k]
            how = ""
        elif op == "duplicate":
            members.append((name, body))
            how = ""
        else:
            members[k] = (name, b"")
            how = ""
        out = io.BytesIO()
        with zipfile.ZipFile(out, "w", zipfile.ZIP_STORED) as z:
            for n, b in members:
                with _quiet():
                    z.writestr(n, b)
        return out.getvalue(), f"zip:{op}:{name.rsplit('/', 1)[-1]}:{how}"

    def torch_object(self, data: bytes) -> tuple[bytes, str]:
        """Load (weights only), change one value (tensors included), save again."""
        import torch

        try:
            obj = torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
        except Exception:  # noqa: BLE001 - not loadable: fall back to bytes
            return self.raw(data)

        def leaf():
            r = self.rng
            if r.random() < 0.5:
                return self.value()
            shape = list(r.choice([(4,), (2, 3), (1, 64, 64), (4, 64, 64), (0, 4), ()]))
            dtype = r.choice([torch.float32, torch.float32, torch.float16, torch.bfloat16,
                              torch.int64, torch.bool, torch.complex64, torch.float64])  # fmt: skip
            t = torch.zeros(shape, dtype=dtype)
            if dtype.is_floating_point and r.random() < 0.5:
                t = t + r.choice([math.nan, math.inf, 1.0])
            return t

        new, how = self.json(obj, leaf)
        buf = io.BytesIO()
        torch.save(new, buf)
        return buf.getvalue(), f"torch:{how}"

    def torch(self, data: bytes) -> tuple[bytes, str]:
        p = self.rng.random()
        if p < 0.3:
            return self.raw(data)
        if p < 0.6:
            return self.torch_zip(data)
        return self.torch_object(data)

    # text ----------------------------------------------------------------------------------

    def jsonl(self, data: bytes) -> tuple[bytes, str]:
        r = self.rng
        lines = data.split(b"\n")
        if r.random() < 0.4:
            return self.raw(data)
        i = r.randrange(len(lines))
        if not lines[i].strip():
            return self.raw(data)
        new, how = self.json_bytes(lines[i])
        lines[i] = new
        return b"\n".join(lines), f"line{i + 1}:{how}"

    def line(self, text: str) -> tuple[str, str]:
        r = self.rng
        if r.random() < 0.5:
            b, how = self.raw(text.encode())
            return b.decode("utf-8", "replace"), how
        words = text.split(" ")
        op = r.choice(["arg", "arg", "drop", "join", "quote", "cmd"])
        if op == "arg":
            words.append(r.choice(CHAT_ARGS))
        elif op == "drop" and len(words) > 1:
            words.pop(r.randrange(len(words)))
        elif op == "join":
            return "".join(words), "line:join"
        elif op == "quote":
            words.insert(r.randrange(len(words) + 1), r.choice(['"', "'", '"unclosed', "\\"]))
        else:
            words[0] = r.choice(CHAT_COMMANDS) + r.choice(["", "x", "/", " "])
        return " ".join(words), f"line:{op}"


def _is_json(text: str) -> bool:
    try:
        return isinstance(json.loads(text), (dict, list))
    except ValueError:
        return False


class _quiet:
    """Silence zipfile's duplicate-name warning."""

    def __enter__(self):
        import warnings

        self._w = warnings.catch_warnings()
        self._w.__enter__()
        warnings.simplefilter("ignore")

    def __exit__(self, *exc):
        self._w.__exit__(*exc)


CHAT_COMMANDS = ["/small", "/large", "/escalate", "/auto", "/reader", "/mode", "/trim", "/save",
                 "/load", "/stats", "/help", "/reset", "/quit", "/exit", "r", "h", "q", "/"]  # fmt: skip
CHAT_ARGS = ["on", "off", "-1.5", "nan", "inf", "-inf", "1e999", "0", "-1", "3", "999999999999",
             "small", "self", "large", "naive", "reprefill", "alternation", "chat.safetensors",
             "chat", "missing.safetensors", "", "''", "x" * 300, "\u00e9", "NaN", "--", "/dev/null",
             "."]  # fmt: skip
CHAT_SEEDS = ["hello there", "/small", "/large", "/escalate", "/auto on", "/auto off", "/auto -2",
              "/reader small", "/reader self", "/reader auto 0", "/reader auto", "/reader tokens 8", "/mode naive",
              "/mode alternation", "/trim 16", "/trim", "/save chat.safetensors", "/load chat.safetensors", "/stats", "/help",
              "/reset", "r", "h", "def parse(argv):", "/mode"]  # fmt: skip


def mutate(loader: str, seeds: list[tuple[str, dict]], seed: int, index: int) -> Input:
    """Input `index` of `loader`: one mutation of seed input `index % len(seeds)`."""
    rng = random.Random(f"{seed}:{loader}:{index}")
    m = Mutator(rng)
    name, seed_files = seeds[index % len(seeds)]
    inp = Input(loader, index, seed_name=name, with_pair=rng.random() < 0.5)
    if loader == "chat":
        inp.line, inp.mutation = m.line(seed_files["line"])
        return inp
    files = dict(seed_files)
    target = rng.choice(sorted(files))
    data = files[target]
    if target.endswith(".safetensors"):
        files[target], how = m.safetensors(data)
    elif target.endswith(".pt"):
        files[target], how = m.torch(data)
    elif target.endswith(".jsonl"):
        files[target], how = m.jsonl(data)
    elif target.endswith(".json"):
        files[target], how = m.json_bytes(data) if rng.random() < 0.7 else m.raw(data)
    else:  # SHA256SUMS, text
        files[target], how = m.raw(data)
    if loader == "mapper-dir" and target != "SHA256SUMS" and rng.random() < 0.6:
        files["SHA256SUMS"] = _checksums(files)  # past the checksum, into the manifest/weights
        how += " (checksums recomputed)"
    inp.files, inp.mutation = files, f"{target}: {how}"
    return inp


def _checksums(files: dict[str, bytes]) -> bytes:
    import hashlib

    lines = [f"{hashlib.sha256(files[n]).hexdigest()}  {n}"
             for n in ("manifest.json", "weights.safetensors") if n in files]  # fmt: skip
    return ("\n".join(lines) + "\n").encode()


# -- fixtures: the seed inputs ---------------------------------------------------------------


def build_fixtures(folder: str | Path) -> Path:
    """The tiny known-answer pair, exact translators and one seed per kind of input."""
    import mlx_kvlingo  # noqa: F401
    from mlx_kvlingo.data import synthetic as syn
    from mlx_kvlingo.models.files import save_translator
    from mlx_kvlingo.models.pair import load_pair

    folder = Path(folder)
    if (folder / "done").exists():
        return folder
    sys.path.insert(0, str(ROOT / "tests"))
    from helpers import exact_translator, known_answer_target

    tok = syn.build_tokenizer(folder / "tokenizer")
    src = syn.make_model_folder(folder / "qwen3", "qwen3", tok, seed=0)
    answer = known_answer_target(src, folder / "known", seed=4)
    pair = load_pair(src, folder / "known")
    save_translator(exact_translator(pair, answer), folder / "fwd.safetensors", pair)
    back = pair.reversed()
    inv = {"key_maps": [k.T for k in answer["key_maps"]],
           "value_maps": [v.T for v in answer["value_maps"]]}  # fmt: skip
    save_translator(exact_translator(back, inv), folder / "bwd.safetensors", back)
    import numpy as np

    np.savez(folder / "answer.npz", **{f"k{i}": k for i, k in enumerate(answer["key_maps"])},
             **{f"v{i}": v for i, v in enumerate(answer["value_maps"])})  # fmt: skip
    seeds = folder / "seeds"
    seeds.mkdir(exist_ok=True)
    _seed_files(folder, seeds, pair, exact_translator(pair, answer))
    (folder / "done").write_text("ok")
    return folder


def _seed_files(folder: Path, seeds: Path, pair, exact) -> None:
    from mlx_kvlingo.config import ReaderPolicy
    from mlx_kvlingo.conversation.session import Session
    from mlx_kvlingo.kv.translator import Side, Translator, TranslatorConfig
    from mlx_kvlingo.models.files import load_translator, save_translator

    import mlx.core as mx
    import numpy as np
    import pytorch_writers as pw

    # translator files: the exact pair both ways, float16, a random headwise nu=2 with bias
    d = seeds / "translator"
    d.mkdir(parents=True, exist_ok=True)
    shutil.copy(folder / "fwd.safetensors", d / "fwd.safetensors")
    shutil.copy(folder / "bwd.safetensors", d / "bwd.safetensors")
    save_translator(exact, d / "f16.safetensors", pair, dtype=mx.float16)
    g = Side.of(pair.source.geometry)
    rows = tuple((t, max(t - 1, 0)) for t in range(g.layers))
    cfg = TranslatorConfig("headwise", g, g, rows, rows, bias=True, native_first=True)
    tr = Translator(cfg)
    mx.random.seed(0)
    tr.key = {k: mx.random.normal(v.shape) * 0.1 for k, v in tr.key.items()}
    tr.value = {k: mx.random.normal(v.shape) * 0.1 for k, v in tr.value.items()}
    save_translator(tr, d / "headwise.safetensors", pair, calibration={"note": "random"})

    # session files: empty, after a small answer, after a translated large answer
    d = seeds / "session"
    d.mkdir(parents=True, exist_ok=True)
    back = load_translator(folder / "bwd.safetensors", pair.reversed())
    s = Session(
        pair,
        exact,
        back,
        system_prompt="Be brief.",
        policy=ReaderPolicy(large_reads_last=1, recompute_share=0.0),
    )
    s.save(d / "empty.safetensors")
    s.add_user("def parse_args(argv):")
    list(s.generate("source", max_tokens=6))
    s.save(d / "small.safetensors")
    s.add_user("class Foo(object):")
    list(s.generate("target", max_tokens=6))
    s.save(d / "large.safetensors")

    # PyTorch layouts, as the public writers write them, for the tiny pair's geometry
    L, H, D = g.layers, g.kv_heads, g.head_dim
    geo = pw.knlp_geometry(L, H, D)
    rng = np.random.default_rng(0)
    kw = rng.standard_normal((L, H * D, H * D)).astype(np.float32) * 0.05
    vw = rng.standard_normal((L, H * D, H * D)).astype(np.float32) * 0.05
    d = seeds / "knlp-translator"
    d.mkdir(parents=True, exist_ok=True)
    pw.knlp_translator(d / "4b-8b.pt", kw, vw, geo, geo)
    pw.knlp_translator(d / "other.pt", kw, vw, geo, geo, direction="custom",
                       source=("src/model", "main"), target=("tgt/model", "main"))  # fmt: skip
    d = seeds / "knlp-checkpoint"
    d.mkdir(parents=True, exist_ok=True)
    pw.knlp_stage2_checkpoint(d / "stage2.pt", kw, vw, geo, geo)
    d = seeds / "linear-state-dict"
    d.mkdir(parents=True, exist_ok=True)
    import torch

    for name, bias, nu in (("bias", True, 2), ("plain", False, 1)):
        sd = {}
        for kind in ("k", "v"):
            for t in range(L):
                sd[f"{kind}_maps.{t}.weight"] = torch.randn(H * D, nu * H * D) * 0.05
                if bias:
                    sd[f"{kind}_maps.{t}.bias"] = torch.randn(H * D) * 0.05
        torch.save(sd, str(d / f"{name}.pt"))
        side = {"layers": L, "kv_heads": H, "head_dim": D}
        lrows = [[t, max(t - 1, 0)][:nu] for t in range(L)]
        (d / f"{name}.pt.json").write_text(json.dumps(
            {"source": side, "target": side, "key_layers": lrows, "value_layers": lrows,
             "key_cut": "post_norm", "source_model": "qwen3", "target_model": "known"}, indent=2))  # fmt: skip
    d = seeds / "mapper-dir"
    for name, nu in (("nu1", 1), ("nu2", 2)):
        mrows = [[t, max(t - 1, 0)][:nu] for t in range(L)]
        ks = [rng.standard_normal((nu * H * D, H * D)).astype(np.float32) * 0.05 for _ in range(L)]
        vs = [rng.standard_normal((nu * H * D, H * D)).astype(np.float32) * 0.05 for _ in range(L)]
        pw.sr_mapper(d / name, pw.sr_tensors(ks, vs), mrows, H, D)

    # data
    d = seeds / "data-jsonl"
    d.mkdir(parents=True, exist_ok=True)
    from mlx_kvlingo.data import synthetic as syn

    text = syn.training_text()
    paras = [p for p in text.split("\n\n") if len(p) > 200][:12]
    chats = [{"messages": [{"role": "system", "content": "Be brief."},
                           {"role": "user", "content": paras[i][:200]},
                           {"role": "assistant", "content": paras[i + 1][:300]},
                           {"role": "user", "content": "more"},
                           {"role": "assistant", "content": paras[i + 2][:300]}]}
             for i in range(0, 9, 3)]  # fmt: skip
    (d / "chats.jsonl").write_text("\n".join(json.dumps(c) for c in chats) + "\n")
    (d / "texts.jsonl").write_text(
        "\n".join(json.dumps({"text": p}) for p in paras[:4]) + "\n\n" + json.dumps(chats[0]) + "\n"
    )
    d = seeds / "data-text"
    d.mkdir(parents=True, exist_ok=True)
    (d / "doc.txt").write_text("\n\n".join(paras[:6]))
    (d / "short.md").write_text(paras[0][:400])


def seed_inputs(fixtures: Path, loader: str) -> list[tuple[str, dict]]:
    """[(name, {file name: bytes})] for `loader` (one file, or a mapper directory's files)."""
    if loader == "chat":
        return [(line, {"line": line}) for line in CHAT_SEEDS]
    d = Path(fixtures) / "seeds" / loader
    out = []
    if loader == "mapper-dir":
        for sub in sorted(p for p in d.iterdir() if p.is_dir()):
            out.append((sub.name, {f.name: f.read_bytes() for f in sorted(sub.iterdir())}))
        return out
    if loader == "linear-state-dict":
        for f in sorted(d.glob("*.pt")):
            out.append((f.name, {"maps.pt": f.read_bytes(),
                                 "maps.pt.json": (d / f"{f.name}.json").read_bytes()}))  # fmt: skip
        return out
    for f in sorted(d.iterdir()):
        out.append((f.name, {f"input{f.suffix}": f.read_bytes()}))
    return out


# -- the worker: runs one input at a time ----------------------------------------------------


class Context:
    """What the loaders need, built once per worker: the pair, translators, a session."""

    def __init__(self, fixtures: Path):
        import mlx_kvlingo  # noqa: F401
        from mlx_kvlingo.models.files import load_translator
        from mlx_kvlingo.models.pair import load_pair

        self.fixtures = Path(fixtures)
        self.pair = load_pair(self.fixtures / "qwen3", self.fixtures / "known")
        self.forward = load_translator(self.fixtures / "fwd.safetensors", self.pair)
        self.backward = load_translator(self.fixtures / "bwd.safetensors", self.pair.reversed())
        self._chat = None
        self.warm_up()

    def warm_up(self) -> None:
        """Run what the loaders run once, untimed: MLX compiles CPU kernels on first use
        (seconds on a busy machine), which is no loader's doing."""
        from mlx_kvlingo.models.files import load_translator

        for f in sorted((self.fixtures / "seeds" / "translator").glob("*.safetensors")):
            pair = self.pair.reversed() if f.name.startswith("bwd") else self.pair
            _use_translator(self, load_translator(f, pair), pair)
        s = self.session()
        s.add_user("warm up")
        for model in ("source", "target"):
            list(s.generate(model, max_tokens=2))

    def session(self, **kw):
        from mlx_kvlingo.conversation.session import Session

        return Session(self.pair, self.forward, self.backward, system_prompt="Be brief.", **kw)

    def chat(self):
        if self._chat is None or self._chat.conv.tokens > 300:
            from mlx_kvlingo.cli.chat import ChatApp

            from rich.console import Console

            self._console = io.StringIO()
            console = Console(file=self._console, highlight=False, width=100)
            from mlx_kvlingo import Conversation
            from mlx_kvlingo.api import Pair

            conv = Conversation(Pair(self.pair, self.forward, self.backward), 512,
                                system_prompt="Be brief.")  # fmt: skip
            self._chat = ChatApp(conv, max_tokens=3,
                                 sampling={"temp": 0.0}, auto_threshold=-1.5, console=console)  # fmt: skip
        self._console.seek(0)
        self._console.truncate()
        return self._chat


def _use_translator(ctx: Context, tr, pair) -> None:
    """A translator that loaded must translate a short span of the pair's source."""
    from mlx_kvlingo.kv.cache import new_cache
    from mlx_kvlingo.kv.capture import prefill

    import mlx.core as mx

    span = prefill(pair.source, [1, 20, 30, 40], new_cache(pair.source), cut=tr.config.key_cut)
    keys, values = tr.translate(span, pair.target)
    mx.eval(keys, values)


def run_loader(ctx: Context, inp: Input, box: Path) -> None:
    """Run `inp` through its loader in sandbox `box` (inputs in box/in, outputs to box/out)."""
    loader, src = inp.loader, box / "in"
    paths = {n: src / n for n in inp.files}
    if loader == "translator":
        from mlx_kvlingo.models.files import load_translator

        (path,) = paths.values()
        pair = ctx.pair.reversed() if inp.seed_name.startswith("bwd") else ctx.pair
        tr = load_translator(path, pair if inp.with_pair else None)
        if inp.with_pair:
            _use_translator(ctx, tr, pair)
    elif loader == "session":
        (path,) = paths.values()
        s = ctx.session()
        s.load(path)
        _check_session(s)
        s.add_user("more")
        list(s.generate("target" if inp.with_pair else "source", max_tokens=2))
        _check_session(s)
    elif loader in ("knlp-translator", "knlp-checkpoint", "linear-state-dict", "mapper-dir"):
        import converters

        path = src if loader == "mapper-dir" else paths.get("maps.pt") or next(iter(paths.values()))
        options = {} if inp.with_pair or loader != "mapper-dir" else {"source_layers": 4}
        converters.convert_file(path, box / "out" / "t.safetensors",
                                pair=ctx.pair if inp.with_pair else None, **options)  # fmt: skip
    elif loader in ("data-jsonl", "data-text"):
        from mlx_kvlingo.data.examples import DataConfig, load_examples, validate_data

        (path,) = paths.values()
        validate_data(path)
        cfg = DataConfig(min_prefix=4, max_prefix=24, continuation=6, max_examples=4,
                         max_heldout=2, heldout_fraction=0.25 if inp.with_pair else 1.0)  # fmt: skip
        load_examples(path, ctx.pair.tokenizer, cfg)
    elif loader == "chat":
        app = ctx.chat()
        out = io.StringIO()
        old, sys.stdout = sys.stdout, out
        try:
            app.handle(inp.line)
        finally:
            sys.stdout = old
        _check_session(app.conv.cache)
    else:
        raise ValueError(f"unknown loader {loader!r}")


def _check_session(s) -> None:
    for role in ("source", "target"):
        held = s.held(role)
        assert all(c.offset == held for c in s.cache(role)), f"{role} cache offsets != held"
        assert 0 <= held <= len(s.tokens), f"{role} holds {held} of {len(s.tokens)} tokens"


def _listing(paths) -> set[str]:
    out = set()
    for p in paths:
        p = Path(p)
        if p.is_dir():
            for dirpath, dirnames, filenames in os.walk(p):
                out.update(os.path.join(dirpath, n) for n in dirnames + filenames)
    return out


def _documented(loader: str) -> tuple:
    import importlib

    return tuple(getattr(importlib.import_module(m), c) for m, c in DOCUMENTED[loader])


def _chat_path_escapes(line: str | None) -> bool:
    """A /save or /load line naming a path outside the working directory (the user asked for
    it: not a loader's doing, and not something to do to this machine)."""
    import shlex

    if not line or not line.strip().startswith(("/save", "/load")):
        return False
    try:
        args = shlex.split(line.strip())[1:]
    except ValueError:
        return False
    return any(a.startswith(("/", "~")) or ".." in a or "\x00" in a for a in args[:1])


def run_one(ctx: Context, inp: Input, box: Path, watch: list[Path]) -> tuple[str, str]:
    """(outcome, detail) for one input; `watch`: directories nothing may appear in."""
    if inp.loader == "chat" and _chat_path_escapes(inp.line):
        return "ok", "skipped: names a path outside the working directory"
    for sub in ("in", "out"):
        shutil.rmtree(box / sub, ignore_errors=True)
        (box / sub).mkdir(parents=True)
    for name, data in inp.files.items():
        (box / "in" / name).write_bytes(data)
    allowed = {str(box / "out"), str(box / "tmp" / "mlx")}  # MLX's compiled-kernel cache
    if inp.loader == "chat":
        allowed.add(str(box / "cwd"))  # /save FILE writes where the user says
    before = _listing([box, *watch])
    documented = _documented(inp.loader)
    try:
        run_loader(ctx, inp, box)
        outcome, detail = "ok", ""
    except documented as e:
        outcome, detail = "refused", f"{type(e).__name__}: {str(e)[:300]}"
    except Exception as e:  # noqa: BLE001 - the point: anything else is a finding
        tb = traceback.format_exc(limit=-6)
        outcome, detail = "bug", f"{type(e).__name__}: {str(e)[:300]}\n{tb}"
    detail = detail.replace(f"{box / 'in'}{os.sep}", "").replace(str(box), "<sandbox>")
    after = _listing([box, *watch])
    new = sorted(p for p in after - before
                 if not any(p == a or p.startswith(a + os.sep) for a in allowed))  # fmt: skip
    if new:
        return "wrote", f"{new[:5]} (after {outcome} {detail[:200]})"
    return outcome, detail


def worker_main(conn, fixtures: str, box: str, memory_limit: int | None) -> None:
    box_p = Path(box)
    for sub in ("cwd", "tmp", "cache", "hf"):
        (box_p / sub).mkdir(parents=True, exist_ok=True)
    os.chdir(box_p / "cwd")
    os.environ.update(TMPDIR=str(box_p / "tmp"), KVLINGO_CACHE=str(box_p / "cache"),
                      HF_HOME=str(box_p / "hf"), HF_HUB_OFFLINE="1")  # fmt: skip
    import tempfile

    tempfile.tempdir = None
    if memory_limit:
        import resource

        resource.setrlimit(resource.RLIMIT_AS, (memory_limit, memory_limit))
    sys.path[:0] = [str(ROOT / "tests"), str(ROOT)]
    import mlx_kvlingo  # noqa: F401

    import torch  # noqa: F401  (imported once, not inside the first timed input)

    ctx = Context(Path(fixtures))
    watch = [box_p / "tmp", box_p / "cache", box_p / "hf"]
    conn.send(("ready", ""))
    while True:
        try:
            inp = conn.recv()
        except EOFError:
            return
        if inp is None:
            return
        conn.send(run_one(ctx, inp, box_p, watch))


class Worker:
    """A worker process with a per-input time limit; replaced after a hang or a crash."""

    def __init__(self, fixtures: Path, box: Path, memory_limit: int | None = 8 * 2**30):
        self.fixtures, self.box, self.memory_limit = fixtures, box, memory_limit
        self.proc = None
        self.starts = 0

    def start(self) -> None:
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=worker_main, daemon=True,
                                args=(child, str(self.fixtures), str(self.box), self.memory_limit))  # fmt: skip
        self.proc.start()
        child.close()
        self.starts += 1
        if not self.conn.poll(300):
            self.stop()
            raise RuntimeError("fuzz worker did not start within 300 s")
        self.conn.recv()

    def stop(self) -> None:
        if self.proc is not None:
            if self.proc.is_alive():
                self.proc.kill()
            self.proc.join(10)
            self.proc = None

    def run(self, inp: Input, limit: float) -> tuple[str, str]:
        if self.proc is None or not self.proc.is_alive():
            self.start()
        try:
            self.conn.send(inp)
            if self.conn.poll(limit):
                return self.conn.recv()
        except (EOFError, BrokenPipeError, ConnectionResetError):
            pass
        alive = self.proc.is_alive()
        code = self.proc.exitcode
        self.stop()
        return ("hang", f"no answer within {limit} s") if alive else ("crash", f"exit code {code}")


# -- campaigns -------------------------------------------------------------------------------


@dataclass
class Report:
    loader: str
    counts: Counter = field(default_factory=Counter)
    refused_by: Counter = field(default_factory=Counter)
    reasons: Counter = field(default_factory=Counter)  # refusal messages, paths and numbers out
    findings: list = field(default_factory=list)  # (index, outcome, mutation, detail)
    seconds: float = 0.0

    @property
    def total(self) -> int:
        return sum(self.counts.values())

    @property
    def failures(self) -> int:
        return sum(self.counts[o] for o in FAILURES)

    def as_dict(self) -> dict:
        return {"loader": self.loader, "inputs": self.total, "seconds": round(self.seconds, 1),
                **{o: self.counts[o] for o in OUTCOMES}, "refused_by": dict(self.refused_by),
                "reasons": dict(self.reasons.most_common(12)),
                "findings": self.findings[:20]}  # fmt: skip


def _reason(detail: str, inp: Input) -> str:
    """A refusal message as a kind: the class, the message without paths, names and numbers."""
    import re

    cls, _, msg = detail.partition(": ")
    msg = re.sub(r"'[^']*'|\"[^\"]*\"|\([^()]*\)", "…", msg)
    msg = re.sub(r"-?\d+(\.\d+)?(e[+-]?\d+)?", "N", msg)
    return f"{cls}: {msg.strip()[:70]}"


def fuzz(loader: str, worker: Worker, fixtures: Path, *, seed: int = 0, start: int = 0,
         count: int = 100, limit: float = 10.0, keep: Path | None = None,
         progress=None) -> Report:  # fmt: skip
    """Run inputs start..start+count-1 of `loader` through `worker`; `keep`: save failing inputs."""
    seeds = seed_inputs(fixtures, loader)
    report = Report(loader)
    t0 = time.perf_counter()
    for i in range(start, start + count):
        inp = mutate(loader, seeds, seed, i)
        outcome, detail = worker.run(inp, limit)
        report.counts[outcome] += 1
        if outcome == "refused":
            report.refused_by[detail.split(":", 1)[0]] += 1
            report.reasons[_reason(detail, inp)] += 1
        elif outcome in FAILURES:
            report.findings.append((i, outcome, inp.mutation, detail))
            if keep is not None:
                d = keep / loader / str(i)
                d.mkdir(parents=True, exist_ok=True)
                for n, b in inp.files.items():
                    (d / n).write_bytes(b)
                (d / "finding.txt").write_text(f"{outcome}\n{inp.mutation}\n{inp.line!r}\n{detail}")
        if progress:
            progress(report, i)
    report.seconds = time.perf_counter() - t0
    return report


def run_in_work_folder(main, prefix: str, argv=None) -> int:
    """`main(work, argv)` with a fresh temporary folder, removed afterwards (the apps' runs)."""
    work = Path(tempfile.mkdtemp(prefix=prefix))
    try:
        return main(work, argv)
    finally:
        shutil.rmtree(work, ignore_errors=True)
