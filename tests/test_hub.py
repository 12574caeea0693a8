"""Translators on the Hub, against a local stand-in (tests/hub_standin.py) on 127.0.0.1.

`huggingface_hub` reads HF_ENDPOINT, HF_HOME and HF_HUB_OFFLINE when it is imported, so the
clients run in a subprocess with them set, one per environment (`Client`: its steps in turn);
the stand-in runs in this process and is stopped by its fixture. Round trip: `kvlingo upload`,
`kvlingo download` (pinned), `load(translator="org/name")`, decode token for token like the
local file; then offline from the cache, and a clear error offline for what it lacks.
"""

import json
import os
import re
import subprocess
import sys
import threading
from pathlib import Path

import mlx_kvlingo  # noqa: F401  (OpenBLAS before mlx)
from mlx_kvlingo.models.files import load_translator, save_translator
from mlx_kvlingo.models.hub import HubSpec, parse_spec, resolve_translator

import pytest
from helpers import exact_translator
from hub_standin import HubStandIn

ROOT = Path(__file__).resolve().parents[1]
PROMPT = "def parse_args(argv):\n    parser = argparse.ArgumentParser(description="
REPO = "kvlingo-test/known-pair"
#: one client process: runs each step it reads (a JSON line) in turn; ["cli", *args] is
#: `kvlingo args`, ["decode", source, target, translator, prompt, n] prints the greedy tokens
#: after a hand-off. A step's output ends with a line "EXIT <status>".
CLIENT = r"""
import json, sys
from mlx_kvlingo.cli._group import cli


def decode(src, tgt, spec, prompt, n):
    from mlx_kvlingo import load
    import mlx.core as mx
    from mlx_kvlingo.config import ReaderPolicy
    from mlx_kvlingo.conversation.session import Session
    from mlx_lm import stream_generate

    rt = load(src, tgt, translator=spec, warmup=False)  # a handoff, not a chat turn
    pair, tokens = rt.models, rt.tokenizer.encode(prompt)
    s = Session(pair, rt.forward,
                policy=ReaderPolicy("small", large_reads_last=1, recompute_share=0))
    s.add_tokens(tokens)
    s.hand_off("target")
    out = stream_generate(pair.target.model, pair.tokenizer, mx.array(tokens[-1:]),
                          max_tokens=int(n), prompt_cache=s.cache("target"))
    print("TOKENS", json.dumps([r.token for r in out]))


for line in sys.stdin:
    kind, *args = json.loads(line)
    try:
        if kind == "cli":
            cli.main(args, prog_name="kvlingo")  # exits with its status, as the `kvlingo` script
        else:
            decode(*args)
        code = 0
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else int(e.code is not None)
    print(f"\nEXIT {code}", flush=True)
"""


def decode_tokens(pair, tr, n=24):
    import mlx.core as mx
    from helpers import handoff
    from mlx_lm import stream_generate

    tokens = pair.tokenizer.encode(PROMPT)
    h = handoff(pair, tr, tokens)
    out = stream_generate(pair.target.model, pair.tokenizer, mx.array(tokens[-1:]),
                          max_tokens=n, prompt_cache=h.target_cache)  # fmt: skip
    return [r.token for r in out]


class Client:
    """A client process (see CLIENT) in `env`; `step(*args)` -> (exit status, output)."""

    def __init__(self, env: dict, timeout: float = 300):
        self.proc = subprocess.Popen(
            [sys.executable, "-u", "-c", CLIENT],  # -u: stdout and stderr in order
            env=env,
            cwd=ROOT,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        self.watchdog = threading.Timer(timeout, self.proc.kill)
        self.watchdog.start()

    def step(self, *args: str) -> tuple[int, str]:
        self.proc.stdin.write(json.dumps(args) + "\n")
        self.proc.stdin.flush()
        lines = []
        for line in self.proc.stdout:
            if line.startswith("EXIT "):
                return int(line[5:]), "".join(lines)
            lines.append(line)
        raise AssertionError(f"the client ended (or ran past its time):\n{''.join(lines)[-3000:]}")

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.proc.kill()
        self.proc.wait()
        self.watchdog.cancel()


@pytest.fixture
def hub():
    with HubStandIn() as h:
        yield h


def client_env(hf_home: Path, endpoint: str | None = None, offline: bool = False) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("HF_")}
    env.update(HF_HOME=str(hf_home), HF_HUB_DISABLE_TELEMETRY="1", OPENBLAS_NUM_THREADS="1")
    env["HF_ENDPOINT"] = endpoint or "http://127.0.0.1:9"  # nothing listens there
    if offline:
        env["HF_HUB_OFFLINE"] = "1"
    return env


def test_parse_spec():
    assert parse_spec("org/name") == HubSpec("org/name")
    assert parse_spec("org/name@v1.0") == HubSpec("org/name", "v1.0")
    assert parse_spec("org/name@abc:sub/f.safetensors") == HubSpec(
        "org/name", "abc", "sub/f.safetensors"
    )
    assert parse_spec("org/name:f.safetensors") == HubSpec("org/name", None, "f.safetensors")
    assert str(HubSpec("org/name", "abc", "f")) == "org/name@abc:f"
    for local in ("./org/name", "/abs/path", "file.safetensors", "a/b/c"):
        assert parse_spec(local) is None


