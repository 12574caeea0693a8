"""The public API (mlx_kvlingo.load / stream_generate / Conversation) on the known-answer tiny
pair: streaming, cancellation from another thread, one generation at a time per pair,
save/restore, memory, the README embedding example, and mypy on the public modules."""

import queue
import re
import subprocess
import sys
import threading
import time
from dataclasses import replace
from pathlib import Path

import mlx_kvlingo
from mlx_kvlingo import (
    BusyError,
    Conversation,
    ConversationError,
    GenerationResponse,
    generate,
    load,
    load_prompt_cache,
    make_prompt_cache,
    save_prompt_cache,
)
from mlx_kvlingo import stream_generate as kv_stream_generate
from mlx_kvlingo.config import PolicyError, ReaderPolicy
from mlx_kvlingo.models.files import save_translator
from mlx_kvlingo.models.pair import load_pair

import mlx.core as mx
import pytest
from helpers import exact_translator, inverse
from mlx_lm import stream_generate

ROOT = Path(__file__).resolve().parents[1]
HEADING = "## Embedding in your app"
N = 12
MSG = ["def parse_args(argv):", "class Foo(object):", "import json\nimport os", "print(x)"]


@pytest.fixture(scope="module")
def files(tiny_dir, tmp_path_factory):
    """The tiny pair's folders and exact translator files, both directions."""
    d = tmp_path_factory.mktemp("api")
    pair = load_pair(tiny_dir["qwen3"], tiny_dir["known"])
    answer = tiny_dir["known_answer"]
    save_translator(exact_translator(pair, answer), d / "fwd.safetensors", pair)
    back = pair.reversed()
    save_translator(exact_translator(back, inverse(answer)), d / "bwd.safetensors", back)
    return {
        "small": tiny_dir["qwen3"],
        "large": tiny_dir["known"],
        "translator": d / "fwd.safetensors",
        "backward_translator": d / "bwd.safetensors",
    }


@pytest.fixture(scope="module")
def runtime(files):
    return load(**files)


def native(runtime, role, tokens, n=N):
    """What `role`'s model alone says after reading `tokens` itself (greedy)."""
    loaded = runtime.models.source if role == "small" else runtime.models.target
    out = stream_generate(loaded.model, runtime.tokenizer, mx.array(tokens), max_tokens=n)
    return [r.token for r in out]


def ask(conv, *args, **kwargs) -> GenerationResponse:
    """An answer's last response (its record and status)."""
    *_, done = conv.send(*args, **kwargs)
    assert done.finish_reason is not None and done.handoff is not None
    return done


def assert_consistent(conv: Conversation):
    s = conv.cache
    for role in ("source", "target"):
        assert all(c.offset == s.held(role) for c in s.cache(role))
        assert s.held(role) <= len(s.tokens)


