"""The terminal chat, driven through a real terminal (tmux send-keys / capture-pane)."""

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

from mlx_kvlingo.models.files import save_translator
from mlx_kvlingo.models.pair import load_pair

import pytest
from helpers import exact_translator

pytestmark = pytest.mark.skipif(shutil.which("tmux") is None, reason="tmux not installed")
ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def chat_args(tiny_dir, tmp_path_factory):
    d = tmp_path_factory.mktemp("chat")
    pair = load_pair(tiny_dir["qwen3"], tiny_dir["known"])
    answer = tiny_dir["known_answer"]
    inv = {
        "key_maps": [k.T for k in answer["key_maps"]],
        "value_maps": [v.T for v in answer["value_maps"]],
    }
    save_translator(exact_translator(pair, answer), d / "fwd.safetensors", pair)
    back = pair.reversed()
    save_translator(exact_translator(back, inv), d / "bwd.safetensors", back)
    return [
        "--source", str(tiny_dir["qwen3"]), "--target", str(tiny_dir["known"]),
        "--translator", str(d / "fwd.safetensors"),
        "--backward-translator", str(d / "bwd.safetensors"),
    ]  # fmt: skip


class Terminal:
    """One tmux server of our own (its own socket) running one command in a 200x50 pane."""

    def __init__(self, command: list[str], name: str):
        self.sock = f"kvlingo-test-{os.getpid()}-{name}"
        env = {**os.environ, "TERM": os.environ.get("TERM") or "xterm-256color"}
        line = " ".join(_quote(c) for c in command) + "; echo EXITED rc=$?; sleep 60"
        subprocess.run(self._tmux("new-session", "-d", "-s", "t", "-x", "200", "-y", "50", line),
                       check=True, env=env, cwd=ROOT)  # fmt: skip

    def _tmux(self, *args):
        return ["tmux", "-L", self.sock, *args]

    def send(self, *keys):
        subprocess.run(self._tmux("send-keys", "-t", "t", *keys), check=True)

    def type(self, text):
        self.send("-l", text)
        self.send("Enter")

    def screen(self) -> str:
        out = subprocess.run(self._tmux("capture-pane", "-p", "-J", "-S", "-", "-t", "t"),
                             capture_output=True, text=True, check=True)  # fmt: skip
        return out.stdout

    def wait(self, predicate, timeout=30.0) -> str:
        end = time.time() + timeout
        while time.time() < end:
            screen = self.screen()
            try:
                if predicate(screen):
                    return screen
            except IndexError:  # what the predicate splits on is not on the screen yet
                pass
            time.sleep(0.1)
        raise AssertionError(f"timed out; the screen shows:\n{self.screen()}")

    def close(self):
        subprocess.run(self._tmux("kill-server"), capture_output=True)


def _quote(s: str) -> str:
    return "'" + s.replace("'", "'\\''") + "'"


def prompts(screen: str) -> int:
    return sum(1 for line in screen.splitlines() if line.startswith(("[small] >", "[large] >",
                                                                     "[auto] >")))  # fmt: skip


def status_lines(screen: str) -> list[str]:
    return [ln.strip() for ln in screen.splitlines() if " tok/s · " in ln]


@pytest.fixture
def app(chat_args, request):
    terminals = []

    def start(*extra):
        cmd = [sys.executable, "apps/chat.py", *chat_args, *extra]
        t = Terminal(cmd, f"{request.node.name}-{len(terminals)}")
        terminals.append(t)
        t.wait(lambda s: prompts(s) >= 1, timeout=60)
        return t

    yield start
    for t in terminals:
        t.close()


def step(term, text, timeout=30.0) -> str:
    """Type a line and wait for the next prompt."""
    before = prompts(term.screen())
    term.type(text)
    return term.wait(lambda s: prompts(s) > before, timeout)


def test_answers_switches_escalates_and_quits(app):
    t = app("-m", "24", "--temp", "0", "--reader", "tokens", "--large-reads-last", "1")
    # the token rule: the large model answers and the small one reads the opening
    screen = t.screen()
    assert "reader" in screen and "loaded in" in screen and "warm-up" in screen
    screen = step(t, "hello there")
    (line,) = status_lines(screen)
    assert line.startswith("large (") and "small read" in line and "translated" in line
    assert "large read 1 tok" in line and "TTFT" in line
    assert "(large alone: TTFT ≈ " in line
    # a short later turn the large reads itself, says why and what the small reading would take
    screen = step(t, "what is json")
    line = status_lines(screen)[-1]
    assert "small read" not in line and "large read 1 tok" not in line
    assert "(reader tokens: the large reads turns under 64 tok)" in line
    assert "(small + translation: TTFT ≈ " in line
    screen = step(t, "/reader small")  # the small model reads every turn
    assert "reader: small (the small model reads every turn" in screen
    screen = step(t, "and yaml?")
    line = status_lines(screen)[-1]
    assert line.startswith("large (") and "small got the last answer translated" in line
    assert "small read" in line and "large read 1 tok" in line
    assert len(status_lines(screen)) == 3
    screen = step(t, "/reader auto x")
    assert "/reader takes a token count after the policy, not 'x'" in screen
    step(t, "/small")
    screen = step(t, "thanks")
    line = status_lines(screen)[-1]
    assert line.startswith("small (") and "translated" in line  # the large's answer, backward
    screen = step(t, "/escalate")  # the small answer is redone by large, from translated K/V
    line = status_lines(screen)[-1]
    assert line.startswith("large (") and "translated" in line
    screen = step(t, "/stats")
    assert "tokens read for the other" in screen and "estimated saving" in screen
    screen = step(t, "/reader self")
    assert "reader: self" in screen
    step(t, "/large")
    screen = step(t, "import os")
    line = status_lines(screen)[-1]
    assert (
        line.startswith("large (") and "small read" not in line and "large read 1 tok" not in line
    )
    screen = step(t, "/frobnicate")
    assert "unknown command '/frobnicate'" in screen
    screen = step(t, "/auto on")
    screen = step(t, "/auto -0.001")  # so high that the small answer escalates
    screen = step(t, "import sys")
    assert "escalating to large" in screen
    assert status_lines(screen)[-1].startswith("large (")
    t.type("q")
    screen = t.wait(lambda s: "EXITED" in s)
    assert "bye" in screen and "EXITED rc=0" in screen and "Traceback" not in screen


