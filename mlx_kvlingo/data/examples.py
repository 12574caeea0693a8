"""Calibration examples: a prefix the source reads and a continuation the target is scored on.

Sources: plain text files (`.txt`, `.md`, `.rst`), JSONL files with one record per line, either
a chat (`{"messages": [...]}`, formatted with the pair's chat template, switch points at the
start of each assistant reply) or a text (`{"text": "..."}`, read like a text file), or a
directory of them. Held-out documents never contribute training examples. `validate_data`
checks all of it without a tokenizer, so commands refuse bad data before loading any model.
"""

from __future__ import annotations

import json
import math
import random
from dataclasses import dataclass
from pathlib import Path

TEXT_SUFFIXES = {".txt", ".md", ".rst", ".text"}
CHAT_SUFFIXES = {".jsonl"}


class DataError(ValueError):
    pass


@dataclass(frozen=True)
class Example:
    prefix: tuple[int, ...]
    continuation: tuple[int, ...]
    source: str  # "file:line" or "file@token" for error messages and reports
    # token ranges [start, end) of the prefix that earlier assistant replies fill: what the
    # answering model writes itself in a conversation the small model reads for it
    replies: tuple[tuple[int, int], ...] = ()


@dataclass(frozen=True)
class DataConfig:
    min_prefix: int = 16
    max_prefix: int = 256
    continuation: int = 32
    heldout_fraction: float = 0.1
    seed: int = 0
    max_examples: int | None = None  # stop drawing training examples after this many
    max_heldout: int | None = None  # and held-out ones after this many
    replies_per_chat: int | None = 2  # assistant replies drawn per conversation (None: all)
    # also locate earlier replies in each chat prefix (Example.replies, for reader-mode
    # calibration); off by default: it templates every earlier turn once more
    reply_spans: bool = False


def _files(path: Path) -> list[Path]:
    if path.is_dir():
        files = sorted(p for p in path.rglob("*") if p.suffix in TEXT_SUFFIXES | CHAT_SUFFIXES)
        if not files:
            raise DataError(f"{path}: no .txt/.md/.rst/.jsonl files in this directory")
        return files
    if not path.exists():
        raise DataError(f"{path}: no such file or directory")
    return [path]


def _read_jsonl(path: Path) -> list[tuple[str, object]]:
    """[("chat", messages) | ("text", str)], one per non-empty line."""
    records: list[tuple[str, object]] = []
    for n, raw in enumerate(_read_bytes(path).splitlines(), 1):
        try:
            line = raw.decode("utf-8")
        except UnicodeDecodeError as e:
            raise DataError(f"{path}:{n}: not UTF-8 text ({e.reason} at byte {e.start})") from None
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            raise DataError(f"{path}:{n}: not valid JSON ({e.msg})") from None
        except RecursionError:
            raise DataError(f"{path}:{n}: JSON nested too deeply") from None
        if isinstance(obj, dict) and isinstance(obj.get("text"), str) and "messages" not in obj:
            if obj["text"].strip():
                records.append(("text", obj["text"]))
            continue
        msgs = obj.get("messages") if isinstance(obj, dict) else None
        if not isinstance(msgs, list) or not msgs:
            raise DataError(
                f'{path}:{n}: expected {{"messages": [...]}} (a chat) or {{"text": "..."}}'
            )
        for m in msgs:
            if not isinstance(m, dict) or "role" not in m or not isinstance(m.get("content"), str):
                raise DataError(f"{path}:{n}: each message needs a 'role' and a string 'content'")
        records.append(("chat", msgs))
    if not records:
        raise DataError(f"{path}: no records (empty JSONL file)")
    return records


def _read_bytes(path: Path) -> bytes:
    try:
        return path.read_bytes()
    except OSError as e:
        raise DataError(f"{path}: cannot read ({e.strerror or e})") from None


def validate_data(path: str | Path) -> dict:
    """Read and check every file under `path` (no tokenizer needed); a summary of what is there
    (`DataError` naming the file and line of the first problem)."""
    kinds = [kind for _, kind, _ in _documents(path)]
    return {"files": len(_files(Path(path))), "chats": kinds.count("chat"),
            "texts": kinds.count("text")}  # fmt: skip


def _documents(path: str | Path):
    """(name, kind, record) of every record under `path`: ("chat", messages) or ("text", str)."""
    for f in _files(Path(path)):
        if f.suffix in CHAT_SUFFIXES:
            for i, (kind, record) in enumerate(_read_jsonl(f), 1):
                yield f"{f.name}:{i}", kind, record
        else:
            text = _read_bytes(f).decode("utf-8", errors="replace")
            if not text.strip():
                raise DataError(f"{f}: empty text file")
            yield f.name, "text", text