def test_import_is_cheap_and_lazy():
    code = (
        "import sys, mlx_kvlingo\n"
        "assert not any(m == 'mlx' or m.startswith('mlx.') for m in sys.modules)\n"
        "from mlx_kvlingo import load, __version__\n"
        "assert 'mlx.core' in sys.modules and load.__module__ == 'mlx_kvlingo.api'\n"
        "print(__version__)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    pyproject = (ROOT / "pyproject.toml").read_text()
    version = re.search(r'^version = "(.+)"', pyproject, re.M).group(1)
    assert out.stdout.strip() == mlx_kvlingo.__version__ == version
    assert set(mlx_kvlingo.__all__) <= set(dir(mlx_kvlingo)) and len(mlx_kvlingo.__all__) <= 12
    with pytest.raises(AttributeError):
        mlx_kvlingo.NoSuchThing  # noqa: B018


def test_streaming_events_and_switch(runtime):
    conv = Conversation(runtime, system_prompt="Be brief.")
    events = list(conv.send(MSG[0], model="small", max_tokens=N, temp=0))
    assert all(isinstance(e, GenerationResponse) for e in events)
    *tokens, done = events
    assert tokens and all(e.finish_reason is None and e.model == "small" for e in tokens)
    assert done.model == "small" and done.token is not None and conv.last.handoff is done.handoff
    st = done.handoff
    assert st.text == "".join(e.text for e in events)
    assert done.finish_reason in ("stop", "length")
    assert st.generation_tokens == done.generation_tokens == len(events) and st.switch is None
    assert [e.generation_tokens for e in events] == list(range(1, len(events) + 1))
    assert done.logprobs.shape[-1] > 1 and done.prompt_tokens == st.prompt_tokens > 0
    assert done.status.startswith("small (") and f"{len(events)} tokens" in done.status
    assert st.confidence is not None and st.confidence <= 0
    assert conv.messages[-1] == {"role": "assistant", "content": st.text}

    # the large model takes over from a translated cache and says what it would say alone
    stream = conv.send(MSG[1], model="large", max_tokens=N, temp=0)
    n0 = None
    toks = []
    for ev in stream:
        if n0 is None:
            n0 = len(conv.cache.tokens)  # the generator has added the message by now
        toks.append(ev.token)
    done = conv.last
    assert done.model == "large" and done.handoff.switch.translated > 0
    assert done.handoff.switch.lacked == done.handoff.switch.translated
    assert "translated" in done.status
    assert toks == native(runtime, "large", conv.cache.tokens[:n0])
    assert_consistent(conv)
    with pytest.raises(ConversationError, match="unknown model"):
        conv.send("x", model="medium")


def test_mlx_lm_shaped_functions(runtime, tmp_path):
    """`stream_generate` / `generate` over a prompt cache, saved and loaded as mlx-lm's are: a
    str is a templated user turn, a token list is read as it is; the same answer either way."""
    cache = make_prompt_cache(runtime, system_prompt="Be brief.")
    text = generate(runtime, MSG[0], prompt_cache=cache, max_tokens=N, temp=0)
    assert cache.messages[-1] == {"role": "assistant", "content": text} and text
    path = save_prompt_cache(tmp_path / "c", cache)
    back = load_prompt_cache(path, runtime)
    assert back.messages == cache.messages and back.tokens == cache.tokens
    a = list(kv_stream_generate(runtime, MSG[1], cache, model="small", max_tokens=N, temp=0))
    b = list(kv_stream_generate(runtime, MSG[1], back, model="small", max_tokens=N, temp=0))
    assert [r.token for r in a] == [r.token for r in b] and a[-1].handoff.switch.translated > 0
    ids = runtime.tokenizer.encode("def parse_args(argv):")
    raw = list(kv_stream_generate(runtime, ids, max_tokens=N, temp=0, reader="self"))
    assert [r.token for r in raw] == native(runtime, "large", ids)
    seen = []
    cb = lambda done, total: seen.append((done, total))  # noqa: E731
    generate(runtime, ids, prompt_progress_callback=cb, max_tokens=2, reader="self")
    assert seen and seen[-1][0] == seen[-1][1] == len(ids)  # mlx-lm's callback, the large's read
    with pytest.raises(TypeError, match="prompt must be"):
        kv_stream_generate(runtime, 3)


def test_cancel_mid_stream_from_another_thread(runtime):
    conv = Conversation(runtime)
    got: queue.Queue = queue.Queue()
    go = threading.Event()

    def worker():
        for i, ev in enumerate(conv.send(MSG[0], model="small", max_tokens=64)):
            got.put(ev)
            if i == 1:
                go.wait(10)  # hold here until the main thread has cancelled

    th = threading.Thread(target=worker)
    th.start()
    first = [got.get(timeout=20), got.get(timeout=20)]
    assert all(e.finish_reason is None for e in first)
    conv.cancel()  # from this (another) thread
    go.set()
    th.join(20)
    rest = []
    while not got.empty():
        rest.append(got.get())
    done = rest[-1]
    assert done.finish_reason == "cancelled" and done.token is not None
    assert "stopped" in done.status
    assert len(first) + len(rest) <= 3  # stopped right after the token it was on
    assert done.handoff.text == "".join(e.text for e in first + rest)
    assert not runtime.busy
    assert_consistent(conv)
    # the next turn works and is exact: the large model continues from the kept partial answer
    n0 = None
    toks = []
    for ev in conv.send(MSG[1], model="large", max_tokens=N, temp=0):
        n0 = n0 or len(conv.cache.tokens)
        toks.append(ev.token)
    assert toks == native(runtime, "large", conv.cache.tokens[:n0])
    assert conv.last.finish_reason in ("stop", "length")
    assert_consistent(conv)


def test_one_generation_at_a_time(runtime):
    a, b = Conversation(runtime), Conversation(runtime)
    stream = a.send(MSG[0], model="small", max_tokens=N, temp=0)
    assert next(stream).finish_reason is None and runtime.busy
    errors: list = []

    def in_thread(fn):
        th = threading.Thread(target=lambda: _catch(errors, fn))
        th.start()
        th.join(20)

    # refused at once with wait=False, or after the timeout
    in_thread(lambda: next(b.send(MSG[1], wait=False)))
    in_thread(lambda: next(b.send(MSG[1], timeout=0.2)))
    in_thread(lambda: b.save("never", wait=False))
    assert [type(e) for e in errors] == [BusyError] * 3
    # the same thread asking for another conversation would deadlock: refused
    with pytest.raises(BusyError, match="another conversation"):
        next(b.send(MSG[1]))
    assert b.messages == [] and b.tokens == 0  # nothing reached the refused conversation

    # wait=True (the default) serializes: b starts only after a has finished
    order: list = []

    def waiter():
        for ev in b.send(MSG[1], model="large", max_tokens=4):
            order.append(("b", ev.finish_reason, time.monotonic()))

    th = threading.Thread(target=waiter)
    th.start()
    time.sleep(0.3)
    assert order == [] and th.is_alive()  # still waiting for the pair
    for ev in stream:
        order.append(("a", ev.finish_reason, time.monotonic()))
    th.join(20)
    assert not th.is_alive()
    a_done = next(t for who, kind, t in order if who == "a" and kind is not None)
    assert all(t >= a_done for who, _, t in order if who == "b")
    assert b.last.finish_reason in ("stop", "length")
    assert_consistent(a)
    assert_consistent(b)

    # a waiting send that is cancelled ends with one cancelled event, the conversation as it was
    hold = a.send(MSG[2], max_tokens=N, temp=0)
    next(hold)
    seen: list = []
    waiting = b.send(MSG[3])
    th = threading.Thread(target=lambda: seen.extend(waiting))
    th.start()
    time.sleep(0.2)
    before = b.messages
    b.cancel()
    th.join(20)
    assert [(e.token, e.finish_reason) for e in seen] == [(None, "cancelled")]
    assert b.messages == before
    hold.close()  # an early close keeps what was emitted and frees the pair
    assert not runtime.busy and a.last is not None

    # the same thread starting a new turn on the same conversation ends its unfinished stream
    s1 = a.send(MSG[0], max_tokens=N, temp=0)
    first = next(s1)
    events = list(a.send(MSG[1], model="large", max_tokens=4))
    assert events[-1].finish_reason is not None
    assert [m["role"] for m in a.messages[-4:]] == ["user", "assistant", "user", "assistant"]
    assert a.messages[-3]["content"].startswith(first.text)
    assert_consistent(a)


def _catch(errors, fn):
    try:
        fn()
    except Exception as e:  # noqa: BLE001
        errors.append(e)


def test_save_restore_escalate_memory(runtime, tmp_path):
    conv = Conversation(runtime, system_prompt="Be brief.")
    small = ask(conv, MSG[0], "small", max_tokens=N, temp=0)
    done = list(conv.send(escalate=True, max_tokens=N, temp=0))[-1]
    assert done.model == "large" and done.handoff is not None
    assert conv.messages[-1]["content"] == done.handoff.text
    assert len([m for m in conv.messages if m["role"] == "assistant"]) == 1
    assert small.handoff.text != done.handoff.text or small.model != done.model
    path = conv.save(tmp_path / "chat")
    assert path.name == "chat.safetensors"
    back = Conversation(runtime, prompt_cache=load_prompt_cache(path, runtime))
    assert back.messages == conv.messages and back.tokens == conv.tokens
    assert back.messages[0] == {"role": "system", "content": "Be brief."}
    # the same next turn from the original and the restored conversation
    a = ask(conv, MSG[1], "small", max_tokens=N, temp=0)
    b = ask(back, MSG[1], "small", max_tokens=N, temp=0)
    assert a.handoff.text == b.handoff.text
    assert a.handoff.switch.translated == b.handoff.switch.translated > 0
    conv.reset()
    assert conv.messages == [{"role": "system", "content": "Be brief."}]
    with pytest.raises(ConversationError, match="nothing to escalate"):
        list(conv.send(escalate=True))
    assert not runtime.busy  # a refused request releases the pair

    mem = runtime.memory()
    assert mem["small"] > 0 and mem["large"] > 0 and mem["translators"] > 0
    assert mem["kv"] > 0 and mem["conversations"] >= 2
    assert mem["active"] >= mem["small"] + mem["large"]
    assert runtime.names == {"small": str(runtime.models.source.name),
                             "large": str(runtime.models.target.name)}  # fmt: skip
    with pytest.raises(ValueError, match="both source and target"):
        load(small="x")


def readme_example() -> str:
    """The python block under the README's embedding heading; it must equal
    tests/readme_example.py (which mypy checks)."""
    example = (ROOT / "tests" / "readme_example.py").read_text()
    readme = (ROOT / "README.md").read_text()
    assert HEADING in readme, f"no {HEADING!r} in README.md"
    block = re.search(r"```python\n(.*?)```", readme.split(HEADING, 1)[1], re.S)
    assert block, f"no python block under {HEADING!r} in README.md"
    assert block.group(1).strip() == example.strip(), (
        "README example and tests/readme_example.py differ"
    )
    return block.group(1)


def test_readme_example_runs(files, monkeypatch, tmp_path, capsys):
    """The ten-line example, run as written, with the demo pair swapped for the tiny one."""
    from mlx_kvlingo.models.demo import pair as demo

    defaults = {"forward": str(files["translator"]), "backward": str(files["backward_translator"])}
    monkeypatch.setattr(demo, "demo_models", lambda pair="dense", source=None: (files["small"], files["large"]))  # fmt: skip
    monkeypatch.setattr(demo, "manifest", lambda pair="dense": {"default": defaults})
    monkeypatch.chdir(tmp_path)
    code = readme_example()
    assert len(code.strip().splitlines()) <= 10
    exec(compile(code, "README example", "exec"), {"__name__": "__main__"})
    out = capsys.readouterr().out
    # reader "auto": the large reads the opening itself or the small reads it (translated),
    # whichever this machine's measured rates predict sooner; the status line shows the other
    assert re.search(r"\[small \(.*tokens", out) and re.search(r"\[large \(.*TTFT", out)
    assert re.search(r"\[large \(.*(small \+ translation|large alone): TTFT ≈ ", out)
    assert (tmp_path / "chat.safetensors").is_file()


# Our modules are followed (silently: only the public ones must be clean and fully annotated);
# third-party packages are skipped, which keeps a cold run to seconds instead of minutes.
MYPY_INI = """
[mypy]
ignore_missing_imports = True
follow_imports = silent

[mypy-mlx_kvlingo,mlx_kvlingo.api]
disallow_untyped_defs = True
disallow_incomplete_defs = True

[mypy-mlx.*,mlx_lm.*,numpy.*,rich.*,click.*,safetensors.*,huggingface_hub.*,transformers.*,matplotlib.*,tokenizers.*,jinja2.*,PySide6.*,shiboken6.*]
follow_imports = skip
"""
PUBLIC = ["mlx_kvlingo/__init__.py", "mlx_kvlingo/api.py", "tests/readme_example.py",
          "apps/desktop_chat.py"]  # fmt: skip


def test_public_api_typechecks(tmp_path):
    """mypy on the public modules, and on the README example and desktop app as their users."""
    pytest.importorskip("mypy")
    ini = tmp_path / "mypy.ini"
    ini.write_text(MYPY_INI)
    cache = ROOT / ".pytest_cache" / "mypy"
    out = subprocess.run(
        [sys.executable, "-m", "mypy", "--config-file", str(ini), "--cache-dir", str(cache),
         "--no-error-summary", *PUBLIC],
        capture_output=True, text=True, cwd=ROOT,
    )  # fmt: skip
    assert out.returncode == 0, out.stdout + out.stderr


def test_add_messages_history_then_answer(runtime):
    """History from elsewhere is appended unread; the next answer catches up on all of it."""
    conv = Conversation(runtime, system_prompt="Be brief.")
    conv.add_messages([{"role": "user", "content": MSG[0]}, {"role": "assistant", "content": "ok"}])
    s = conv.cache
    assert s.held("source") == s.held("target") == 0 and not s.pending
    done = ask(conv, MSG[1], model="small", max_tokens=N, temp=0)
    n = len(s.tokens) - done.generation_tokens
    reference = runtime.tokenizer.apply_chat_template(
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": MSG[0]},
         {"role": "assistant", "content": "ok"}, {"role": "user", "content": MSG[1]}],
        add_generation_prompt=True,
    )  # fmt: skip
    assert s.tokens[:n] == list(reference)
    assert [t for t in s.tokens[n:]] == native(runtime, "small", reference)[: len(s.tokens) - n]
    assert_consistent(conv)
    with pytest.raises(ConversationError, match="role"):
        conv.add_messages([{"role": "tool", "content": "x"}])
    with pytest.raises(ConversationError, match="must follow a user message"):
        conv.add_messages([{"role": "assistant", "content": "x"}])


