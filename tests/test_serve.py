"""`kvlingo serve` with the real `openai` client against a server on 127.0.0.1 (tiny known-answer
pair): streaming and not, prefix reuse across turns (from `usage`), the auto cascade, stop
sequences, a disconnect mid-stream, the bounded queue, every refused request, and the CLI."""

import http.client
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from mlx_kvlingo import load
from mlx_kvlingo.config import ReaderPolicy
from mlx_kvlingo.models.files import save_translator
from mlx_kvlingo.models.pair import load_pair
from mlx_kvlingo.serve import Limits, ServeConfig, Server, sampling_kwargs
from mlx_kvlingo.serve import worker as serve_worker
from mlx_kvlingo.serve.protocol import APIError

import mlx.core as mx
import pytest
from helpers import exact_translator
from mlx_lm import stream_generate

openai = pytest.importorskip("openai")

ROOT = Path(__file__).resolve().parents[1]
LIMITS = Limits(max_tokens=48, default_max_tokens=12, max_prompt_tokens=200)
U1, U2, U3 = "def parse_args(argv):", "class Foo(object):", "import json\nimport os"
GREEDY = {"temperature": 0, "max_tokens": 12}


@pytest.fixture(scope="module")
def runtime(tiny_dir, tmp_path_factory):
    d = tmp_path_factory.mktemp("serve")
    pair = load_pair(tiny_dir["qwen3"], tiny_dir["known"])
    answer = tiny_dir["known_answer"]
    save_translator(exact_translator(pair, answer), d / "fwd.safetensors", pair)
    back = pair.reversed()
    inverse = {k: [m.T for m in v] for k, v in answer.items() if k in ("key_maps", "value_maps")}
    save_translator(exact_translator(back, inverse), d / "bwd.safetensors", back)
    return load(tiny_dir["qwen3"], tiny_dir["known"], d / "fwd.safetensors", d / "bwd.safetensors")


@pytest.fixture
def serve(runtime):
    """Start servers on 127.0.0.1 (any free port); every one is stopped at the end."""
    started = []

    def start(**overrides):
        config = ServeConfig(port=0, limits=LIMITS, max_body_bytes=16384, **overrides)
        server = Server(runtime, config).start()
        started.append(server)
        return server

    yield start
    for server in started:
        server.close()


@pytest.fixture
def server(serve):
    return serve()


def client_for(server, api_key="unused"):
    return openai.OpenAI(base_url=server.url, api_key=api_key, max_retries=0, timeout=30)


@pytest.fixture
def client(server):
    return client_for(server)


def native(runtime, model, tokens, n):
    """What one model alone says after reading `tokens` itself (greedy)."""
    loaded = runtime.models.source if model == "small" else runtime.models.target
    out = stream_generate(loaded.model, runtime.tokenizer, mx.array(tokens), max_tokens=n)
    return runtime.tokenizer.decode([r.token for r in out])


def templated(runtime, messages):
    return runtime.tokenizer.apply_chat_template(messages, add_generation_prompt=True)


def wait_idle(server, timeout=20.0):
    deadline = time.monotonic() + timeout
    while server.worker.running is not None or server.worker.waiting:
        assert time.monotonic() < deadline, "the worker did not go idle"
        time.sleep(0.02)


def assert_consistent(server):
    for conv in server.worker.pool._held:
        s = conv.cache
        for role in ("source", "target"):
            assert all(c.offset == s.held(role) for c in s.cache(role))
            assert s.held(role) <= len(s.tokens)


@pytest.fixture
def slow_tokens(monkeypatch):
    """Make the worker take ~30 ms per streamed token (to stop or queue behind a generation)."""
    put = serve_worker.Job.put

    def slow(self, kind, *payload):
        if kind == "token":
            time.sleep(0.03)
        put(self, kind, *payload)

    monkeypatch.setattr(serve_worker.Job, "put", slow)


def raw(server, method, path, body=b"", headers=None):
    """A plain HTTP request (for what the openai client never sends); -> (status, json body)."""
    host, port = server.address
    conn = http.client.HTTPConnection(host, port, timeout=20)
    try:
        conn.request(method, path, body=body, headers=headers or {})
        resp = conn.getresponse()
        data = resp.read()
        return resp.status, json.loads(data) if data else None
    finally:
        conn.close()


def assert_error_body(body, code=None):
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    if code is not None:
        assert err["code"] == code, err


