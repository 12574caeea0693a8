"""Calibration examples that need the prefix: a content task (`content_tasks`) as prefix, the
target's own greedy answer on its native cache as continuation.

`shipped_texts()` is the text any install has (CPython's `pydoc_data` topics and the chitchat
training dialogues; the content benchmark's held-out pages are neither). Answers are cached in
a JSONL file as they are made, so an interrupted build resumes where it stopped.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from hashlib import sha1
from pathlib import Path

from mlx_kvlingo._platform.atomic import write_text
from mlx_kvlingo.data.content_tasks import DEFAULT_KINDS, build_tasks
from mlx_kvlingo.data.examples import Example

from mlx_lm import batch_generate

#: calibration tasks draw from their own seed stream: the content benchmark's seeds (0, 1, ...)
#: would otherwise state the same first facts in training and evaluation prompts
SEED_OFFSET = 1_000_003
#: greedy answer tokens per kind (the content benchmark's limits)
ANSWER_TOKENS = {"fact": 24, "copy": 48, "qa": 48, "summary": 48}


def shipped_texts(max_dialogues: int = 400) -> list[str]:
    """Documentation topics from CPython's `pydoc_data` and chitchat training dialogues."""
    import pydoc_data.topics

    from mlx_kvlingo.models.demo.pair import chitchat_dialogues, is_heldout, to_messages

    texts = [t for t in pydoc_data.topics.topics.values() if len(t) > 400]
    dialogues = [
        "\n".join(m["content"] for m in to_messages(conv))
        for key, conv in chitchat_dialogues().items()
        if not is_heldout(key)
    ]
    return texts + dialogues[:max_dialogues]


def content_examples(pair, texts: Sequence[str], n: int, lengths: Sequence[int] = (128, 256, 512),
                     kinds: Sequence[str] = DEFAULT_KINDS, seed: int = 0, cache_file: str | Path | None = None,
                     on_example: Callable[[int], None] | None = None,
                     batch: int = 16) -> list[Example]:  # fmt: skip
    """`n` content tasks spread over `lengths` and `kinds`, each with the target's answer; with
    `cache_file`, answers there (same seed and task tokens) are reused, new ones appended per
    batch. `on_example(done)` reports progress."""
    tasks, keys = _tasks_and_keys(pair, texts, n, lengths, kinds, seed)
    path = Path(cache_file) if cache_file else None
    done = _read_cache(path)
    todo = [i for i, k in enumerate(keys) if k not in done]
    lines = [json.dumps({"key": k, "answer": v}) for k, v in done.items()]
    for b in range(0, len(todo), batch):
        chunk = todo[b : b + batch]
        for i, answer in zip(chunk, native_answers(pair, [tasks[i] for i in chunk]), strict=True):
            done[keys[i]] = answer
            lines.append(json.dumps({"key": keys[i], "answer": answer}))
        if path:  # after each batch: an interruption loses at most one
            write_text(path, "\n".join(lines) + "\n")
        if on_example:
            on_example(len(tasks) - len(todo) + b + len(chunk))
    return [
        Example(task.tokens, tuple(done[key]), f"content:{task.kind}@{task.length}#{i}")
        for i, (task, key) in enumerate(zip(tasks, keys))
        if done[key]
    ]


def native_answers(pair, tasks) -> list[list[int]]:
    """The target's greedy answers on its own cache (mlx-lm's batch_generate), each ending
    with the end-of-turn token when it stopped before its limit."""
    limits = [ANSWER_TOKENS[t.kind] for t in tasks]
    res = batch_generate(pair.target.model, pair.tokenizer, [list(t.tokens) for t in tasks],
                         max_tokens=limits, return_token_ids=True)  # fmt: skip
    eos = pair.tokenizer.eos_token_id
    return [ids + [eos] if len(ids) < n else ids for ids, n in zip(res.token_ids, limits)]


def _tasks_and_keys(pair, texts, n, lengths, kinds, seed) -> tuple[list, list[str]]:
    per = max(1, -(-n // (len(lengths) * len(kinds))))
    tasks = build_tasks(pair.tokenizer, texts, lengths, per, kinds, SEED_OFFSET + seed)[:n]
    return tasks, [f"{seed}:{sha1(','.join(map(str, t.tokens)).encode()).hexdigest()[:16]}"
                   for t in tasks]  # fmt: skip


def _read_cache(path: Path | None) -> dict[str, list[int]]:
    done: dict[str, list[int]] = {}
    if path and path.exists():
        for line in path.read_text().splitlines():
            try:
                rec = json.loads(line)
                done[rec["key"]] = rec["answer"]
            except (json.JSONDecodeError, KeyError, TypeError):
                continue  # a line cut short by an interruption: made again
    return done


def unanswered(pair, texts: Sequence[str], n: int, lengths: Sequence[int] = (128, 256, 512),
               kinds: Sequence[str] = DEFAULT_KINDS, seed: int = 0,
               cache_file: str | Path | None = None) -> int:  # fmt: skip
    """How many of `content_examples`' answers the cache file lacks (for the plan)."""
    if not n:
        return 0
    _, keys = _tasks_and_keys(pair, texts, n, lengths, kinds, seed)
    done = _read_cache(Path(cache_file) if cache_file else None)
    return sum(k not in done for k in keys)


def write_shipped_data(folder: str | Path | None = None) -> Path:
    """`shipped_texts()` as a JSONL folder `load_examples` reads (written once, then reused)."""
    from mlx_kvlingo._platform.cachedir import build_atomically
    from mlx_kvlingo.models.demo.smollm2 import cache_root

    folder = Path(folder) if folder else cache_root() / "data" / "shipped"
    stamp = {"kind": "shipped-text", "version": 1}

    def build(tmp: Path) -> None:
        lines = [json.dumps({"text": t}) for t in shipped_texts()]
        (tmp / "shipped.jsonl").write_text("\n".join(lines) + "\n")

    return build_atomically(folder, stamp, build, "kvlingo.json")