def test_local_path_wins(tmp_path, monkeypatch):
    (tmp_path / "org").mkdir()
    (tmp_path / "org" / "name").write_bytes(b"x")
    monkeypatch.chdir(tmp_path)
    assert resolve_translator("org/name") == Path("org/name")


def test_round_trip_through_the_hub(known_pair, tiny_dir, tmp_path, hub):
    tr = exact_translator(known_pair, tiny_dir["known_answer"])
    (tmp_path / "sub").mkdir()
    local = save_translator(tr, tmp_path / "sub" / "fwd.safetensors", known_pair,
                            calibration={"data": {"train": "exact known answer"}})  # fmt: skip
    answer = tiny_dir["known_answer"]
    wrong = {k: [-m for m in answer[k]] for k in ("key_maps", "value_maps")}  # decodes otherwise
    other = save_translator(exact_translator(known_pair, wrong), tmp_path / "other.safetensors",
                            known_pair)  # fmt: skip
    manifest = tmp_path / "manifest.json"
    manifest.write_text(json.dumps({"default": {"forward": "sub/fwd.safetensors"}}))
    want = decode_tokens(known_pair, load_translator(local, known_pair))
    hf_home = tmp_path / "hf"
    env = client_env(hf_home, hub.url)

    decode = ["decode", str(tiny_dir["qwen3"]), str(tiny_dir["known"])]
    with Client(env) as client:
        # two files: the default keeps its subfolder on the Hub, as the manifest names it
        upload = [str(local), str(other), REPO, "--manifest", str(manifest), "-m", "test"]
        code, out = client.step("cli", "upload", *upload)
        assert code == 0, out
        sha = re.search(r"/commit/([0-9a-f]{40})", out).group(1)
        assert {"POST /api/repos/create", f"POST /api/models/{REPO}/commit/main"} <= set(
            hub.store.requests
        )
        files = hub.store.repos[REPO]["commits"][sha]
        assert sorted(files) == ["README.md", "manifest.json", "other.safetensors",
                                 "sub/fwd.safetensors"]  # fmt: skip
        assert files["sub/fwd.safetensors"] == local.read_bytes()
        card = files["README.md"].decode()
        assert "4x2x32 → 4x2x32" in card and f'translator="{REPO}"' in card

        code, out = client.step("cli", "download", f"{REPO}@{sha}")  # pinned revision
        assert code == 0, out
        assert f"snapshots/{sha}" in out and "sub/fwd.safetensors" in out

        code, out = client.step(*decode, REPO, PROMPT, str(len(want)))
        assert code == 0, out
        assert json.loads(out.split("TOKENS", 1)[1].splitlines()[0]) == want

    hub.stop()  # from here on, nothing answers: the cache has to serve
    with Client(client_env(hf_home, offline=True)) as client:
        code, out = client.step(*decode, f"{REPO}@{sha}", PROMPT, str(len(want)))
        assert code == 0, out
        assert json.loads(out.split("TOKENS", 1)[1].splitlines()[0]) == want

        uncached = "kvlingo-test/never-uploaded"  # as good as an empty cache
        code, out = client.step("cli", "download", uncached)
        assert code != 0
        assert "HF_HUB_OFFLINE=1" in out and f"kvlingo download {uncached}" in out


def test_hub_errors_are_named(tmp_path, hub):
    with Client(client_env(tmp_path / "hf", hub.url)) as client:
        code, out = client.step("cli", "download", "nobody/nothing")
        assert code != 0 and "no such repository" in out
        code, out = client.step("cli", "upload", str(ROOT / "pyproject.toml"), "org/x")
        assert code != 0 and "not a translator file" in out


def test_card_from_metadata(tmp_path):
    """The demo files' metadata yields the card's pair, variant, cut and held-out table; files
    keep their paths below a common folder, so the manifest's default in `source15/` is found."""
    from mlx_kvlingo.models.hub import HubError, build_repo_folder

    weights = ROOT / "weights"
    tr = weights / "translators"
    files = sorted((tr / "source15").glob("*.safetensors"))
    if len(files) < 2:
        pytest.skip("demo translators not built")
    d = build_repo_folder(files, tmp_path / "repo", "org/demo", weights / "manifest.json")
    card = (d / "README.md").read_text()
    assert card.startswith("---\nlibrary_name: mlx-kvlingo")
    assert "| `source15/backward-mixing-nu2.safetensors` | stage1 | 32 / 632 | translated |" in card
    assert "30x3x64 → 15x3x64" in card and "post_norm" in card
    # the calibration section is the default's, and its local data folder shows by name only
    assert "## Calibration of `source15/" in card and '- data: "mixed-assistant"' in card
    assert "| `source15/forward-mixing-nu2-content-chat.safetensors` (default) |" in card
    assert "SmolLM2-demo-source-15 → SmolLM2-135M-Instruct | 15x3x64 → 30x3x64" in card
    name = "source15/backward-mixing-nu2.safetensors"
    assert (d / name).read_bytes() == (tr / name).read_bytes()
    man = json.loads((d / "manifest.json").read_text())
    assert (d / man["default"]["forward"]).is_file()

    with pytest.raises(HubError, match="source15/forward-mixing-nu2-content-chat.safetensors"):
        build_repo_folder(files[:1], tmp_path / "nodefault", "org/demo", weights / "manifest.json")
    assert not (tmp_path / "nodefault").exists()  # refused before anything is written