# -- chatting ----------------------------------------------------------------------------------


def test_models(client):
    ids = [m.id for m in client.models.list().data]
    assert ids == ["small", "large", "auto"]
    assert client.models.retrieve("large").id == "large"


@pytest.mark.parametrize("model", ["small", "large"])
def test_non_streaming_is_the_models_own_answer(runtime, client, model):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": U1}]
    r = client.chat.completions.create(model=model, messages=messages, **GREEDY)
    choice = r.choices[0]
    assert r.object == "chat.completion" and r.model == model and r.id.startswith("chatcmpl-")
    assert choice.message.role == "assistant" and choice.finish_reason in ("stop", "length")
    prompt = templated(runtime, messages)
    assert choice.message.content == native(runtime, model, prompt, 12)
    u = r.usage
    assert u.prompt_tokens == len(prompt) and u.completion_tokens > 0
    assert u.total_tokens == u.prompt_tokens + u.completion_tokens
    assert u.prompt_tokens_details.cached_tokens == 0  # a new conversation
    extra = u.model_extra
    assert set(extra) == {"read_tokens", "translated_tokens"}
    # every prompt token reached the answering model once: read by it or translated into it
    assert extra["read_tokens"][model] + extra["translated_tokens"][model] == len(prompt)
    assert r.model_extra["kvlingo"]["answered_by"] == model


def test_streaming_matches_non_streaming(client):
    messages = [{"role": "user", "content": U2}]
    whole = client.chat.completions.create(model="large", messages=messages, **GREEDY)
    chunks = list(
        client.chat.completions.create(
            model="large", messages=messages, stream=True,
            stream_options={"include_usage": True}, **GREEDY,
        )
    )  # fmt: skip
    assert all(c.object == "chat.completion.chunk" and c.id == chunks[0].id for c in chunks)
    assert chunks[0].choices[0].delta.role == "assistant"
    *body, last, usage = chunks
    text = "".join(c.choices[0].delta.content or "" for c in body)
    assert text == whole.choices[0].message.content
    assert last.choices[0].finish_reason == whole.choices[0].finish_reason
    assert all(c.usage is None for c in [*body, last])
    assert usage.choices == [] and usage.usage.completion_tokens == whole.usage.completion_tokens
    assert usage.usage.prompt_tokens == whole.usage.prompt_tokens


def test_follow_up_reads_or_translates_only_the_new_suffix(runtime, server, client):
    history = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": U1}]
    r1 = client.chat.completions.create(model="large", messages=history, **GREEDY)
    history += [{"role": "assistant", "content": r1.choices[0].message.content},
                {"role": "user", "content": U2}]  # fmt: skip
    r2 = client.chat.completions.create(model="large", messages=history, **GREEDY)
    held = r1.usage.prompt_tokens + r1.usage.completion_tokens
    u = r2.usage
    conv = next(iter(server.worker.pool._held))
    # the conversation keeps answers as generated tokens (re-tokenizing the text may differ)
    assert u.prompt_tokens == len(conv.cache.tokens) - u.completion_tokens
    assert u.prompt_tokens_details.cached_tokens == held
    suffix = u.prompt_tokens - held
    assert 0 < suffix < u.prompt_tokens
    read, translated = u.model_extra["read_tokens"], u.model_extra["translated_tokens"]
    # the large model got exactly the new suffix: read by itself, or (reader policy "small")
    # read by the small model and translated into the large one
    assert read["large"] + translated["large"] == suffix
    assert translated["large"] <= suffix and read["small"] <= suffix
    assert r2.model_extra["kvlingo"]["reused_messages"] == 3
    # the answer is the large model's own over the whole conversation (exact translator)
    assert r2.choices[0].message.content == native(runtime, "large", conv.cache.tokens[: u.prompt_tokens], 12)  # fmt: skip
    # a third turn through the small model: what it lacks of the large's turns is translated
    # (backward translator); it reads at most the new suffix itself
    history += [{"role": "assistant", "content": r2.choices[0].message.content},
                {"role": "user", "content": U3}]  # fmt: skip
    r3 = client.chat.completions.create(model="small", messages=history, **GREEDY)
    u3 = r3.usage
    read, translated = u3.model_extra["read_tokens"], u3.model_extra["translated_tokens"]
    assert r3.model_extra["kvlingo"]["reused_messages"] == 5
    assert read["large"] == translated["large"] == 0
    assert read["small"] + translated["small"] == u3.prompt_tokens - u3.prompt_tokens_details.cached_tokens  # fmt: skip
    assert translated["small"] > 0
    assert read["small"] <= u3.prompt_tokens - (u.prompt_tokens + r2.usage.completion_tokens)
    assert len(server.worker.pool) == 1
    assert_consistent(server)