def test_reader_policy_through_the_api(runtime):
    """`reader`, `reader_min_tokens` and `large_reads_last` on a Conversation: auto by default
    (by time, measured by the warm-up at load); the token rule has the small model read the
    opening turn, the large a short later one; bad values raise ConversationError."""
    from mlx_kvlingo.conversation.reader import costs_of

    assert runtime.load_s >= runtime.warmup_s > 0
    assert costs_of(runtime.models).target_read.ready and costs_of(runtime.models).forward.ready
    auto = Conversation(runtime, policy=ReaderPolicy())
    assert auto.policy.reader == "auto"
    # the large model reads the last 32 tokens of a turn itself: a shorter turn it reads whole
    assert auto.policy.large_reads_last == 32
    done = ask(auto, MSG[0], max_tokens=N, temp=0)
    assert done.handoff.read is None and done.handoff.alternative_ttft_s is None
    assert "within the 32 tok the large reads itself" in done.status
    auto.policy = replace(
        auto.policy, large_reads_last=1
    )  # the plain handoff: two ways to read, the other one predicted
    done = ask(auto, MSG[1], max_tokens=N, temp=0)
    assert done.handoff.alternative_ttft_s > 0 and "TTFT ≈ " in done.status
    with pytest.raises(PolicyError, match="large_reads_last"):
        auto.policy = replace(auto.policy, large_reads_last=0)
    # the plain handoff: the large model reads only the last token of a turn the small read
    conv = Conversation(
        runtime, policy=ReaderPolicy(reader="tokens", reader_min_tokens=48, large_reads_last=1)
    )
    assert (conv.policy.reader, conv.policy.reader_min_tokens, conv.policy.large_reads_last) == (
        "tokens",
        48,
        1,
    )
    first = ask(conv, MSG[0], max_tokens=N, temp=0)
    later = ask(conv, MSG[1], max_tokens=N, temp=0)
    assert first.handoff.read.tokens > 0 and later.handoff.read is None
    conv.policy = replace(
        conv.policy, reader_min_tokens=0
    )  # every turn read by the small model now
    assert ask(conv, MSG[2], max_tokens=N, temp=0).handoff.read.tokens > 0
    conv.policy = replace(conv.policy, reader="self")
    assert ask(conv, MSG[0], max_tokens=N, temp=0).handoff.read is None
    with pytest.raises(PolicyError, match="reader_min_tokens"):
        conv.policy = replace(conv.policy, reader_min_tokens=-3)
    with pytest.raises(PolicyError, match="unknown reader"):
        conv.policy = replace(conv.policy, reader="huge")
    assert conv.policy.reader == "self" and conv.policy.reader_min_tokens == 0
    assert_consistent(conv)


