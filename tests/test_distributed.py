"""The large model pipeline-sharded over two ranks on localhost (ring backend, CPU).

One `mlx.launch` runs `distributed_api.py`, a script on the public API alone, on known-answer
pairs (exact translators both ways) whose targets are qwen3_moe and llama: every answer of a
conversation that exercises every kind of turn equals the same script in one process, token
for token, on both wires. The launch ends with a rank that dies in the middle of a switch:
rank 0 reports it as a lost rank within the time limit. A rank that never connects ends
rank 0 with a clear error. Every run has a hard time limit and its processes are killed (by
process group) whatever happens.
"""

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
from pathlib import Path

from mlx_kvlingo.models.files import save_translator
from mlx_kvlingo.models.pair import load_pair

import pytest
from helpers import exact_translator, inverse, known_answer_target

SCRIPT = str(Path(__file__).with_name("distributed_api.py"))
pytestmark = pytest.mark.skipif(shutil.which("mlx.launch") is None, reason="needs mlx.launch")


def _env(**extra):
    env = dict(os.environ)
    here = [str(Path(__file__).resolve().parents[1])]
    env["PYTHONPATH"] = os.pathsep.join(here + [p for p in [env.get("PYTHONPATH")] if p])
    return {**env, **extra}


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
def cases(tiny_dir, tmp_path_factory):
    """Known-answer pairs (qwen3_moe on both wires, llama) with exact translators both ways."""
    d = tmp_path_factory.mktemp("dist")
    out = []
    for kind, wires in (("qwen3_moe", ("source", "target")), ("llama", ("auto",))):
        answer = known_answer_target(tiny_dir[kind], d / f"known_{kind}", seed=4)
        pair = load_pair(tiny_dir[kind], d / f"known_{kind}")
        fwd = save_translator(exact_translator(pair, answer), d / f"fwd_{kind}.safetensors", pair)
        back = exact_translator(pair.reversed(), inverse(answer))
        back = save_translator(back, d / f"back_{kind}.safetensors", pair.reversed())
        for wire in wires:
            out.append({"kind": kind, "source": str(tiny_dir[kind]), "wire": wire,
                        "target": str(d / f"known_{kind}"), "translator": str(fwd),
                        "backward": str(back), "short": wire == "target"})  # fmt: skip
    return d, out


def test_two_ranks_answer_like_one_process_and_a_lost_rank_is_reported(cases):
    import distributed_api

    d, cases = cases
    dying = {**cases[-1], "die": True, "timeout": 30}
    job = d / "job.json"
    job.write_text(json.dumps({"cases": [*cases, dying], "out": str(d / "out.json")}))
    cmd = ["mlx.launch", "--backend", "ring", "-n", "2", "--python", sys.executable, SCRIPT]
    _, _, err = _run([*cmd, str(job)], timeout=240)
    text = (d / "out.json").read_text() if (d / "out.json").exists() else ""
    assert text, err[-3000:]
    results = json.loads(text)
    assert len(results) == len(cases) + 1, err[-3000:]
    for case, res in zip(cases, results):
        ref = distributed_api.run_case(case, distributed=False)
        assert res["turns"] == ref["turns"], (case["kind"], case["wire"])
        assert res.get("stats") == ref.get("stats")
        assert res["ranks"] == 2 and ref["ranks"] == 1
        owners = res["owners"]  # rank 0 holds the last layers, and only those
        assert owners[0][1] == max(b for _, b in owners) and owners[1][0] == 0
        assert res["local_layers"] == owners[0][1] - owners[0][0]
        assert res["recompute_default"] == 0 and "pipelined" in res["recompute_error"]
        assert res["bytes_sent"] > 0 and res["bytes_received"] > 0  # both ways over the wire
        if not case.get("short"):  # reader tokens: the small read the opening, the large "ok"
            assert res["turns"][-3]["read"] > 0 == res["turns"][-2]["read"]
            assert res["turns"][-1]["read"] > 0 and res["turns"][-1]["prompt"] == 3
    lost = results[-1]
    assert lost["error"] == "RankLostError", lost
    assert "lost a rank" in lost["message"] and lost["seconds"] < 30


def _free_ports(n):
    socks = [socket.socket() for _ in range(n)]
    for s in socks:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports


def test_a_rank_that_cannot_connect_is_a_clear_error_on_rank_0(cases, tmp_path):
    _, cases = cases
    hosts = tmp_path / "hosts.json"
    hosts.write_text(json.dumps([[f"127.0.0.1:{p}"] for p in _free_ports(2)]))
    job = tmp_path / "job.json"
    job.write_text(json.dumps({"cases": [{**cases[0], "timeout": 3}], "out": str(tmp_path / "o")}))
    env = _env(MLX_RANK="0", MLX_HOSTFILE=str(hosts))  # rank 1 never starts
    rc, _, err = _run([sys.executable, SCRIPT, str(job)], timeout=90, env=env)
    assert rc != 0
    assert "no answer from the other ranks within 3 s while connecting" in err, err[-2000:]


def test_one_rank_runtime_answers_like_one_process_and_refuses_saving(cases, tmp_path):
    """The distributed code path in this process (a group of one): the same answers; what a
    pipelined target cannot do is refused with a clear error."""
    from mlx_kvlingo import Conversation, ConversationError, load

    import distributed_api

    _, cases = cases
    case = {**cases[0], "short": True}
    one_rank = distributed_api.run_case(case, distributed=True)
    assert one_rank["turns"] == distributed_api.run_case(case, distributed=False)["turns"]
    with load(case["source"], case["target"], case["translator"], distributed=True) as rt:
        chat = Conversation(rt)
        list(chat.send("def foo(x):", "large", max_tokens=2))
        with pytest.raises(ConversationError, match="not available"):
            chat.save(tmp_path / "s")
        with pytest.raises(RuntimeError, match="close the open distributed runtime"):
            load(case["source"], case["target"], case["translator"], distributed=True)
    with pytest.raises(RuntimeError, match="closed"):
        list(chat.send("more", "large", max_tokens=2))