def test_history_from_elsewhere_and_lru(runtime, serve):
    server = serve(max_conversations=2)
    client = client_for(server)
    messages = [{"role": "user", "content": U1}, {"role": "assistant", "content": "argv"},
                {"role": "user", "content": U2}]  # fmt: skip
    r = client.chat.completions.create(model="small", messages=messages, **GREEDY)
    assert r.usage.prompt_tokens == len(templated(runtime, messages))
    assert r.usage.prompt_tokens_details.cached_tokens == 0
    assert r.choices[0].message.content == native(runtime, "small", templated(runtime, messages), 12)  # fmt: skip
    for text in (U2, U3, "print(x)"):
        client.chat.completions.create(model="small", messages=[{"role": "user", "content": text}],
                                       **GREEDY)  # fmt: skip
    assert len(server.worker.pool) == 2  # the least recently used went


def test_auto_cascade(serve):
    messages = [{"role": "user", "content": U3}]
    always = client_for(serve(auto_threshold=0.0))  # every answer is below 0: escalate
    r = always.chat.completions.create(model="auto", messages=messages, **GREEDY)
    large = always.chat.completions.create(model="large", messages=messages, **GREEDY)
    info = r.model_extra["kvlingo"]
    assert info["escalated"] and info["answered_by"] == "large" and info["confidence"] < 0
    assert r.model == "auto" and r.choices[0].message.content == large.choices[0].message.content
    assert r.usage.model_extra["translated_tokens"]["large"] > 0  # the small read for it
    streamed = always.chat.completions.create(model="auto", messages=messages, stream=True,
                                              **GREEDY)  # fmt: skip
    text = "".join(c.choices[0].delta.content or "" for c in streamed if c.choices)
    assert text == large.choices[0].message.content  # only the kept answer is streamed

    never = client_for(serve(auto_threshold=-1e9))
    r = never.chat.completions.create(model="auto", messages=messages, **GREEDY)
    small = never.chat.completions.create(model="small", messages=messages, **GREEDY)
    info = r.model_extra["kvlingo"]
    assert not info["escalated"] and info["answered_by"] == "small"
    assert r.choices[0].message.content == small.choices[0].message.content


def test_stop_sequences_logprobs_and_seed(client):
    messages = [{"role": "user", "content": U1}]
    full = client.chat.completions.create(model="large", messages=messages, **GREEDY)
    text = full.choices[0].message.content
    k = next(i for i in range(2, len(text) - 1) if text.find(text[i : i + 2]) == i)
    stop = text[k : k + 2]
    r = client.chat.completions.create(model="large", messages=messages, stop=[stop], **GREEDY)
    assert r.choices[0].message.content == text[:k] and r.choices[0].finish_reason == "stop"
    s = client.chat.completions.create(model="large", messages=messages, stop=stop, stream=True,
                                       **GREEDY)  # fmt: skip
    chunks = list(s)
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == text[:k]
    assert chunks[-1].choices[0].finish_reason == "stop"

    lp = client.chat.completions.create(model="small", messages=messages, logprobs=True, **GREEDY)
    content = lp.choices[0].logprobs.content
    assert content and all(c.logprob <= 0 for c in content)

    kw = {"model": "large", "messages": messages, "max_tokens": 12}
    a, b = (client.chat.completions.create(temperature=1.5, seed=7, **kw) for _ in range(2))
    assert a.choices[0].message.content == b.choices[0].message.content


# -- disconnects and the queue -----------------------------------------------------------------


def test_disconnect_mid_stream_then_a_normal_request(runtime, server, client, slow_tokens):
    messages = [{"role": "user", "content": U2}]
    stream = client.chat.completions.create(model="large", messages=messages, stream=True,
                                            temperature=0, max_tokens=48)  # fmt: skip
    got = []
    for chunk in stream:
        got.append(chunk)
        if len(got) == 3:
            break
    stream.close()  # the client goes away mid-answer
    wait_idle(server)
    (conv,) = server.worker.pool._held
    assert conv.last.finish_reason == "cancelled"
    assert conv.last.generation_tokens < 48
    assert_consistent(server)
    r = client.chat.completions.create(model="large", messages=messages, **GREEDY)
    assert r.choices[0].message.content == native(runtime, "large", templated(runtime, messages), 12)  # fmt: skip
    assert_consistent(server)