def test_ctrl_c_stops_generation_and_second_exits(app):
    t = app("-m", "100000", "--temp", "0")
    t.type("hello there")
    t.wait(lambda s: s.count("large ") >= 1 and len(s.split("hello there", 1)[1]) > 400)
    t.send("C-c")
    screen = t.wait(lambda s: prompts(s) >= 2)
    assert "[stopped]" in screen and "stopped" in status_lines(screen)[-1]
    step(t, "/small")
    t.type("continue")
    t.wait(lambda s: len(s.split("continue", 1)[1]) > 400)
    t.send("C-c")
    screen = t.wait(lambda s: prompts(s) >= 4)
    line = status_lines(screen)[-1]
    assert line.startswith("small (") and "translated" in line
    # both caches match the conversation: the small model holds all of it
    screen = step(t, "/stats")
    row = next(ln for ln in screen.splitlines() if "tokens in cache" in ln)
    conv = int(screen.rsplit("reader auto · ", 1)[1].split(" conversation tokens")[0])
    assert row.split("│")[2].strip() == str(conv)
    t.send("C-c")  # at the prompt: exit cleanly
    screen = t.wait(lambda s: "EXITED" in s)
    assert "bye" in screen and "EXITED rc=0" in screen and "Traceback" not in screen


def test_eof_exits_cleanly(app):
    t = app("-m", "8")
    t.send("C-d")
    screen = t.wait(lambda s: "EXITED" in s)
    assert "bye" in screen and "EXITED rc=0" in screen


def test_a_pasted_document_and_a_file_arrive_whole(app, tiny_dir, tmp_path):
    """A paste longer than a terminal line (4,095 characters in canonical mode) with line
    breaks arrives as one turn, whole (bracketed paste into the line editor); `/file` sends
    a file the same way, its question after it. The status line counts every token read."""
    import re

    tok = load_pair(tiny_dir["qwen3"], tiny_dir["known"]).tokenizer
    doc = "\n".join(f"Line {i}: the river rose slowly and the farmers moved the cattle uphill."
                    for i in range(70))  # fmt: skip
    assert len(doc) > 4095 and len(tok.encode(doc)) > 1000
    term = app("--reader", "self", "-m", "2")
    subprocess.run(term._tmux("set-buffer", "--", doc + "\nWhat rose?"), check=True)
    subprocess.run(term._tmux("paste-buffer", "-p", "-t", "t"), check=True)
    term.send("Enter")  # (the editor redraws the paste: count status lines, not prompts)
    screen = term.wait(lambda s: len(status_lines(s)) >= 1, timeout=120)
    read = [int(n) for n in re.findall(r"large read (\d+) tok", " ".join(status_lines(screen)))]
    assert read and read[-1] >= len(tok.encode(doc + "\nWhat rose?")), screen[-2000:]
    path = tmp_path / "doc.txt"
    path.write_text(doc)
    term.type(f"/file {path} What rose?")
    screen = term.wait(lambda s: len(status_lines(s)) >= 2, timeout=120)
    assert f"{len(doc):,} characters and your question" in screen
    # wait for the answer itself: the last turn's prompt may land after a step() counted prompts
    term.type(f"/file {tmp_path / 'missing.txt'}")
    screen = term.wait(lambda s: "No such file" in s or "Traceback" in s, timeout=30)
    assert "/file:" in screen and "No such file" in screen and "Traceback" not in screen


def test_reading_progress_is_mlx_lms_callback_drawn_once():
    """`ChatApp.progress(done, total)` is mlx-lm's prompt progress callback: a bar while a turn
    of PROGRESS_MIN_TOKENS or more is read, none for a short one, gone when the reading ends."""
    import io
    from types import SimpleNamespace

    from mlx_kvlingo.cli.chat import PROGRESS_MIN_TOKENS, ChatApp

    from rich.console import Console

    out = io.StringIO()
    console = Console(file=out, force_terminal=True, width=100)
    conv = SimpleNamespace(pair=SimpleNamespace(names={"small": "s", "large": "l"}))
    app = ChatApp(conv, max_tokens=8, auto_threshold=-1.5, console=console)
    app.progress(0, PROGRESS_MIN_TOKENS - 1)  # a short turn: nothing drawn
    assert app._reading is None and out.getvalue() == ""
    n = 2 * PROGRESS_MIN_TOKENS
    for done in (0, n // 2):
        app.progress(done, n)
    assert app._reading is not None
    app.progress(n, n)  # read: the bar goes
    assert app._reading is None and "reading" in out.getvalue()
    assert f"{n // 2:,}/{n:,} tok" in out.getvalue()
