"""Messages as chat-template tokens, appended to the conversation's one token list.

The conversation is `tokens`; `messages` are the role/content dicts it was templated from.
A new message is appended as the tokens the template adds (token diff, else text diff, else
re-tokenize and cut both caches to the common prefix). Mixed into `Session`."""

from __future__ import annotations

from collections.abc import Sequence

from mlx_kvlingo.conversation.records import ContextOverflowError, SessionError


def _common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


class Messages:
    """Appending, templating and trimming messages (state lives on `Session`)."""

    def add_user(self, text: str) -> list[int]:
        """Append a user message (and the template's generation prompt); return its tokens.

        An earlier user message that never got an answer (generation stopped before its first
        token) is replaced.
        """
        self._claim()
        if self.pending and self._user_start is not None:
            self._truncate(self._user_start)
            self.messages.pop()
        start = self._append_message({"role": "user", "content": text}, True)
        self._user_start = start
        return self.tokens[start:]

    def add_assistant(self, text: str) -> list[int]:
        """Append an answer given as text (history from elsewhere); return its tokens.

        Nothing reads it now: whichever model answers next catches up on it like any span it
        lacks. It cannot be escalated (no model produced it).
        """
        self._claim()
        if not self.pending:
            raise SessionError("an assistant message must follow a user message")
        start = self._append_message({"role": "assistant", "content": text}, False)
        self._answer = None
        self._user_start = None
        return self.tokens[start:]

    def add_tokens(self, tokens: Sequence[int]) -> None:
        """Append raw token ids to the conversation (no template; for tests and tools)."""
        self._claim()
        self.tokens.extend(int(t) for t in tokens)

    def _has_template(self) -> bool:
        tok = self.pair.tokenizer
        has = getattr(tok, "has_chat_template", None)
        return bool(getattr(tok, "chat_template", None)) if has is None else has

    def _template(self, messages: list[dict], generation_prompt: bool) -> list[int]:
        tok = self.pair.tokenizer
        if self._has_template():
            out = tok.apply_chat_template(messages, add_generation_prompt=generation_prompt)
            if not isinstance(out, list):  # BatchEncoding from some transformers versions
                out = out["input_ids"]
            return list(out)
        out: list[int] = []
        for i, m in enumerate(messages):  # no template: the contents, one line each
            out += tok.encode(m["content"] + "\n", add_special_tokens=i == 0)
        return out

    def _render(self, messages: list[dict], generation_prompt: bool) -> str | None:
        tok = self.pair.tokenizer
        if not self._has_template():
            return None
        return tok.apply_chat_template(
            messages, add_generation_prompt=generation_prompt, tokenize=False
        )

    def _append_message(self, message: dict, generation_prompt: bool) -> int:
        """Append `message` as the tokens the chat template adds; return where they start.

        1. token diff: the templated conversation extends the tokens so far;
        2. text diff: the templated text extends the decoded conversation (answers whose
           re-tokenization differs from the generated tokens), encode only the new text;
        3. otherwise re-tokenize everything and trim both caches to the common prefix.
        """
        messages = self.messages + [message]
        full = self._template(messages, generation_prompt)
        n = len(self.tokens)
        if full[:n] == self.tokens:
            self.tokens = full
            start = n
        else:
            new = self._text_diff(messages, generation_prompt)
            if new is not None:
                self.tokens = self.tokens + new
                start = n
            else:
                gp = message["role"] == "assistant"
                before = self._template(self.messages, gp) if self.messages else []
                common = _common_prefix(self.tokens, full)
                start = len(before) if full[: len(before)] == before else common
                self._truncate(common)
                self.tokens = full
                self.retemplated += 1
        self.messages.append(message)
        return start

    def _text_diff(self, messages: list[dict], generation_prompt: bool) -> list[int] | None:
        """The new message's tokens from the templated text, or None if that is not possible.

        After a generated answer, anchor on the answer's text: whatever the template puts
        after it (closing the turn, the new message) is encoded and appended, so answers
        whose re-tokenization differs from the generated tokens keep their cache.
        """
        tok = self.pair.tokenizer
        text = self._render(messages, generation_prompt)
        if text is None:
            return None
        last = self.messages[-1] if self.messages else None
        if self._answer is not None and last and last["role"] == "assistant" and last["content"]:
            prev = self._render(self.messages, False)
            pos = prev.rfind(last["content"])
            head = prev[: pos + len(last["content"])] if pos >= 0 else None
            if head is not None and text.startswith(head):
                tail = text[len(head) :]
                if self.tokens and self.tokens[-1] in tok.eos_token_ids:
                    eos = tok.decode([self.tokens[-1]])
                    tail = tail[len(eos) :] if eos and tail.startswith(eos) else tail
                return list(tok.encode(tail, add_special_tokens=False)) if tail else []
        done = tok.decode(self.tokens)
        if text.startswith(done) and len(text) > len(done):
            return list(tok.encode(text[len(done) :], add_special_tokens=False))
        return None

    def _truncate(self, n: int) -> None:
        """Cut the conversation to its first n tokens and both caches with it."""
        self.tokens = self.tokens[:n]
        for m in self._models.values():
            self._settle(m, min(m.held, n))
        if self._answer and self._answer[0] >= n:
            self._answer = None

    # -- keeping within the context ----------------------------------------------------------

    def trim(self, max_tokens: int | None = None) -> int:
        """Drop the oldest turns until the conversation fits in `max_tokens` tokens.

        Default: half of `max_kv_size`. The system prompt and the last message stay. Later
        tokens move to new positions, so both caches are cut to the prefix the shortened
        conversation shares with the old one (usually the system prompt) and the next
        answering model re-reads the rest. Returns the number of messages dropped.
        """
        self._claim()
        if max_tokens is None:
            if self.max_kv_size is None:
                raise SessionError("trim needs a token budget (or a session max_kv_size)")
            max_tokens = self.max_kv_size // 2
        head = (
            self.messages[:1] if self.messages[:1] and self.messages[0]["role"] == "system" else []
        )
        rest = self.messages[len(head) :]
        dropped = 0
        gp = bool(rest) and rest[-1]["role"] == "user"
        while len(rest) > 1 and len(self._template(head + rest, gp)) > max_tokens:
            rest = rest[1:]
            dropped += 1
            while len(rest) > 1 and rest[0]["role"] != "user":  # start on a user turn
                rest = rest[1:]
                dropped += 1
        if not dropped:
            return 0
        full = self._template(head + rest, gp)
        if len(full) > max_tokens:
            raise ContextOverflowError(
                f"even the last message alone is {len(full)} tokens, over the {max_tokens} budget"
            )
        self._truncate(_common_prefix(self.tokens, full))
        self.tokens = full
        self.messages = head + rest
        self._answer = None
        self._user_start = None
        if gp:  # the kept last message awaits its answer
            before = self._template(head + rest[:-1], False) if head or rest[:-1] else []
            if full[: len(before)] == before:
                self._user_start = len(before)
        return dropped