def test_bounded_queue_answers_503(serve, slow_tokens):
    server = serve(queue_size=1)
    client = client_for(server)
    messages = [{"role": "user", "content": U1}]
    results = {}

    def run(name):
        try:
            r = client.chat.completions.create(model="small", messages=messages,
                                               temperature=0, max_tokens=30)  # fmt: skip
            results[name] = r.choices[0].finish_reason
        except Exception as e:  # noqa: BLE001
            results[name] = e

    first = threading.Thread(target=run, args=("running",))
    first.start()
    deadline = time.monotonic() + 20
    while server.worker.running is None:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    second = threading.Thread(target=run, args=("waiting",))
    second.start()
    while server.worker.waiting < 1:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    with pytest.raises(openai.APIStatusError) as e:
        client.chat.completions.create(model="small", messages=messages, **GREEDY)
    assert e.value.status_code == 503 and e.value.response.headers["Retry-After"] == "1"
    assert_error_body(e.value.response.json(), "queue_full")
    first.join(30)
    second.join(30)
    assert results == {"running": "length", "waiting": "length"}


# -- refused requests --------------------------------------------------------------------------


BAD_FIELDS = [
    ({"temperature": "hot"}, "temperature"),
    ({"temperature": 3}, "temperature"),
    ({"top_p": 1.5}, "top_p"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"max_tokens": 49}, "max_tokens"),  # over the server's ceiling
    ({"max_completion_tokens": True}, "max_completion_tokens"),
    ({"n": 2}, "n"),
    ({"stream": "yes"}, "stream"),
    ({"stop": ["a", "b", "c", "d", "e"]}, "stop"),
    ({"stop": [1]}, "stop"),
    ({"top_logprobs": 3}, "top_logprobs"),
    ({"seed": "x"}, "seed"),
    ({"frequency_penalty": 0.5}, "frequency_penalty"),
    ({"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools"),
    ({"response_format": {"type": "json_object"}}, "response_format"),
    ({"messages": []}, "messages"),
    ({"messages": [{"role": "assistant", "content": "hi"}]}, "messages[0].role"),
    (
        {"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]},
        "messages",
    ),  # fmt: skip
    ({"messages": [{"role": "tool", "content": "x"}]}, "messages[0].role"),
    ({"messages": [{"role": "user", "content": 3}]}, "messages[0].content"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "messages[0].content"),
    (
        {"messages": [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]},
        "messages[1].role",
    ),  # fmt: skip
    (
        {
            "messages": [
                {"role": "user", "content": "a"},
                {"role": "system", "content": "b"},
                {"role": "user", "content": "c"},
            ]
        },
        "messages[1].role",
    ),  # fmt: skip
]


def test_bad_fields_are_400_with_openai_error_bodies(client, server):
    base = {"model": "large", "messages": [{"role": "user", "content": U1}]}
    for fields, param in BAD_FIELDS:
        body = {**base, **fields}
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(**body)
        err = e.value.response.json()
        assert_error_body(err)
        assert err["error"]["param"] == param, (fields, err)
    r = client.chat.completions.create(**base, **GREEDY)  # still serving
    assert r.choices[0].message.content
    assert not server.worker.waiting and server.worker.running is None


def test_unknown_model_and_over_long_prompt(client):
    with pytest.raises(openai.NotFoundError) as e:
        client.chat.completions.create(model="gpt-4o", messages=[{"role": "user", "content": "hi"}])
    assert_error_body(e.value.response.json(), "model_not_found")
    long = [{"role": "user", "content": "import os\n" * 200}]
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="small", messages=long)
    assert_error_body(e.value.response.json(), "context_length_exceeded")
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("medium")


