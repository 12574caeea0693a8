"""Prompts whose right answer is only in the text read: the content benchmark's tasks.

A task is a chat prompt of about `length` tokens built, with a seed, from ordinary text
(documents the pair never saw in calibration, for evaluation) and one of five kinds:

  fact     one sentence stating a value (a number, a name, an attribute, a date) hidden at a
           depth (0.1, 0.5 or 0.9) inside unrelated text, then a question for that value
  facts    three such sentences (three kinds of value) at three depths drawn from 0.1-0.9, then
           a question for one of them; the other two are read and must not be answered
  copy     one sentence marked for remembering inside unrelated text, then "repeat it"
  qa       a passage, then a question about a word the passage uses
  summary  a passage, then "summarize it in one sentence"

`answer` holds what a right reply must contain for fact and copy tasks; qa and summary are scored
against the target's own answer on its native cache (`content.py`). The same generator over
training text gives calibration examples that need the prefix (`content_examples`).
"""

from __future__ import annotations

import functools
import random
import re
from collections.abc import Sequence
from dataclasses import dataclass

KINDS = ("fact", "facts", "copy", "qa", "summary")
#: what `kvlingo eval --task content` and calibration draw unless told
DEFAULT_KINDS = ("fact", "copy", "qa", "summary")
DEPTHS = (0.1, 0.5, 0.9)

_FIRST = ("Anna", "Boris", "Chiara", "Dmitri", "Elena", "Farid", "Greta", "Hugo", "Ines",
          "Jonas", "Keiko", "Lars", "Maya", "Nadia", "Omar", "Priya", "Quentin", "Rosa",
          "Soren", "Tomas", "Uma", "Viktor", "Wanda", "Yusuf", "Zelda")  # fmt: skip
_LAST = ("Abbott", "Brennan", "Castillo", "Dalton", "Eriksen", "Fischer", "Garnier", "Holloway",
         "Ivanova", "Jensen", "Kowalski", "Lindqvist", "Moreau", "Novak", "Okafor", "Petrov",
         "Quinn", "Romano", "Sato", "Thornton", "Ueda", "Vasquez", "Whitaker", "Yilmaz")  # fmt: skip
_PLACES = ("the north warehouse", "the harbor office", "the blue storage room", "the old library",
           "the garden shed", "the rooftop lab", "the east gate", "the music hall",
           "the basement archive", "the river cabin")  # fmt: skip
_ORGS = ("the chess club", "the city museum", "the rowing team", "the bakery on Elm Street",
         "the robotics lab", "the village council", "the jazz band", "the science fair")  # fmt: skip
_ROLES = ("director", "treasurer", "captain", "head chef", "chief engineer", "secretary")
_COLORS = ("crimson", "turquoise", "amber", "lavender", "olive", "scarlet", "teal", "ivory")
_THINGS = ("favorite color", "lucky color", "car color")
_EVENTS = ("the harvest festival", "the annual audit", "the chess final", "the boat race",
           "the museum reopening", "the spring concert", "the team retreat")  # fmt: skip
_MONTHS = ("January", "February", "March", "April", "May", "June", "July", "August",
           "September", "October", "November", "December")  # fmt: skip
_SENTENCE = re.compile(r"(?<=[.!?])\s+")
_WORD = re.compile(r"[A-Za-z][A-Za-z'-]+")
_PLAIN = re.compile(r"[A-Z][A-Za-z0-9 ,;'()-]+[.]")  # a sentence worth copying: no markup


@dataclass(frozen=True)
class ContentTask:
    """One prompt; `answer` is what a right reply contains ("" for qa and summary)."""

    kind: str
    length: int  # the read length asked for (the prompt is within a few tokens of it)
    tokens: tuple[int, ...]  # the templated prompt
    answer: str
    question: str
    depth: float | None = None
    detail: str = ""  # the fact's type, or the word a qa question asks about


def sentences(texts: Sequence[str]) -> list[list[str]]:
    """Each document's sentences, whitespace collapsed; very short and very long ones dropped."""
    out = []
    for t in texts:
        sents = [" ".join(s.split()) for s in _SENTENCE.split(t)]
        sents = [s for s in sents if 4 <= len(s.split()) <= 60]
        if sents:
            out.append(sents)
    if not out:
        raise ValueError("no usable sentences in the given text")
    return out


FACT_TYPES = ("number", "name", "attribute", "date")


def _fact(rng: random.Random, kind: str | None = None) -> tuple[str, str, str, str]:
    """(statement, question, answer, type) for a fresh random fact (of type `kind`)."""
    kind = kind or rng.choice(FACT_TYPES)
    if kind == "number":
        place, code = rng.choice(_PLACES), str(rng.randint(10000, 99999))
        return (f"The access code for {place} is {code}.",
                f"What is the access code for {place}?", code, kind)  # fmt: skip
    if kind == "name":
        role, org = rng.choice(_ROLES), rng.choice(_ORGS)
        name = f"{rng.choice(_FIRST)} {rng.choice(_LAST)}"
        return (f"The {role} of {org} is {name}.",
                f"Who is the {role} of {org}?", name, kind)  # fmt: skip
    if kind == "attribute":
        who, thing, color = rng.choice(_FIRST), rng.choice(_THINGS), rng.choice(_COLORS)
        return (f"{who}'s {thing} is {color}.", f"What is {who}'s {thing}?", color, kind)
    event, month, day = rng.choice(_EVENTS), rng.choice(_MONTHS), rng.randint(2, 28)
    return (f"{event[0].upper()}{event[1:]} will take place on {month} {day}.",
            f"On what date will {event} take place?", f"{month} {day}", kind)  # fmt: skip