def test_demo_pair_by_name_and_the_backward_rule(files, monkeypatch):
    """`load(pair="moe")` loads the MoE demo pair (not silently the dense one); a demo
    pair that ships no backward translator gives None, a missing forward one is an error."""
    from mlx_kvlingo.models.demo import pair as demo
    from mlx_kvlingo.models.loading import resolve_translator_spec

    asked = []

    def demo_models(pair="dense", source=None):
        asked.append(pair)
        return files["small"], files["large"]

    shipped = {"forward": str(files["translator"])}  # no backward file shipped
    monkeypatch.setattr(demo, "demo_models", demo_models)
    monkeypatch.setattr(demo, "manifest", lambda pair="dense": {"default": shipped})
    rt = load(pair="moe", warmup=False)
    assert asked == ["moe"] and rt.forward is not None and rt.backward is None
    assert resolve_translator_spec(None, reverse=True, pair_name="moe") is None
    load(warmup=False)
    assert asked == ["moe", "dense"]  # the default demo pair
    monkeypatch.setattr(demo, "manifest", lambda pair="dense": {"default": {}})
    with pytest.raises(KeyError):  # negative control: forward is not optional for a demo
        resolve_translator_spec(None, reverse=False, pair_name="moe")
    with pytest.raises(ValueError, match="unknown demo pair"):
        load(pair="sparse", warmup=False)
    with pytest.raises(ValueError, match="demo pair is chosen by name only"):
        load(files["small"], files["large"], pair="moe", warmup=False)


