"""Calibration examples that need the prefix, answered by the target itself.

Stage 2 on ordinary continuations learns what any context predicts. Here each example is a
content task (`content_tasks`: a fact, a sentence to copy, a question or a summary about a
passage, built over ordinary text) as prefix, and the target's own greedy answer on its native
cache as continuation: self-distillation data whose right continuation is only in the prefix.

`shipped_texts()` is the text any install has: the Python documentation topics that CPython
ships (`pydoc_data.topics`, the language reference) and the chitchat dialogues the package
depends on; the content benchmark's held-out pages are neither. Answers are cached in a JSONL
file as they are made, so an interrupted build resumes where it stopped.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from pathlib import Path

import mlx.core as mx
from mlx_lm.generate import generate_step

from .._atomic import write_text
from ..content_tasks import KINDS, build_tasks
from ..data import Example
from ..kvcache import new_cache

#: greedy answer tokens per kind (the content benchmark's limits)
ANSWER_TOKENS = {"fact": 24, "copy": 48, "qa": 48, "summary": 48}


def shipped_texts(max_dialogues: int = 400) -> list[str]:
    """Documentation topics from CPython's `pydoc_data` and chitchat training dialogues."""
    import pydoc_data.topics

    from ..demo.data import chitchat_dialogues, is_heldout, to_messages

    texts = [t for t in pydoc_data.topics.topics.values() if len(t) > 400]
    dialogues = [
        "\n".join(m["content"] for m in to_messages(conv))
        for key, conv in chitchat_dialogues().items()
        if not is_heldout(key)
    ]
    return texts + dialogues[:max_dialogues]


def native_answer(model, eos: set[int], tokens: Sequence[int], max_tokens: int) -> list[int]:
    """The greedy answer of `model` (a LoadedModel) to `tokens` on its own cache, with its
    end-of-turn token."""
    out: list[int] = []
    steps = generate_step(mx.array(list(tokens)), model.model, max_tokens=max_tokens,
                          sampler=lambda x: mx.argmax(x, axis=-1),
                          prompt_cache=new_cache(model))  # fmt: skip
    for tok, _ in steps:
        out.append(int(tok))
        if out[-1] in eos:
            break
    return out


def content_examples(pair, texts: Sequence[str], n: int, lengths: Sequence[int] = (128, 256, 512),
                     kinds: Sequence[str] = KINDS, seed: int = 0, cache_file: str | Path | None = None,
                     on_example: Callable[[int], None] | None = None) -> list[Example]:  # fmt: skip
    """`n` content tasks spread over `lengths` and `kinds`, each with the target's answer.

    With `cache_file`, answers already there (same seed, same task tokens) are reused and new
    ones appended as they are made; `on_example(i)` is called after each (progress bars).
    """
    per = max(1, -(-n // (len(lengths) * len(kinds))))
    tasks = build_tasks(pair.tokenizer, texts, lengths, per, kinds, seed)[:n]
    done: dict[str, list[int]] = {}
    path = Path(cache_file) if cache_file else None
    if path and path.exists():
        for line in path.read_text().splitlines():
            try:
                rec = json.loads(line)
                done[rec["key"]] = rec["answer"]
            except (json.JSONDecodeError, KeyError, TypeError):
                continue  # a line cut short by an interruption: made again
    eos = set(pair.tokenizer.eos_token_ids)
    out, lines = [], [json.dumps({"key": k, "answer": v}) for k, v in done.items()]
    for i, task in enumerate(tasks):
        key = f"{seed}:{hash_tokens(task.tokens)}"
        answer = done.get(key)
        if answer is None:
            answer = native_answer(pair.target, eos, task.tokens, ANSWER_TOKENS[task.kind])
            done[key] = answer
            if path:
                lines.append(json.dumps({"key": key, "answer": answer}))
                write_text(path, "\n".join(lines) + "\n")
        if answer:
            out.append(
                Example(task.tokens, tuple(answer), f"content:{task.kind}@{task.length}#{i}")
            )
        if on_example:
            on_example(i)
    return out


def hash_tokens(tokens: Sequence[int]) -> str:
    import hashlib

    return hashlib.sha1(",".join(map(str, tokens)).encode()).hexdigest()[:16]


def write_shipped_data(folder: str | Path | None = None) -> Path:
    """`shipped_texts()` as a JSONL folder `load_examples` reads (written once, then reused)."""
    from .._cachedir import build_atomically, stamp_ok
    from ..demo.smollm2 import cache_root

    folder = Path(folder) if folder else cache_root() / "data" / "shipped"
    stamp = {"kind": "shipped-text", "version": 1}
    if stamp_ok(folder, stamp, "kvlingo.json"):
        return folder

    def build(tmp: Path) -> None:
        lines = [json.dumps({"text": t}) for t in shipped_texts()]
        (tmp / "shipped.jsonl").write_text("\n".join(lines) + "\n")

    return build_atomically(folder, stamp, build, "kvlingo.json")
