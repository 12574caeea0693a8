"""`kvlingo chat`: `mlx_lm.chat` (`q` / `r` / `h`, a status line per turn) over a `Conversation`."""

from __future__ import annotations

import shlex
import sys
from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING

from mlx_kvlingo.cli import _distributed as dist
from mlx_kvlingo.cli._common import (
    conversation_options,
    pair_options,
    progress_bar,
    sampling_options,
)

import click
from rich.console import Console
from rich.markup import escape
from rich.table import Table

if TYPE_CHECKING:
    from mlx_kvlingo.api import Conversation

#: turns this long or longer show a progress line while they are read
PROGRESS_MIN_TOKENS = 1000
# model output goes to a terminal: drop control characters (escape sequences, \r) but \n \t
_CONTROL = {c: None for c in [*range(32), 127] if chr(c) not in "\n\t"}

HELP = [
    ("/small, /large", "which model answers next (default: large, the small one reads)"),
    ("/reader [auto|tokens|small|self] [N]", "show or set who reads your turn for the large model "
     "(auto: whichever is predicted to answer sooner; tokens: the small one reads the opening and "
     "turns of N+ tokens)"),
    ("/file PATH [QUESTION]", "send a text file as your turn, the question after it (a paste "
     "arrives whole too, however long)"),
    ("/escalate", "answer the last message again with the other model (translated cache)"),
    ("/auto [on|off|T]", "cascade: small answers, large takes over below confidence T"),
    ("/mode [M]", "show or set: alternation | naive | reprefill"),
    ("/reset, r", "start over (the system prompt stays)"),
    ("/trim [N]", "drop the oldest turns until the conversation fits N tokens"),
    ("/save FILE, /load FILE", "the session (both caches and sync state)"),
    ("/stats", "tokens read, translated and generated, times and the estimated saving"),
    ("/help, h", "this list"),
    ("/quit, q", "exit (also Ctrl-D; Ctrl-C stops a generation, at the prompt it exits)"),
]  # fmt: skip


def describe_reader(conv) -> str:
    """What the conversation's reader policy does, in words."""
    p, kept = conv.policy, conv.cache.retention
    last = (f"; the large reads the last {p.large_reads_last} tok itself"
            if p.large_reads_last > 1 else "")  # fmt: skip
    if p.recompute_share:
        last += f" and recomputes {p.recompute_share:.0%} of the translated turn"
    rule = (f"the small model reads the opening and turns of {p.reader_min_tokens}+ tokens, "
            "the large one shorter turns")  # fmt: skip
    if p.reader == "auto" and kept is not None and p.min_retention:
        points = ", ".join(f"{r:.2f} at {n:,} tok" for n, r in kept.points)
        rule += (f", but the small path only where it keeps {p.min_retention:g}+ of the "
                 f"content at that length (measured: {points})")  # fmt: skip
    said = {
        "small": "the small model reads every turn, the large one decodes from the translated cache",
        "tokens": rule,
        "auto": f"whichever starts the answer sooner at the rates measured here; on a tie, {rule}",
    }.get(p.reader, "the answering model reads your turn itself")
    return said if p.reader == "self" else said + last