class TaskBuilder:
    """Builds tasks of a given token length from `texts` with the pair's chat template."""

    def __init__(self, tokenizer, texts: Sequence[str], seed: int = 0):
        self.tokenizer = tokenizer
        self.docs = sentences(texts)
        self.rng = random.Random(seed)
        # a sentence's tokens within a text, counted once
        self._count = functools.cache(
            lambda s: len(tokenizer.encode(" " + s, add_special_tokens=False))
        )

    def _template(self, user: str) -> list[int]:
        msgs = [{"role": "user", "content": user}]
        out = self.tokenizer.apply_chat_template(msgs, add_generation_prompt=True)
        return list(out if isinstance(out, list) else out["input_ids"])

    def _run(self, budget: int) -> list[str]:
        """Consecutive sentences of one document (wrapping into the next) of ~`budget` tokens."""
        d = self.rng.randrange(len(self.docs))
        i = self.rng.randrange(len(self.docs[d]))
        out, used = [], 0
        while used < budget:
            s = self.docs[d][i]
            out.append(s)
            used += self._count(s)
            i += 1
            if i == len(self.docs[d]):
                d, i = (d + 1) % len(self.docs), 0
        return out

    def _fit(self, length: int, make) -> tuple[list[int], object]:
        """(tokens, what it drew) of `make(budget)` -> (user text, what it drew), the budget tuned
        so the prompt is ~`length` tokens (the closest of 5 tries); every try draws from the same
        random state: the same text, only its length changes."""
        budget, best, state = max(8, length - 40), None, self.rng.getstate()
        for _ in range(5):
            self.rng.setstate(state)
            user, drawn = make(budget)
            tokens = self._template(user)
            if best is None or abs(len(tokens) - length) < abs(len(best[0]) - length):
                best = (tokens, drawn)
            if abs(len(tokens) - length) <= max(4, length // 20):
                break
            budget = max(8, budget + length - len(tokens))
        return best

    def build(self, kind: str, length: int) -> ContentTask:
        if kind not in KINDS:
            raise ValueError(f"unknown task kind {kind!r} (known: {', '.join(KINDS)})")
        if kind == "fact":
            return self._hidden("fact", length, *_fact(self.rng))
        if kind in ("qa", "summary"):
            return self._passage(length, kind)
        return self._facts(length) if kind == "facts" else self._copy(length)

    def _hidden(self, kind: str, length: int, hidden: str | list, question: str, answer: str,
                detail: str = "", depths=None, tail=None) -> ContentTask:  # fmt: skip
        """`hidden` (a sentence, or several at `depths`) at a random depth inside unrelated
        text, then `tail` (default: `question`, to answer briefly); the task's depth is the
        first sentence's."""
        hidden = [hidden] if isinstance(hidden, str) else hidden
        tail = tail or f"Question: {question} Answer briefly."
        depths = depths or [self.rng.choice(DEPTHS)]

        def make(budget):
            used = sum(map(self._count, hidden)) + self._count(question)
            filler = self._run(budget - used)
            at = [round(d * len(filler)) for d in depths]
            for a, h in sorted(zip(at, hidden), key=lambda x: -x[0]):  # the last first
                filler.insert(a, h)
            return f"{' '.join(filler)}\n\n{tail}", None

        tokens, _ = self._fit(length, make)
        return ContentTask(kind, length, tuple(tokens), answer, question, depths[0], detail)

    def _facts(self, length: int) -> ContentTask:
        facts = [_fact(self.rng, t) for t in self.rng.sample(FACT_TYPES, 3)]
        depths = self.rng.sample([d / 10 for d in range(1, 10)], 3)
        asked = self.rng.randrange(3)  # the task is the asked fact's, listed first
        order = [asked, *(i for i in range(3) if i != asked)]
        _, question, answer, ftype = facts[asked]
        return self._hidden("facts", length, [facts[i][0] for i in order], question, answer,
                            ftype, depths=[depths[i] for i in order])  # fmt: skip

    def _copy(self, length: int) -> ContentTask:
        near = [s for s in self._run(96) if 6 <= len(s.split()) <= 20 and _PLAIN.fullmatch(s)]
        # no plain sentence of a good size nearby: a fact statement instead
        sentence = self.rng.choice(near) if near else _fact(self.rng)[0]
        marked = f'Remember this sentence: "{sentence}"'
        question = "Repeat the sentence I asked you to remember, word for word."
        return self._hidden("copy", length, marked, question, sentence, tail=question)

    def _passage(self, length: int, kind: str) -> ContentTask:
        """A passage, then (qa) a question about one of its words or (summary) "summarize"."""

        def make(budget):
            passage = self._run(budget)
            question, word = "Summarize the text above in one sentence.", ""
            if kind == "qa":
                words = [
                    w for s in passage for w in _WORD.findall(s) if len(w) >= 6 and w.islower()
                ]
                word = self.rng.choice(words) if words else passage[0].split()[0]
                question = f'What does the text above say about "{word}"?'
            return f"{' '.join(passage)}\n\n{question}", (question, word)

        tokens, (question, word) = self._fit(length, make)
        return ContentTask(kind, length, tuple(tokens), "", question, None, word)


def build_tasks(tokenizer, texts: Sequence[str], lengths: Sequence[int], per_kind: int,
                kinds: Sequence[str] = DEFAULT_KINDS, seed: int = 0) -> list[ContentTask]:  # fmt: skip
    """`per_kind` tasks of every kind at every length, reproducible from `seed`."""
    builder = TaskBuilder(tokenizer, texts, seed)
    return [builder.build(k, n) for n in lengths for k in kinds for _ in range(per_kind)]