def _chat_examples(tokenizer, msgs, name, cfg: DataConfig) -> list[Example]:
    """Examples at assistant replies: prefix up to the reply's header, continuation = reply;
    up to `replies_per_chat` replies per conversation (seeded)."""
    out = []
    replies = [i for i, m in enumerate(msgs) if m["role"] == "assistant" and i > 0]
    if cfg.replies_per_chat is not None and len(replies) > cfg.replies_per_chat:
        rng = random.Random(f"{cfg.seed}:{name}")
        replies = sorted(rng.sample(replies, cfg.replies_per_chat))
    # (index, start token, tokens) of each earlier reply: where its own text would lie in the
    # templated conversation (a span of a prefix only where the prefix holds these tokens there)
    candidates = []
    for j in range(1, replies[-1] if cfg.reply_spans and replies else 0):
        if msgs[j]["role"] == "assistant":
            start = len(tokenizer.apply_chat_template(msgs[:j], add_generation_prompt=True))
            text = list(tokenizer.encode(msgs[j]["content"], add_special_tokens=False))
            if text:
                candidates.append((j, start, text))
    for i in replies:
        prefix = tokenizer.apply_chat_template(msgs[:i], add_generation_prompt=True)
        full = tokenizer.apply_chat_template(msgs[: i + 1])
        if list(full[: len(prefix)]) != list(prefix):
            continue  # template not prefix-stable here; skip rather than mis-split
        cont = full[len(prefix) : len(prefix) + cfg.continuation]
        spans = [
            (s, s + len(t)) for j, s, t in candidates if j < i and list(prefix[s : s + len(t)]) == t
        ]
        if len(prefix) > cfg.max_prefix:
            cut = len(prefix) - cfg.max_prefix
            prefix = prefix[cut:]
            spans = [(max(s - cut, 0), e - cut) for s, e in spans if e > cut]
        if len(prefix) >= cfg.min_prefix and len(cont) >= 2:
            out.append(Example(tuple(prefix), tuple(cont), f"{name}#reply{i}", tuple(spans)))
    return out


def load_examples(path: str | Path, tokenizer, cfg: DataConfig = DataConfig()):
    """(train, heldout) examples, deterministic for `cfg.seed`. Documents (a conversation, or a
    block of a text file) are split before any example is drawn: no held-out text is trained on."""
    rng = random.Random(cfg.seed)
    docs: list[tuple[str, object]] = []
    block = cfg.max_prefix + cfg.continuation  # a text is split into documents of this many
    for name, kind, record in _documents(path):
        if kind == "chat":
            docs.append((name, ("chat", record)))
            continue
        tokens = tokenizer.encode(record)
        for s in range(0, len(tokens), block):
            if len(tokens[s : s + block]) >= cfg.min_prefix + 2:
                docs.append((f"{name}@{s}", ("text", tokens[s : s + block])))
    if not docs:
        raise DataError(f"{path}: no documents long enough for min_prefix={cfg.min_prefix}")
    order = list(range(len(docs)))
    rng.shuffle(order)
    if cfg.heldout_fraction >= 1.0:  # evaluation-only data: everything is held out
        n_held = len(docs)
    else:
        n_held = max(1, int(round(len(docs) * cfg.heldout_fraction))) if len(docs) > 1 else 0
    held_ids = set(order[:n_held])
    train, held = [], []
    # documents are templated and tokenized lazily: stop once both splits have enough
    for i in order:
        bucket, cap = (held, cfg.max_heldout) if i in held_ids else (train, cfg.max_examples)
        if _full(train, cfg.max_examples) and _full(held, cfg.max_heldout):
            break
        if _full(bucket, cap):
            continue
        name, (kind, payload) = docs[i]
        if kind == "chat":
            exs = _chat_examples(tokenizer, payload, name, cfg)
        elif (hi := min(cfg.max_prefix, len(payload) - 2)) < cfg.min_prefix:
            exs = []
        else:  # a log-uniform prefix length: short and long prefixes both well represented
            draw = random.Random(f"{cfg.seed}:{name}")
            n = int(round(math.exp(draw.uniform(math.log(cfg.min_prefix), math.log(hi)))))
            start = draw.randint(0, len(payload) - n - 2)
            cont = payload[start + n : start + n + cfg.continuation]
            exs = [Example(tuple(payload[start : start + n]), tuple(cont), f"{name}+{start}")]
        bucket.extend(exs[: None if cap is None else cap - len(bucket)])
    if not train and cfg.heldout_fraction < 1.0:
        raise DataError(
            f"{path}: no training examples (need prefixes of at least {cfg.min_prefix} tokens "
            f"and a continuation of 2+ tokens)"
        )
    return train, held


def _full(bucket: list, cap: int | None) -> bool:
    return cap is not None and len(bucket) >= cap


def read_texts(path: str | Path) -> list[str]:
    """Every document under `path` as plain text: text files whole, JSONL `text` records, and
    chats as their messages' contents one after another (for task generators, not examples)."""
    return [r if kind == "text" else "\n".join(m["content"] for m in r)
            for _, kind, r in _documents(path)]  # fmt: skip