def test_cascade_keeps_or_escalates(runtime):
    """Model "auto": the small model answers; below the threshold the large one answers again
    (forced by thresholds no confidence can reach: above 0, below any finite log-prob)."""
    conv = Conversation(runtime, system_prompt="Be brief.")
    events = list(conv.send(MSG[0], "auto", auto_threshold=-1e9, max_tokens=N, temp=0))
    *tokens, done = events
    assert all(e.finish_reason is None and e.model == "small" for e in events[:-1])
    assert done.model == "small" and not done.handoff.escalating
    assert conv.last.handoff is done.handoff and conv.messages[-1]["content"] == done.handoff.text

    events = list(conv.send(MSG[1], "auto", auto_threshold=0.1, max_tokens=N, temp=0))
    dones = [e for e in events if e.finish_reason is not None]
    assert [d.model for d in dones] == ["small", "large"] and events[-1] is dones[1]
    assert dones[0].handoff.escalating and not dones[1].handoff.escalating
    assert dones[0].handoff.confidence < 0.1
    after = events[events.index(dones[0]) + 1 :]
    assert after and all(e.model == "large" for e in after)
    assert conv.last.handoff is dones[1].handoff
    assert conv.messages[-1]["content"] == dones[1].handoff.text
    assert dones[1].handoff.switch.translated > 0  # the large caught up by translation
    assert len([m for m in conv.messages if m["role"] == "assistant"]) == 2
    assert generate(runtime, MSG[2], model="auto", auto_threshold=0.1, max_tokens=N, temp=0)
    assert_consistent(conv)
    assert not runtime.busy