class ChatApp:
    """The chat loop over one `Conversation`, separated from click so it can be driven line by
    line. Models are "small" and "large"."""

    def __init__(self, conv: Conversation, *, max_tokens: int, sampling: dict | None = None,
                 auto_threshold: float, console: Console | None = None, first: str = "large"):  # fmt: skip
        self.conv = conv
        self.max_tokens = max_tokens
        self.sampling = sampling or {}  # those given; the rest per model
        self.next = first
        self.auto = False
        self.threshold = auto_threshold
        self.console = console or Console(highlight=False)
        self.names = conv.pair.names
        self._editor: Callable[[str], str] | None = None  # `input` or prompt_toolkit's
        self._reading: ExitStack | None = None  # a long turn's reading bar, open (`progress`)
        self._draw: Callable[..., None] = lambda *a: None

    def say(self, msg: str, style: str = "grey50") -> None:
        # soft wrap: a long status line stays one line (the terminal wraps it, rich does not)
        self.console.print(f"[{style}]{msg}[/{style}]", soft_wrap=True)

    def error(self, msg: str) -> None:
        self.console.print(f"[yellow]{escape(msg)}[/yellow]")

    def stream(self, events, cascade: bool = False) -> None:
        """Print a streamed answer (a cascade's: one or two, the verdict between), each with its
        status line; Ctrl-C stops it (the conversation keeps what was emitted)."""
        import mlx.core as mx

        mx.reset_peak_memory()
        speaker = None
        try:
            for r in events:
                self.progress(0, 0)  # the reading is over: clear its progress bar
                if r.token is not None:
                    if speaker != r.model:
                        speaker = r.model
                        self.console.print(f"[bold magenta]{r.model}[/bold magenta] ", end="")
                    sys.stdout.write(r.text.translate(_CONTROL))
                    sys.stdout.flush()
                if r.finish_reason is None:
                    continue
                speaker, st = None, r.handoff
                sys.stdout.write("\n")
                self.say("  " + escape(r.status))
                if not cascade or r.model != "small" or st is None:
                    continue
                if st.confidence is not None and r.finish_reason != "cancelled":
                    t = f"{self.threshold:.2f}"
                    verdict = f"< {t}: escalating to large" if st.escalating else f">= {t}: kept"
                    self.say(f"  {escape('[auto]')} confidence {st.confidence:.2f} {verdict}")
                if st.escalating:
                    mx.reset_peak_memory()
        except KeyboardInterrupt:
            events.close()
            self.progress(0, 0)
            sys.stdout.write("\n")
            self.say("  " + escape("[stopped]"))
            if (done := self.conv.last) is not None:  # the stopped answer (kept)
                self.say("  " + escape(done.status))

    def turn(self, text: str | None, escalate: bool = False) -> None:
        """Answer `text` (None: the message left unanswered) with the next model, by the cascade
        (model "auto") when /auto is on, or the last message again with the other model."""
        from mlx_kvlingo.api import ConversationError

        cascade = self.auto and not escalate
        what = {"escalate": True} if escalate else {"prompt": text, "model": "auto" if cascade else self.next}  # fmt: skip
        try:
            kw = {"max_tokens": self.max_tokens, **self.sampling, "auto_threshold": self.threshold}
            events = self.conv.send(**what, **kw, prompt_progress_callback=self.progress)
            self.stream(events, cascade=cascade)
        except ConversationError as e:
            self.error(str(e))

    def progress(self, done: int, total: int) -> None:
        """mlx-lm's prompt progress callback: a bar while a turn of `PROGRESS_MIN_TOKENS` or more
        is read, gone once the reading ends."""
        if total >= PROGRESS_MIN_TOKENS and done < total and self.console.is_terminal:
            if self._reading is None:
                self._reading = ExitStack()
                self._draw = self._reading.enter_context(progress_bar("  reading", self.console))
            self._draw(done, total, "tok (Ctrl-C stops)")
        elif self._reading is not None:
            self._reading.close()
            self._reading = None

    def handle(self, line: str) -> bool:
        """Process one input line; False means quit."""
        line = {"q": "/quit", "r": "/reset", "h": "/help"}.get(line.strip(), line.strip())
        if line in ("/quit", "/exit"):
            return False
        if line and not line.startswith("/"):
            self.turn(line)
        elif line:
            from mlx_kvlingo.api import ConversationError

            try:
                cmd, *args = shlex.split(line)
            except ValueError as e:
                self.error(f"cannot parse {line!r}: {e}")
                return True
            try:
                command(self, cmd, args)
            except ConversationError as e:  # context overflow, a bad session file, ...
                self.error(str(e))
            except (OSError, ValueError) as e:
                self.error(f"{cmd}: {e}")
        return True

    def prompt(self) -> str:
        """The next line: on a terminal prompt_toolkit's editor (a paste arrives whole, where
        `input()` keeps a line's first 4,095 characters), elsewhere `input()`."""
        if self._editor is None:
            self._editor = input
            if sys.stdin.isatty() and sys.stdout.isatty():
                from prompt_toolkit import PromptSession

                self._editor = PromptSession().prompt
        return self._editor(f"[{'auto' if self.auto else self.next}] > ")

    def run(self) -> None:
        while True:
            try:
                if not self.handle(self.prompt()):
                    break
            except (EOFError, KeyboardInterrupt):  # Ctrl-D; Ctrl-C outside a generation exits
                sys.stdout.write("\n")
                break
        self.say("bye")


