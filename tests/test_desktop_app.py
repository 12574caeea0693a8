"""The desktop example (apps/desktop_chat.py) on Qt's offscreen platform: answer a message,
switch model, stop a generation; a screenshot is saved as a test artifact
($KVLINGO_ARTIFACTS, else the test's tmp dir)."""

import importlib.util
import os
import time
from pathlib import Path

from mlx_kvlingo import load
from mlx_kvlingo.models.files import save_translator
from mlx_kvlingo.models.pair import load_pair

import pytest
from helpers import exact_translator

pytest.importorskip("PySide6.QtWidgets")
os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")  # before the QApplication exists

from PySide6.QtCore import Qt, QTimer  # noqa: E402
from PySide6.QtTest import QTest  # noqa: E402
from PySide6.QtWidgets import QApplication  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def _load_app():
    spec = importlib.util.spec_from_file_location("desktop_chat", ROOT / "apps" / "desktop_chat.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def app_module():
    return _load_app()


@pytest.fixture(scope="module")
def qapp():
    return QApplication.instance() or QApplication([])


@pytest.fixture(scope="module")
def files(tiny_dir, tmp_path_factory):
    d = tmp_path_factory.mktemp("desktop")
    pair = load_pair(tiny_dir["qwen3"], tiny_dir["known"])
    answer = tiny_dir["known_answer"]
    inv = {
        "key_maps": [k.T for k in answer["key_maps"]],
        "value_maps": [v.T for v in answer["value_maps"]],
    }
    save_translator(exact_translator(pair, answer), d / "fwd.safetensors", pair)
    back = pair.reversed()
    save_translator(exact_translator(back, inv), d / "bwd.safetensors", back)
    return {
        "small": tiny_dir["qwen3"],
        "large": tiny_dir["known"],
        "translator": d / "fwd.safetensors",
        "backward_translator": d / "bwd.safetensors",
    }


def artifacts(tmp_path) -> Path:
    d = Path(os.environ.get("KVLINGO_ARTIFACTS") or tmp_path)
    d.mkdir(parents=True, exist_ok=True)
    return d


def wait_idle(qapp, window, timeout=30.0):
    t0 = time.monotonic()
    while window.busy or not window._queue.empty():
        assert time.monotonic() - t0 < timeout, "the window stayed busy"
        qapp.processEvents()
        time.sleep(0.005)
    qapp.processEvents()


def test_desktop_chat_answers_switches_and_stops(qapp, app_module, files, tmp_path):
    pair = load(**files)
    win = app_module.ChatWindow(pair, max_tokens=16, system_prompt="Be brief.")
    win.show()
    QTest.qWaitForWindowExposed(win)
    assert win.model == "large"  # as `kvlingo chat`: the large answers, the small reads for it

    # a message typed into the text box, sent with Enter, answered by the large model
    QTest.keyClicks(win.input, "def parse_args(argv):")
    QTest.keyClick(win.input, Qt.Key.Key_Return)
    assert win.busy and not win.send_button.isEnabled() and win.stop_button.isEnabled()
    wait_idle(qapp, win)
    large = win.last
    assert large is not None and large.model == "large" and large.handoff.text
    text = win.transcript.toPlainText()
    assert "you: def parse_args(argv):" in text and "large: " + large.handoff.text in text
    assert win.status.text().startswith("large (") and "tokens" in win.status.text()
    assert win.input.text() == "" and win.send_button.isEnabled()

    # switch the model; the small one answers from the translated cache
    win.model_box.setCurrentIndex(win.model_box.findData("small"))
    assert win.model == "small"
    win.input.setText("class Foo(object):")
    QTest.mouseClick(win.send_button, Qt.MouseButton.LeftButton)
    wait_idle(qapp, win)
    small = win.last
    assert small.model == "small" and small.handoff.text and small.handoff.switch.translated > 0
    assert "small: " + small.handoff.text in win.transcript.toPlainText()
    status = win.status.text()
    assert status.startswith("small (") and "translated" in status and "KV" in status

    shot = artifacts(tmp_path) / "desktop_chat.png"
    assert win.grab().save(str(shot))
    assert shot.stat().st_size > 5000
    print(f"\nscreenshot: {shot}")

    # Stop, pressed while the answer streams: ends after the current token, the pair is free
    win.max_tokens = 200
    win.set_model("small")
    win.send("print(x)")
    QTest.mouseClick(win.stop_button, Qt.MouseButton.LeftButton)
    wait_idle(qapp, win)
    assert win.last.finish_reason == "cancelled" and "stopped" in win.status.text()
    assert win.last.generation_tokens <= 2 and not pair.busy

    # Escalate: the last message answered again by the other model
    win.max_tokens = 8
    QTest.mouseClick(win.escalate_button, Qt.MouseButton.LeftButton)
    wait_idle(qapp, win)
    assert win.last.model == "large" and "escalating to large" in win.transcript.toPlainText()
    win.close()


def test_desktop_chat_scripted_headless(qapp, app_module, files, tmp_path, capsys):
    """`python apps/desktop_chat.py --ask ... --screenshot ...`: answers, saves, quits."""
    shot = artifacts(tmp_path) / "desktop_chat_scripted.png"
    argv = [f"--{k.replace('_', '-')}={v}" for k, v in files.items()]
    argv += ["-m", "8", "--ask", "hello", "--ask", "large:and now?", "--screenshot", str(shot)]
    QTimer.singleShot(60_000, qapp.quit)  # never hang the test run
    assert app_module.main(argv) == 0
    out = capsys.readouterr().out
    assert shot.is_file() and f"screenshot: {shot}" in out
    assert "large (" in out.splitlines()[-1]
