"""A desktop chat window that embeds mlx-kvlingo through its public API (Qt, via PySide6).

    python apps/desktop_chat.py                     # the demo pair
    python apps/desktop_chat.py --small S --large L --translator F [--backward-translator B]
    QT_QPA_PLATFORM=offscreen python apps/desktop_chat.py --ask "Hi" --ask "large:More?" \\
        --screenshot chat.png                        # headless: answer, save a screenshot, quit

A text box, a small/large model switch (large by default: the small model reads for it), the
answer streamed into the window, Stop, Escalate (answer the last message again with the other
model) and the per-turn status line. Only `mlx_kvlingo`'s public API is used. Generation runs on
a worker thread, which puts responses on a queue; a timer on the UI thread drains it, so the
window never blocks. Stop calls `Conversation.cancel()`, which is safe from any thread.
"""

from __future__ import annotations

import argparse
import os
import queue
import sys
import threading
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

from mlx_kvlingo import Conversation, GenerationResponse, load
from mlx_kvlingo.api import Pair

from PySide6.QtCore import QTimer
from PySide6.QtGui import QColor, QFont, QTextCharFormat, QTextCursor
from PySide6.QtWidgets import (
    QApplication,
    QComboBox,
    QHBoxLayout,
    QLabel,
    QLineEdit,
    QMainWindow,
    QPushButton,
    QTextEdit,
    QVBoxLayout,
    QWidget,
)

_END = object()  # the worker's last item on the queue
COLORS = {"you": "#1f5fbf", "small": "#2e8b57", "large": "#8e3fb3"}


def _short(name: str) -> str:
    """A model's display name: the folder name for a local path, else the hub id."""
    return Path(name).name if Path(name).exists() else name


def _size(n: int) -> str:
    return f"{n / 1e9:.2f} GB" if n >= 1e8 else f"{n / 1e6:.1f} MB"


class ChatWindow(QMainWindow):
    """One conversation over `pair`, in a window."""

    def __init__(
        self,
        pair: Pair,
        *,
        max_tokens: int = 256,
        sampling: dict[str, Any] | None = None,  # e.g. {"temp": 0}; None: the model's defaults
        system_prompt: str | None = None,
    ) -> None:
        super().__init__()
        self.pair = pair
        self.conversation = Conversation(pair, system_prompt=system_prompt)
        self.max_tokens = max_tokens
        self.sampling = dict(sampling or {})  # the settings to change, the rest the model's own
        self.busy = False
        self.last: GenerationResponse | None = None  # the last answer's last response
        self.on_idle: Callable[[], None] | None = None  # called when a turn has ended
        self._queue: queue.Queue[object] = queue.Queue()
        self._speaker: str | None = None  # whose answer is being streamed

        names = {k: _short(v) for k, v in pair.names.items()}
        self.setWindowTitle(f"kvlingo chat · small: {names['small']} · large: {names['large']}")
        self.transcript = QTextEdit(readOnly=True)
        self.transcript.setFont(QFont("DejaVu Sans", 11))
        self.input = QLineEdit(placeholderText="Type a message, Enter to send")
        self.input.returnPressed.connect(self.send)
        self.model_box = QComboBox()
        for label in ("large", "small"):  # large first: the small model reads for it
            self.model_box.addItem(f"{label} · {names[label]}", label)
        self.model_box.setToolTip("which model answers the next message")
        self.send_button = QPushButton("Send")
        self.send_button.clicked.connect(self.send)
        self.stop_button = QPushButton("Stop")
        self.stop_button.clicked.connect(self.stop)
        self.escalate_button = QPushButton("Escalate")
        self.escalate_button.setToolTip("answer the last message again with the other model")
        self.escalate_button.clicked.connect(self.escalate)
        self.status = QLabel("ready")
        self.status.setWordWrap(True)
        self.status.setStyleSheet("color: #555;")
        self.status.setMinimumHeight(2 * self.status.fontMetrics().lineSpacing() + 4)

        row = QHBoxLayout()
        row.addWidget(self.input, 1)
        row.addWidget(QLabel("model"))
        row.addWidget(self.model_box)
        row.addWidget(self.send_button)
        row.addWidget(self.stop_button)
        row.addWidget(self.escalate_button)
        box = QVBoxLayout()
        box.addWidget(self.transcript, 1)
        box.addLayout(row)
        box.addWidget(self.status)
        central = QWidget()
        central.setLayout(box)
        self.setCentralWidget(central)
        self.resize(900, 520)

        self._timer = QTimer(self)
        self._timer.setInterval(20)
        self._timer.timeout.connect(self._drain)
        self._timer.start()
        self._set_busy(False)

    # -- actions (UI thread) ---------------------------------------------------------------

    @property
    def model(self) -> str:
        return str(self.model_box.currentData())

    def set_model(self, label: str) -> None:
        self.model_box.setCurrentIndex(self.model_box.findData(label))

    def send(self, text: str | None = None) -> None:
        text = self.input.text() if not isinstance(text, str) else text
        if self.busy or not text.strip():
            return
        self.input.clear()
        self._write("you", text)
        self._start(
            self.model,
            self.conversation.send(text, self.model, max_tokens=self.max_tokens, **self.sampling),
        )

    def escalate(self) -> None:
        if self.busy or self.last is None:
            return
        other = "large" if self.last.model == "small" else "small"
        self._write_note(f"escalating to {other}: answering the last message again")
        self._start(
            other,
            self.conversation.send(
                None, other, escalate=True, max_tokens=self.max_tokens, **self.sampling
            ),
        )

    def stop(self) -> None:
        self.conversation.cancel()  # thread-safe; the worker ends after its current token

    # -- the worker ------------------------------------------------------------------------

    def _start(self, model: str, events: Iterator[GenerationResponse]) -> None:
        self._set_busy(True)
        self._speaker = None
        self.status.setText(f"{model} is answering...")
        threading.Thread(target=self._work, args=(events,), daemon=True).start()

    def _work(self, events: Iterator[GenerationResponse]) -> None:
        try:
            for ev in events:
                self._queue.put(ev)
        except Exception as e:  # noqa: BLE001 - shown in the window
            self._queue.put(e)
        finally:
            self._queue.put(_END)

    def _drain(self) -> None:
        while True:
            try:
                item = self._queue.get_nowait()
            except queue.Empty:
                return
            if item is _END:
                self._set_busy(False)
                if self.on_idle is not None:
                    self.on_idle()
            elif isinstance(item, Exception):
                self.status.setText(f"error: {item}")
            elif isinstance(item, GenerationResponse):
                if item.token is not None:
                    if self._speaker != item.model:
                        self._speaker = item.model
                        self._write(item.model, "")
                    self._append(item.text)
                if item.finish_reason is not None:  # the answer's last response
                    self.last = item
                    mem = self.pair.memory()
                    self.status.setText(
                        f"{item.status}  |  weights {_size(mem['small'] + mem['large'])} · "
                        f"KV {_size(mem['kv'])} · active {_size(mem['active'])}"
                    )

    # -- the transcript --------------------------------------------------------------------

    def _set_busy(self, busy: bool) -> None:
        self.busy = busy
        self.send_button.setEnabled(not busy)
        self.escalate_button.setEnabled(not busy and self.last is not None)
        self.stop_button.setEnabled(busy)
        self.model_box.setEnabled(not busy)

    def _cursor(self) -> QTextCursor:
        cur = self.transcript.textCursor()
        cur.movePosition(QTextCursor.MoveOperation.End)
        return cur

    def _write(self, who: str, text: str) -> None:
        cur = self._cursor()
        if not self.transcript.document().isEmpty():
            cur.insertText("\n\n", QTextCharFormat())
        label = QTextCharFormat()
        label.setFontWeight(QFont.Weight.Bold)
        label.setForeground(QColor(COLORS.get(who, "#000")))
        cur.insertText(f"{who}: ", label)
        cur.insertText(text, QTextCharFormat())
        self.transcript.setTextCursor(cur)

    def _append(self, text: str) -> None:
        cur = self._cursor()
        cur.insertText(text, QTextCharFormat())
        self.transcript.setTextCursor(cur)
        self.transcript.ensureCursorVisible()

    def _write_note(self, text: str) -> None:
        cur = self._cursor()
        note = QTextCharFormat()
        note.setForeground(QColor("#888"))
        note.setFontItalic(True)
        cur.insertText(f"\n\n[{text}]", note)


