"""Held conversations, matched to requests by templated token prefix (as mlx_lm.server reuses its
prompt cache), least recently used dropped first.

A held conversation C (messages m_1..m_n) serves a request R (r_1..r_N, r_N a user message) when

    n < N  and  template(m_1..m_n) == template(r_1..r_n)      (token ids, no generation prompt)

The longest such C wins, and only r_{n+1}..r_N are new to it; otherwise a new conversation starts
from R's history. A conversation is checked out while it answers and checked back in under its
new key; beyond `size` (0: no reuse) the least recently used is dropped with its caches.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

from mlx_kvlingo.api import Conversation, Pair, templated


class Pool:
    """Up to `size` held conversations over one pair, most recently used last."""

    def __init__(self, pair: Pair, size: int, **conversation_kwargs: Any) -> None:
        self.pair, self.size, self.tokenizer = pair, size, pair.tokenizer
        self._kwargs = conversation_kwargs  # Conversation keywords (mode, max_kv_size, ...)
        self._held: OrderedDict[Conversation, tuple[int, ...]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._held)

    def checkout(self, messages: list[dict[str, str]]
                 ) -> tuple[Conversation, list[dict[str, str]], int]:  # fmt: skip
        """The conversation to answer `messages` with, the history it still lacks (without the
        last user message), and how many of `messages` it already held (0: a new one)."""
        best, held = None, 0
        for conv, key in self._held.items():
            n, prefix = len(conv.messages), messages[: len(conv.messages)]
            if held < n < len(messages) and tuple(templated(self.tokenizer, prefix, False)) == key:
                best, held = conv, n
        if best is not None:
            del self._held[best]
            return best, messages[held:-1], held
        system = messages[0]["content"] if messages[0]["role"] == "system" else None
        conv = Conversation(self.pair, system_prompt=system, **self._kwargs)
        return conv, messages[1 if system is not None else 0 : -1], 0

    def checkin(self, conv: Conversation) -> None:
        """Hold `conv` for reuse under its current messages (dropping the least recently used)."""
        if self.size <= 0:
            return
        self._held[conv] = tuple(templated(self.tokenizer, conv.messages, False))
        self._held.move_to_end(conv)
        while len(self._held) > self.size:
            self._held.popitem(last=False)

    def clear(self) -> None:
        self._held.clear()
