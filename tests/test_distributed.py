"""The target pipeline-sharded over two ranks on localhost (ring backend, CPU).

Known-answer pairs (exact translators) whose targets are qwen3_moe and llama: decoding from
the translated cache on 2 ranks equals single-process decoding token for token. A rank that
dies, or never connects, ends rank 0 with a clear error within a timeout. Every run has a
hard time limit and its processes are killed (by process group) whatever happens.
"""

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from mlx_kvlingo import synthetic as syn
from mlx_kvlingo.decode import generate
from mlx_kvlingo.format import save_translator
from mlx_kvlingo.pair import load_pair

import pytest
from helpers import exact_translator

RANK_SCRIPT = str(Path(__file__).with_name("distributed_rank.py"))
PROMPT = "def foo(x):\n    return x + 1\n\nclass Bar:"
pytestmark = pytest.mark.skipif(shutil.which("mlx.launch") is None, reason="needs mlx.launch")


def _env():
    env = dict(os.environ)
    here = [str(Path(__file__).resolve().parents[1])]
    env["PYTHONPATH"] = os.pathsep.join(here + [p for p in [env.get("PYTHONPATH")] if p])
    return env


def _run(cmd, timeout, env=None):
    """Run `cmd` in its own process group; kill the whole group on timeout or at the end."""
    p = subprocess.Popen(
        cmd, env=env or _env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        start_new_session=True, text=True,
    )  # fmt: skip
    try:
        out, err = p.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)
        out, err = p.communicate()
        pytest.fail(f"{cmd[0]} ran past {timeout} s\n{err[-3000:]}")
    finally:
        try:
            os.killpg(p.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    return p.returncode, out, err


@pytest.fixture(scope="module")
def known_pairs(tiny_dir, tmp_path_factory):
    """(case list, single-process reference tokens) for qwen3_moe and llama known-answer pairs."""
    d = tmp_path_factory.mktemp("dist")
    cases = []
    for kind, wires in (("qwen3_moe", ("source", "target")), ("llama", ("auto",))):
        answer = syn.known_answer_target(tiny_dir[kind], d / f"known_{kind}", seed=4)
        pair = load_pair(tiny_dir[kind], d / f"known_{kind}")
        tr = exact_translator(pair, answer)
        path = save_translator(tr, d / f"exact_{kind}.safetensors", pair)
        ref = [int(r.token) for r in generate(pair, tr, PROMPT, max_tokens=10)]
        for wire in wires:
            cases.append({
                "kind": kind, "source": str(tiny_dir[kind]), "target": str(d / f"known_{kind}"),
                "translator": str(path), "wire": wire, "prompt": PROMPT, "max_tokens": 10,
                "ref": ref,
            })  # fmt: skip
    return d, cases


def test_two_ranks_decode_like_one_process(known_pairs):
    d, cases = known_pairs
    job = d / "job.json"
    job.write_text(json.dumps({"cases": cases, "out": str(d / "out.json"), "timeout": 60}))
    cmd = ["mlx.launch", "--backend", "ring", "-n", "2", "--python", sys.executable]
    rc, out, err = _run([*cmd, RANK_SCRIPT, str(job)], timeout=240)
    assert rc == 0, err[-3000:]
    results = json.loads((d / "out.json").read_text())
    for case, res in zip(cases, results, strict=True):
        assert res["tokens"] == case["ref"], (case["kind"], case["wire"])
        owners = res["owners"]
        assert all(b > a for a, b in owners) and owners[0][1] == max(b for _, b in owners)
        assert res["local_layers"] == owners[0][1] - owners[0][0]  # rank 0: its layers only
    moe = [r for c, r in zip(cases, results) if c["kind"] == "qwen3_moe"]
    assert {r["wire"] for r in moe} == {"source", "target"}
    # the exact translator maps layer l from source layer l: both wires carry the same bytes
    assert moe[0]["bytes"] == moe[1]["bytes"] > 0


def _free_ports(n):
    socks = [socket.socket() for _ in range(n)]
    for s in socks:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports


def _hostfile(tmp_path, n=2):
    path = tmp_path / "hosts.json"
    path.write_text(json.dumps([[f"127.0.0.1:{p}"] for p in _free_ports(n)]))
    return path


def _start_rank(rank, hostfile, job, extra_env=None):
    env = {**_env(), "MLX_RANK": str(rank), "MLX_HOSTFILE": str(hostfile), **(extra_env or {})}
    return subprocess.Popen(
        [sys.executable, RANK_SCRIPT, str(job)], env=env, stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, start_new_session=True, text=True,
    )  # fmt: skip


def _finish(procs, timeout):
    """Wait for rank 0 (hard limit), then kill every process group started."""
    t0 = time.monotonic()
    try:
        _, err = procs[0].communicate(timeout=timeout)
        return procs[0].returncode, err, time.monotonic() - t0
    except subprocess.TimeoutExpired:
        pytest.fail(f"rank 0 hung past {timeout} s")
    finally:
        for p in procs:
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            p.communicate()


def test_a_rank_that_dies_is_a_clear_error_on_rank_0(known_pairs, tmp_path):
    _, cases = known_pairs
    job = tmp_path / "job.json"
    job.write_text(json.dumps({"cases": cases[:1], "out": str(tmp_path / "o.json"), "timeout": 20}))
    hosts = _hostfile(tmp_path)
    procs = [
        _start_rank(0, hosts, job),
        _start_rank(1, hosts, job, {"KVLINGO_TEST_DIE_AT": "1:0"}),  # dies before loading
    ]
    rc, err, took = _finish(procs, timeout=120)
    assert rc != 0
    assert "RankLostError" in err or "no answer from the other ranks" in err, err[-2000:]
    assert took < 120


def test_a_rank_that_cannot_connect_is_a_clear_error_on_rank_0(known_pairs, tmp_path):
    _, cases = known_pairs
    job = tmp_path / "job.json"
    job.write_text(json.dumps({"cases": cases[:1], "out": str(tmp_path / "o.json"), "timeout": 3}))
    procs = [_start_rank(0, _hostfile(tmp_path), job)]  # rank 1 never starts
    rc, err, took = _finish(procs, timeout=90)
    assert rc != 0
    assert "no answer from the other ranks within 3 s while connecting" in err, err[-2000:]