def test_malformed_http_requests(server):
    ok = json.dumps({"model": "small", "messages": [{"role": "user", "content": "hi"}],
                     "max_tokens": 2}).encode()  # fmt: skip
    path = "/v1/chat/completions"
    json_type = {"Content-Type": "application/json"}
    cases = [
        (b"{not json", json_type, 400, "invalid_json"),
        (b"\xff\xfe", json_type, 400, "invalid_json"),
        (b'{"model": "small", "temperature": NaN}', json_type, 400, "invalid_json"),
        (b"[" * 10000, json_type, 400, "invalid_json"),
        (b"[1, 2]", json_type, 400, None),
        (b"{}", json_type, 400, None),
        (ok, {"Content-Type": "text/plain"}, 415, None),
        (b"x" * 20000, json_type, 413, "request_too_large"),
    ]
    for body, headers, status, code in cases:
        got, err = raw(server, "POST", path, body, headers)
        assert got == status, (body[:20], got, err)
        assert_error_body(err, code)
    assert raw(server, "POST", "/v1/completions", ok, json_type)[0] == 404
    assert raw(server, "GET", "/nowhere")[0] == 404
    assert raw(server, "GET", "/health") == (200, {"status": "ok"})
    # no Content-Length at all
    host, port = server.address
    conn = http.client.HTTPConnection(host, port, timeout=20)
    conn.putrequest("POST", path)
    conn.putheader("Content-Type", "application/json")
    conn.endheaders()
    resp = conn.getresponse()
    assert resp.status == 411
    assert_error_body(json.loads(resp.read()))
    conn.close()
    assert raw(server, "POST", path, ok, json_type)[0] == 200  # still serving


def test_api_key(serve):
    server = serve(api_key="sekret")
    with pytest.raises(openai.AuthenticationError) as e:
        client_for(server, "wrong").models.list()
    assert_error_body(e.value.response.json(), "invalid_api_key")
    assert raw(server, "POST", "/v1/chat/completions", b"{}")[0] == 401
    assert raw(server, "GET", "/health")[0] == 200
    good = client_for(server, "sekret")
    r = good.chat.completions.create(model="small", messages=[{"role": "user", "content": U1}],
                                     **GREEDY)  # fmt: skip
    assert r.choices[0].message.content


def test_sampling_fields_map_onto_sampling():
    """OpenAI's fields become `Conversation.send`'s sampling keywords (the library's names,
    only those set) and `max_tokens`; a field the library lacks is refused, naming it."""
    body = {"temperature": 0.5, "max_completion_tokens": 9, "max_tokens": 20, "seed": 3}
    assert sampling_kwargs(body, LIMITS) == {"temp": 0.5, "seed": 3, "max_tokens": 9}
    assert sampling_kwargs({}, LIMITS) == {"max_tokens": LIMITS.default_max_tokens}
    zero = {"frequency_penalty": 0, "presence_penalty": 0.0}
    assert sampling_kwargs(zero, LIMITS) == sampling_kwargs({}, LIMITS)
    extras = {"top_k": 40, "min_p": 0.05, "repetition_penalty": 1.1, "repetition_context_size": 64}
    got = sampling_kwargs({**extras, "top_p": 0.8}, LIMITS)
    assert got == {**extras, "top_p": 0.8, "max_tokens": LIMITS.default_max_tokens}
    for name in ("frequency_penalty", "presence_penalty"):
        with pytest.raises(APIError, match=f"{name} is not supported.*repetition_penalty") as e:
            sampling_kwargs({name: 0.5}, LIMITS)
        assert e.value.param == name and e.value.code == "unsupported_field"


# -- the serving page's example and the command line -------------------------------------------

PAGE = ROOT / "mlx_kvlingo" / "serve" / "README.md"  # the topic page beside the code
HEADING = "# Serving over the OpenAI API"


def test_readme_client_example(server):
    page = PAGE.read_text()
    assert HEADING in page, f"no {HEADING!r} in {PAGE}"
    block = re.search(r"```python\n(.*?)```", page.split(HEADING, 1)[1], re.S)
    assert block, f"no python block under {HEADING!r} in {PAGE}"
    code = block.group(1)
    assert "http://127.0.0.1:8080/v1" in code and "OpenAI(" in code
    code = code.replace("http://127.0.0.1:8080/v1", server.url)
    code = code.replace("OpenAI(", "OpenAI(max_retries=0, timeout=30, ")
    exec(compile(code, str(PAGE), "exec"), {"__name__": "readme"})


def test_cli_refuses_an_open_host_without_a_key():
    from mlx_kvlingo.cli import cli

    from click.testing import CliRunner

    out = CliRunner().invoke(cli, ["serve", "--host", "0.0.0.0"])
    assert out.exit_code == 2 and "--api-key" in out.output