def _rows(console: Console, rows: list, line: str) -> None:
    """`rows` of (key, value), the keys padded to one width, each printed as `line`."""
    w = max(len(k) for k, _ in rows)
    for k, v in rows:
        console.print(line.format(k=escape(k.ljust(w)), v=escape(v)))


def command(app: ChatApp, cmd: str, args: list[str]) -> None:
    """One slash command (`HELP`) on `app`; what it refuses it prints."""
    if cmd in ("/small", "/large"):
        app.next = cmd[1:]
        if app.auto:
            app.auto = False
            app.say("  auto: off")
        app.say(f"  next answers: {cmd[1:]} ({app.names[app.next]})")
    elif cmd == "/reset":
        app.conv.reset()
        app.say("  reset: context cleared", "green")
    elif cmd == "/help":
        _rows(app.console, HELP, "  [bold]{k}[/bold]  [grey50]{v}[/grey50]")
    elif cmd == "/file":
        if not args:
            app.error("/file takes a file's path (and a question after it)")
            return
        path = Path(args[0]).expanduser()
        text = path.read_text(encoding="utf-8").strip()
        if not text:
            app.error(f"/file: {path} is empty")
            return
        question = " ".join(args[1:])
        app.say(f"  {path}: {len(text):,} characters" + (" and your question" if question else ""))
        app.turn(text + (f"\n\n{question}" if question else ""))
    elif cmd == "/escalate":
        app.turn(None, escalate=True)
    elif cmd == "/auto":
        arg = args[0] if args else ("off" if app.auto else "on")
        if arg in ("on", "off"):
            app.auto = arg == "on"
        else:
            try:
                app.threshold = float(arg)
            except ValueError:
                app.error(f"/auto takes on, off or a threshold (a log-prob), not {arg!r}")
                return
            app.auto = True
        state = f"on, threshold {app.threshold:.2f}" if app.auto else "off"
        app.say(f"  auto: {state}")
    elif cmd == "/reader":
        if len(args) > 1 and not args[1].isdigit():
            app.error(f"/reader takes a token count after the policy, not {args[1]!r}")
            return
        if args:
            more = {"reader_min_tokens": int(args[1])} if len(args) > 1 else {}
            app.conv.policy = replace(app.conv.policy, reader=args[0], **more)
        app.say(f"  reader: {app.conv.policy.reader} ({describe_reader(app.conv)})")
    elif cmd == "/mode":
        if args:
            app.conv.mode = args[0]
        app.say(f"  mode: {app.conv.mode}")
    elif cmd == "/trim":
        n = int(args[0]) if args else None
        dropped = app.conv.trim(n)
        app.say(f"  trimmed: {dropped} oldest messages dropped, {app.conv.tokens} tokens left")
        if dropped and app.conv.cache.pending:  # the message that did not fit: answer it now
            app.turn(None)
    elif cmd in ("/save", "/load") and not args:
        app.error(f"usage: {cmd} FILE")
    elif cmd == "/save":
        app.say(f"  saved {app.conv.save(args[0])} ({app.conv.tokens} tokens)", "green")
    elif cmd == "/load":
        app.conv.load(args[0])
        app.say(f"  loaded {args[0]}: {len(app.conv.messages)} messages, {app.conv.tokens} tokens",
                "green")  # fmt: skip
    elif cmd == "/stats":
        print_stats(app)
    else:
        app.error(f"unknown command {cmd!r}; /help lists the commands")