def test_trim_and_pending(runtime):
    conv = Conversation(runtime, system_prompt="Be brief.")
    ask(conv, MSG[0], "small", max_tokens=N, temp=0)
    assert not conv.cache.pending
    conv.add_messages([{"role": "user", "content": MSG[1]}])
    assert conv.cache.pending
    assert conv.trim(conv.tokens - 1) == 2  # the first exchange goes, the last message stays
    assert [m["role"] for m in conv.messages] == ["system", "user"] and conv.cache.pending
    done = list(conv.send(None, "large", max_tokens=N, temp=0))[-1]
    assert done.finish_reason is not None and not conv.cache.pending
    assert_consistent(conv)
    assert conv.trim(10_000) == 0


def test_one_seed_rule():
    """An answer is seeded with seed + the assistant messages before the turn it answers."""
    from mlx_kvlingo.conversation.stream import seed as _seed

    def draw(seed=None, messages=None):
        if messages is None:
            mx.random.seed(seed)
        else:
            _seed(seed, messages)
        return mx.random.uniform(shape=(4,)).tolist()

    u, a, sys_ = ({"role": r, "content": "x"} for r in ("user", "assistant", "system"))
    assert draw(5, [sys_, u]) == draw(5)  # the first turn: the seed as given
    assert draw(5, [sys_, u, a, u]) == draw(6) != draw(5)  # a new draw each turn
    assert draw(5, [u, a, u, a]) == draw(6)  # re-answering (escalate): the same position
    assert draw(5, []) == draw(5)  # raw tokens, no messages