@pytest.mark.parametrize("stop", [signal.SIGINT, signal.SIGTERM], ids=["ctrl-c", "sigterm"])
def test_cli_serves_and_stops(tiny_dir, stop):
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
    }
    cmd = [sys.executable, "-c", "from mlx_kvlingo.cli import main; main()", "serve",
           "--source", str(tiny_dir["qwen3"]), "--target", str(tiny_dir["known"]),
           "--port", "0", "--max-tokens", "16", "--default-max-tokens", "4"]  # fmt: skip
    # a child inherits an ignored SIGINT (pytest started with `&` from a script has one) and
    # Python then installs no Ctrl-C handler: start it with SIGINT at its default
    ignored = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True, env=env)
    finally:
        signal.signal(signal.SIGINT, ignored)
    try:
        url = None
        deadline = time.monotonic() + 120
        lines = []
        while url is None and time.monotonic() < deadline:
            line = proc.stderr.readline()
            if not line:
                break
            lines.append(line)
            m = re.search(r"serving on (http://127\.0\.0\.1:\d+/v1)", line)
            url = m.group(1) if m else None
        assert url, "".join(lines)
        # keep draining stderr: a full pipe would block the server's writes (and its exit)
        drain = threading.Thread(target=lambda: lines.extend(proc.stderr), daemon=True)
        drain.start()
        c = openai.OpenAI(base_url=url, api_key="unused", max_retries=0, timeout=30)
        r = c.chat.completions.create(model="large", messages=[{"role": "user", "content": U1}])
        assert r.usage.completion_tokens <= 4  # --default-max-tokens
    finally:
        proc.send_signal(stop)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)
    drain.join(10)
    assert proc.returncode == 0, "".join(lines)[-3000:]
    assert "stopped" in lines[-1]  # the graceful path ran, not just an exit


def test_cli_serves_the_moe_demo_pair(tiny_dir, tmp_path, monkeypatch):
    """`kvlingo serve --pair moe` loads the MoE demo pair (here stood in by the tiny pair) and
    answers a request; before, serve had no --pair and always served the dense pair."""
    from mlx_kvlingo.cli import cli
    from mlx_kvlingo.models.demo import pair as demo

    from click.testing import CliRunner

    pair = load_pair(tiny_dir["qwen3"], tiny_dir["known"])
    fwd = save_translator(exact_translator(pair, tiny_dir["known_answer"]),
                          tmp_path / "fwd.safetensors", pair)  # fmt: skip
    asked, answers = [], []

    def demo_models(name="dense", source=None):
        asked.append(name)
        return tiny_dir["qwen3"], tiny_dir["known"]

    def serve_forever(self):
        self.start()
        try:
            c = openai.OpenAI(base_url=self.url, api_key="unused", max_retries=0, timeout=30)
            answers.append(c.chat.completions.create(model="large", max_tokens=4,
                                                     messages=[{"role": "user", "content": U1}]))  # fmt: skip
        finally:
            self.close()
        raise KeyboardInterrupt

    def exit_(code):
        raise SystemExit(code)

    monkeypatch.setattr(demo, "demo_models", demo_models)
    monkeypatch.setattr(demo, "manifest", lambda name="dense": {"default": {"forward": str(fwd)}})
    monkeypatch.setattr(Server, "serve_forever", serve_forever)
    monkeypatch.setattr(os, "_exit", exit_)
    monkeypatch.setattr(signal, "signal", lambda *a: None)
    made = []
    init = Server.__init__

    def server_init(self, runtime, config, **kwargs):
        made.append(kwargs)
        init(self, runtime, config, **kwargs)

    monkeypatch.setattr(Server, "__init__", server_init)
    out = CliRunner().invoke(cli, ["serve", "--pair", "moe", "--port", "0",
                                   "--large-reads-last", "5"])  # fmt: skip
    assert out.exit_code == 0, out.output
    assert asked == ["moe"] and answers[0].choices[0].message.content
    assert made == [{"mode": "alternation", "policy": ReaderPolicy(large_reads_last=5)}]
    out = CliRunner().invoke(cli, ["serve", "--pair", "moe", "--source", "a", "--target", "b"])
    assert out.exit_code == 2 and "--pair chooses a demo pair" in out.output