def print_stats(app: ChatApp) -> None:
    """`/stats`: the totals in one line, then the counters per model in a table."""
    st = app.conv.cache.stats()
    t = Table("", "small", "large")
    app.say(
        f"  mode {st['mode']} · reader {st['reader']} · {st['conversation_tokens']} "
        f"conversation tokens · {st['switches']} switches · {st['retemplated']} re-templated · "
        f"estimated saving vs the large model reading itself {st['estimated_saving_ms']:.0f} ms"
    )
    rows = [("turns answered", "turns"), ("tokens generated", "generated_tokens"),
            ("tokens read answering", "prompt_tokens"), ("  ms", "prompt_ms"),
            ("tokens read for the other", "read_for_other_tokens"), ("  ms", "read_for_other_ms"),
            ("switches into", "switches_into"), ("tokens translated into", "translated_into"),
            ("  of which re-translated", "retranslated_into"), ("translation ms", "translate_ms"),
            ("tokens in cache", "held")]  # fmt: skip
    for label, key in rows:
        cells = [st["models"][m][key] for m in ("source", "target")]  # small, large
        t.add_row(label, *[f"{c:.1f}" if isinstance(c, float) else str(c) for c in cells])
    app.console.print(t)


def print_banner(app: ChatApp, forward: str, backward: str, loaded: str | None = None) -> None:
    """The opening lines: both models, the translators and the settings of the chat."""
    rows = [
        *app.names.items(),  # small, large
        ("small -> large", forward),
        ("large -> small", backward),
        ("mode", app.conv.mode),
        ("reader", f"{app.conv.policy.reader} ({describe_reader(app.conv)})"),
        ("answers", app.next),
        ("sampling", " · ".join(f"{k} {v}" for k, v in app.sampling.items()) or "each model's own"),
        ("max tokens", str(app.max_tokens)),
    ]
    if loaded:
        rows.append(("loaded in", loaded))
    if sp := app.conv.cache.system_prompt:
        rows.append(("system", sp if len(sp) <= 60 else sp[:57] + "..."))
    app.console.print("[bold magenta]kvlingo chat[/bold magenta]")
    _rows(app.console, rows, "  {k}   [bold]{v}[/bold]")
    app.say("  /help for commands · q to quit")


@click.command("chat", context_settings={"show_default": True})
@pair_options
@click.option("--system-prompt", help="System message for the chat template")
@click.option("-m", "--max-tokens", type=click.IntRange(1), default=256, help="Tokens per answer")
@sampling_options
@click.option("--max-kv-size", type=click.IntRange(1),
              help="Context limit in tokens for both models (refuses beyond it; /trim)")  # fmt: skip
@click.option("--answer", type=click.Choice(["small", "large"]), default="large",
              help="Which model answers (the small one reads for the large one; /small, /large)")  # fmt: skip
@conversation_options
@click.option("--warmup/--no-warmup", default=True,
              help="Before the first prompt, measure the pair's rates for reader auto, running "
                   "each path once (later starts reuse them from the cache folder and read "
                   "once per model)")  # fmt: skip
@dist.options
def chat_cmd(source, target, translator, demo_pair, backward_translator, system_prompt, max_tokens,
             sampling, max_kv_size, mode, answer, policy, warmup, auto_threshold, distributed,
             wire):  # fmt: skip
    """Chat with the pair: the large model answers, the small one reads for it (/small, /large)."""
    from mlx_kvlingo.api import Conversation

    console = Console(highlight=False)
    if not dist.wanted(distributed):
        console.print("[grey50]loading models...[/grey50]")
    pair = dist.pair_from_options(
        source, target, translator, backward_translator, demo_pair, distributed, wire
    )
    pipelined = pair.link is not None
    conv = Conversation(
        pair, max_kv_size, system_prompt=system_prompt, mode=mode, policy=policy(pair)
    )
    app = ChatApp(conv, max_tokens=max_tokens, sampling=sampling, auto_threshold=auto_threshold,
                  console=console, first=answer)  # fmt: skip
    loaded = None
    if warmup and not pipelined:
        console.print("[grey50]warming up (this pair's read rates)...[/grey50]")
        w = pair.warm_up(**sampling)
        loaded = f"{pair.load_s + w:.1f} s (warm-up {w:.1f} s, {pair.rates_note})"
    back = "demo" if pair.backward is not None else "none: switching back re-reads"
    print_banner(app, translator or "demo", backward_translator or back, loaded)
    if pipelined:
        app.say(f"  {dist.describe(pair)} · /save and /load are not available")
    with dist.rank_errors():
        app.run()
        pair.close()  # pipelined: releases the other ranks