def run_script(window: ChatWindow, asks: Sequence[str], screenshot: str | None) -> None:
    """Answer each `[small:|large:]TEXT` in turn, save a screenshot, close the window."""
    pending = list(asks)

    def next_step() -> None:
        if pending:
            text = pending.pop(0)
            model, sep, rest = text.partition(":")
            if sep and model in ("small", "large"):
                window.set_model(model)
                text = rest
            window.send(text)
        else:
            QTimer.singleShot(100, finish)  # let the layout settle around the last status

    def finish() -> None:
        if screenshot:
            Path(screenshot).parent.mkdir(parents=True, exist_ok=True)
            window.grab().save(screenshot)
            print(f"screenshot: {screenshot}")
        if window.last is not None:
            print(window.last.status)
        window.close()

    window.on_idle = next_step
    QTimer.singleShot(0, next_step)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--small", help="small model (hub id or folder); default: the demo pair")
    p.add_argument("--large", help="large model (hub id or folder)")
    p.add_argument("--translator", help="small -> large translator file")
    p.add_argument("--backward-translator", help="large -> small translator file")
    p.add_argument("--system-prompt", default=None)
    p.add_argument("-m", "--max-tokens", type=int, default=256)
    p.add_argument("--temp", type=float, default=None, help="default: the model's own (0: greedy)")
    p.add_argument("--ask", action="append", default=[],
                   help="send this message ('large:...' picks the model), then quit; repeatable")  # fmt: skip
    p.add_argument("--screenshot", help="with --ask: save the window as this PNG at the end")
    args = p.parse_args(argv)

    print("loading models...", file=sys.stderr)
    pair = load(args.small, args.large, args.translator, args.backward_translator)
    app = QApplication.instance() or QApplication(sys.argv[:1])
    window = ChatWindow(
        pair,
        max_tokens=args.max_tokens,
        sampling={"temp": args.temp} if args.temp is not None else None,  # None: the model's
        system_prompt=args.system_prompt,
    )
    window.show()
    if args.ask:
        run_script(window, args.ask, args.screenshot)
    app.exec()
    return 0


if __name__ == "__main__":
    if "--ask" in sys.argv and not os.environ.get("DISPLAY") and sys.platform == "linux":
        os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")  # scripted runs work headless
    sys.exit(main())