def test_sampling_overrides_merge_over_each_models_defaults(runtime, monkeypatch):
    """`temp=...` changes the temperature only: top-p and the rest stay the answering model's
    own (its generation_config.json), in a new answer, an escalation and both answers of
    model "auto"; a `sampler` is used as given (mlx-lm's); an unknown setting is a
    ConversationError naming it, raised before anything runs."""
    from mlx_kvlingo.conversation import stream as S

    small_dir, large_dir = runtime.models.source.folder, runtime.models.target.folder
    own = {small_dir: {"top_p": 0.8}, large_dir: {"top_k": 20}}
    monkeypatch.setattr(S, "generation_config", lambda folder: dict(own.get(folder, {})))
    used = []
    sampler = S.Sampling.sampler
    monkeypatch.setattr(S.Sampling, "sampler", lambda cfg: used.append(cfg) or sampler(cfg))
    small, large = S.resolve(runtime.models.source), S.resolve(runtime.models.target)
    assert (small.top_p, large.top_k) == (0.8, 20)  # the models' own differ from DEFAULTS

    conv = Conversation(runtime)
    ask(conv, MSG[0], "small", max_tokens=2, temp=0.3, seed=1)
    list(conv.send(escalate=True, max_tokens=2, temp=0.3))
    conv.add_messages([{"role": "user", "content": MSG[1]}])
    list(conv.send(None, "small", max_tokens=2, top_k=5))
    used.clear()
    list(conv.send(MSG[2], "auto", auto_threshold=1.0, max_tokens=2, temp=0.3))  # escalates
    assert used[-2:] == [replace(small, temp=0.3), replace(large, temp=0.3)]
    assert replace(small, temp=0.3, seed=1) != small
    picked = []
    argmax = lambda logits: picked.append(1) or mx.argmax(logits, axis=-1)  # noqa: E731
    ask(conv, MSG[3], "large", max_tokens=2, sampler=argmax)
    assert picked

    n = len(conv.messages)
    unknown = r"unknown sampling settings \['temperature'\] \(temperature is 'temp'\); known: temp"
    for call in (
        lambda: conv.send(MSG[0], temperature=0),
        lambda: conv.send(None, temperature=0),
        lambda: conv.send(escalate=True, temperature=0),
        lambda: conv.send(MSG[0], "auto", temperature=0),
    ):
        with pytest.raises(ConversationError, match=unknown):
            call()
    assert len(conv.messages) == n and not runtime.busy
    assert_consistent(conv)
