"""Every bad input is one line (issue 49): bad values typed at every `kvlingo` command, run
through the real command group. Each must exit non-zero (2 for usage errors, 1 for the rest)
without a traceback, with one `Error:` line that names the offending argument or value.

A bad value as typed (no such path, a file for a folder, a malformed Hub id) fails before any
model loads (the checks of `cli/_params.py`, exit 2); a damaged file or an uncached Hub id
where it is read (a model folder, a translator, a prompt cache: `cli/errors.py`, exit 1), as do
a wrong direction and a wrong pair; a translator is read from its header before either model
loads. An over-long prompt names the option (exit 2).
"""

import json
import shutil

from mlx_kvlingo.cli import cli
from mlx_kvlingo.models.files import save_translator
from mlx_kvlingo.models.pair import load_pair

import pytest
from click.testing import CliRunner
from helpers import exact_translator, inverse

USAGE, FAILURE = 2, 1

# (command line, exit status, what the message must name); {X} are filled in from `files`
# fmt: off
CASES = [
    # info
    ("info /some/missing/folder", USAGE, ["MODELS", "/some/missing/folder"]),
    ("info {no_config}", FAILURE, ["no_config", "config.json"]),
    ("info {bad_config}", FAILURE, ["bad_config/config.json", "JSON"]),
    ("info {cut_weights}", FAILURE, ["cut_weights/model.safetensors", "incomplete download"]),
    ("info {junk}", USAGE, ["junk.safetensors", "not a model folder"]),
    ("info nobody/nothing", FAILURE, ["nobody/nothing", "HF_HUB_OFFLINE"]),
    ("info bad..id//x", USAGE, ["bad..id//x", "Hub id"]),
    # generate
    ("generate --source /missing/a --target {T} --translator {FWD}", USAGE, ["--source", "/missing/a"]),
    ("generate --source {S} --target ./missing/b --translator {FWD}", USAGE, ["--target", "./missing/b"]),
    ("generate --translator /missing/t.safetensors", USAGE, ["--translator", "/missing/t.safetensors"]),
    ("generate --translator {junk}", FAILURE, ["junk.safetensors", "truncated"]),
    ("generate --translator {D}", USAGE, ["--translator", "a folder"]),
    ("generate --temp -1", USAGE, ["--temp", "-1"]),
    ("generate --top-p 1.5", USAGE, ["--top-p", "1.5"]),
    ("generate --top-k -2", USAGE, ["--top-k", "-2"]),
    ("generate -m -3", USAGE, ["--max-tokens", "-3"]),
    ("generate --repetition-penalty 0", USAGE, ["--repetition-penalty"]),
    ("generate --seed -1", USAGE, ["--seed", "-1"]),
    ("generate --pair sparse", USAGE, ["--pair", "sparse"]),
    ("generate --source {S}", USAGE, ["--small", "--large"]),
    ("generate --translator source15/backward-mixing-nu2.safetensors", FAILURE, ["source15/backward-mixing-nu2.safetensors", "other way", "backward"]),
    ("generate --source {S} --target {T} --translator {BWD} -m 2", FAILURE, ["bwd.safetensors", "other way"]),
    ("generate --source {S} --target {MOE} --translator {FWD} -m 2", FAILURE, ["fwd.safetensors", "wrong model pair"]),
    ("generate --source {bad_tokenizer} --target {T} --translator {FWD} -m 2", FAILURE, ["bad_tokenizer/tokenizer.json", "not valid JSON"]),
    ("generate --source {short_s} --target {short_t} --translator {FWD} --no-chat -m 2 -p {long}", USAGE, ["--prompt", "at most 32"]),
    ("translate --source {short_s} --target {short_t} --translator {FWD} --prompt {long} -o {D}/o.safetensors", USAGE, ["--prompt", "at most 32"]),
    # chat
    ("chat --backward-translator /missing/b.safetensors", USAGE, ["--backward-translator", "/missing/b.safetensors"]),
    ("chat --max-kv-size 0", USAGE, ["--max-kv-size", "0"]),
    ("chat --recompute 1.5", USAGE, ["--recompute", "1.5"]),
    ("chat --reader-min-tokens -1", USAGE, ["--reader-min-tokens"]),
    ("chat --mode sideways", USAGE, ["--mode", "sideways"]),
    # serve
    ("serve --port 70000", USAGE, ["--port", "70000"]),
    ("serve --queue-size -1", USAGE, ["--queue-size", "-1"]),
    ("serve --max-tokens 100 --default-max-tokens 512", USAGE, ["--default-max-tokens", "--max-tokens"]),
    ("serve --source /missing/s --target {T}", USAGE, ["--source", "/missing/s"]),
    ("serve --host 0.0.0.0", USAGE, ["--host", "--api-key"]),
    # translate
    ("translate --prompt hi -o {D}/no/such/dir/out.safetensors", USAGE, ["--output", "no/such/dir"]),
    ("translate --prompt hi -o {D}", USAGE, ["--output", "{D}"]),
    ("translate --prompt-cache-file /missing/cache.safetensors -o {D}/o.safetensors", USAGE, ["--prompt-cache-file", "/missing/cache.safetensors"]),
    ("translate --prompt-cache-file {junk} -o {D}/o.safetensors", FAILURE, ["junk.safetensors", "damaged file"]),
    # eval
    ("eval --data /missing/data.jsonl", USAGE, ["--data", "/missing/data.jsonl"]),
    ("eval --source {S} --target {T} --translator {FWD} --data {bad_jsonl}", FAILURE, ["bad.jsonl:2"]),
    ("eval --heldout-fraction 2", USAGE, ["--heldout-fraction", "2"]),
    ("eval --task content --lengths 8,64", USAGE, ["--lengths", "32"]),
    ("eval --min-prefix 300 --max-prefix 100", USAGE, ["--min-prefix", "300", "--max-prefix"]),
    ("eval -n 0", USAGE, ["--examples", "0"]),
    ("eval --json {D}/no/such/r.json", USAGE, ["--json", "no/such"]),
    # bench
    ("bench --lengths 1", USAGE, ["--lengths"]),
    ("bench --preset nope", USAGE, ["--preset", "nope"]),
    ("bench -o {junk}", USAGE, ["--out", "junk.safetensors"]),
    ("bench --escalation-rate 2", USAGE, ["--escalation-rate", "2"]),
    ("bench --user-lengths a,b", USAGE, ["--user-lengths", "a,b"]),
    ("bench --max-minutes -5", USAGE, ["--max-minutes", "-5"]),
    # calibrate
    ("calibrate --source /missing/s --target {T} -o {D}/c.safetensors", USAGE, ["--source", "/missing/s"]),
    ("calibrate --source {S} --target {T} -o {D}/no/such/c.safetensors", USAGE, ["--output", "no/such"]),
    ("calibrate --source {S} --target {T} -o {D}/c.safetensors --lr 0", USAGE, ["--lr", "0"]),
    ("calibrate --source {S} --target {T} -o {D}/c.safetensors --alpha-grid a,b", USAGE, ["--alpha-grid", "a,b"]),
    ("calibrate --source {S} --target {T} -o {D}/c.safetensors --eval-every 0", USAGE, ["--eval-every", "0"]),
    # convert
    ("convert /missing/model.pt -o {D}/o.safetensors", USAGE, ["INPUT", "/missing/model.pt"]),
    ("convert {junk} -o {D}/no/such/o.safetensors", USAGE, ["--output", "no/such"]),
    ("convert {junk} -o {D}/o.safetensors", FAILURE, ["junk.safetensors"]),
    ("convert {junk} -o {D}/o.safetensors --source-layers 0", USAGE, ["--source-layers", "0"]),
    ("convert {junk} -o {D}/o.safetensors --source {S}", USAGE, ["--small", "--large"]),
    # upload
    ("upload {FWD} not-a-repo-id", USAGE, ["REPO_ID", "not-a-repo-id"]),
    ("upload /missing/t.safetensors org/name", USAGE, ["FILES", "/missing/t.safetensors"]),
    ("upload {FWD} org/name --no-push", USAGE, ["--no-push", "--folder"]),
    ("upload {FWD} org/name --folder {junk}", USAGE, ["--folder", "junk.safetensors"]),
    # download
    ("download /abs/path/t.safetensors", FAILURE, ["/abs/path/t.safetensors", "Hub id"]),
    ("download nobody/nothing", FAILURE, ["nobody/nothing", "HF_HUB_OFFLINE"]),
    ("download org/name --local-dir {junk}", USAGE, ["--local-dir", "junk.safetensors"]),
    # the group
    ("nosuchcommand", USAGE, ["nosuchcommand"]),
    ("--bogus info", USAGE, ["--bogus"]),
]
# fmt: on


@pytest.fixture(scope="module")
def files(tiny_dir, tmp_path_factory):
    """The paths the table names: the tiny pair, its translators, and broken files."""
    d = tmp_path_factory.mktemp("bad")
    pair = load_pair(tiny_dir["qwen3"], tiny_dir["known"])
    answer = tiny_dir["known_answer"]
    fwd = save_translator(exact_translator(pair, answer), d / "fwd.safetensors", pair)
    back = pair.reversed()
    bwd = save_translator(exact_translator(back, inverse(answer)), d / "bwd.safetensors", back)
    (d / "no_config").mkdir()
    shutil.copytree(tiny_dir["qwen3"], d / "bad_config")
    (d / "bad_config" / "config.json").write_text("{not json")
    shutil.copytree(tiny_dir["qwen3"], d / "cut_weights")
    weights = d / "cut_weights" / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:2000])
    shutil.copytree(tiny_dir["qwen3"], d / "bad_tokenizer")
    (d / "bad_tokenizer" / "tokenizer.json").write_text("{oops")
    (d / "junk.safetensors").write_bytes(b"junk!")
    (d / "bad.jsonl").write_text('{"text": "fine"}\n{"prompt": "no"}\n')
    for side in ("qwen3", "known"):  # the same models with a 32-token context
        shutil.copytree(tiny_dir[side], d / f"short_{side}")
        config = d / f"short_{side}" / "config.json"
        config.write_text(
            json.dumps({**json.loads(config.read_text()), "max_position_embeddings": 32})
        )
    return {
        "S": tiny_dir["qwen3"], "T": tiny_dir["known"], "MOE": tiny_dir["qwen3_moe"],
        "FWD": fwd, "BWD": bwd, "D": d, "junk": d / "junk.safetensors",
        "no_config": d / "no_config", "bad_config": d / "bad_config",
        "cut_weights": d / "cut_weights", "bad_jsonl": d / "bad.jsonl",
        "bad_tokenizer": d / "bad_tokenizer",
        "short_s": d / "short_qwen3", "short_t": d / "short_known",
        "long": " ".join(["word"] * 80),
    }  # fmt: skip


@pytest.fixture(autouse=True)
def offline(monkeypatch):
    """Hub ids are looked up in the cache only (no network in tests)."""
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.delenv("KVLINGO_DEBUG", raising=False)


def _args(line: str, files: dict) -> list[str]:
    out = []
    for word in line.split(" "):
        if word.startswith("{") and word.endswith("}"):  # one argument, spaces and all
            out.append(str(files[word[1:-1]]))
        else:
            out.append(word.format(**{k: str(v) for k, v in files.items()}))
    return out


def _error_line(result, status: int) -> str:
    """The one `Error:` line a failed command printed last, with no traceback or usage."""
    text = result.output
    assert result.exit_code != 0, text
    assert isinstance(result.exception, SystemExit), (
        f"uncaught {type(result.exception).__name__}: {result.exception}"
    )
    assert "Traceback" not in text, text
    lines = [x for x in text.splitlines() if x.strip()]
    errors = [x for x in lines if x.startswith("Error:")]
    assert len(errors) == 1 and lines[-1] == errors[0], text  # the message is the last line
    assert not any(x.startswith("Usage:") for x in lines), text
    assert result.exit_code == status, text
    return errors[0]


@pytest.mark.parametrize("line,status,names", CASES, ids=[c[0][:60] for c in CASES])
def test_bad_input_is_one_line(line, status, names, files):
    error = _error_line(CliRunner().invoke(cli, _args(line, files)), status)
    for name in names:
        want = name.format(**{k: str(v) for k, v in files.items()})
        assert want in error, f"{want!r} not named in {error!r}"


#: every command that loads a demo pair when no model is named ({D}: a scratch folder)
DEMO_COMMANDS = [
    "chat",
    "generate -m 1 -p hi",
    "serve",
    "eval -n 1",
    "translate --prompt hi -o {D}/o.safetensors",
    "bench --lengths 8 --no-progress -o {D}/bench",
]


@pytest.mark.parametrize("missing", ["demo-package", "KVLINGO_WEIGHTS-folder"])
@pytest.mark.parametrize("line", DEMO_COMMANDS, ids=[c.split(" ")[0] for c in DEMO_COMMANDS])
def test_missing_demo_files_are_one_line(line, missing, tmp_path, monkeypatch):
    """The demo's files absent (mlx_kvlingo from a wheel without the mlx-kvlingo-demo wheel,
    or $KVLINGO_WEIGHTS naming no folder): one line saying what is missing and what to do."""
    from mlx_kvlingo.models.demo import smollm2

    monkeypatch.setenv("KVLINGO_CACHE", str(tmp_path / "cache"))
    if missing == "KVLINGO_WEIGHTS-folder":
        monkeypatch.setenv("KVLINGO_WEIGHTS", str(tmp_path / "nowhere"))
        names = [f"demo weights not found in {tmp_path / 'nowhere'}", "KVLINGO_WEIGHTS"]
    else:  # as test_wheel_install.py: no weights/ beside the package, no demo package
        monkeypatch.delenv("KVLINGO_WEIGHTS", raising=False)
        monkeypatch.setattr(smollm2, "ASSETS_PACKAGE", "kvlingo_demo_stand_in")
        monkeypatch.setattr(smollm2, "_beside_package", lambda: tmp_path / "site" / "weights")
        names = ["the demo's files are not installed", "mlx-kvlingo-demo", "KVLINGO_WEIGHTS"]
    result = CliRunner().invoke(cli, _args(line, {"D": tmp_path}))
    error = _error_line(result, FAILURE)
    for name in names:
        assert name in error, f"{name!r} not named in {error!r}"


def test_the_table_covers_every_command():
    covered = {line.split(" ")[0] for line, _, _ in CASES}
    assert set(cli.list_commands(None)) <= covered, set(cli.list_commands(None)) - covered
    assert len(CASES) >= 30


def test_debug_shows_the_traceback(files, monkeypatch):
    """--debug (or KVLINGO_DEBUG=1) shows the traceback behind a one-line error."""
    line = "generate --source {S} --target {T} --translator {BWD} -m 2"
    plain = CliRunner().invoke(cli, _args(line, files))
    assert plain.exit_code == 1 and "Traceback" not in plain.output
    debug = CliRunner().invoke(cli, ["--debug", *_args(line, files)])
    assert debug.exit_code != 0
    shown = debug.output + "".join(
        __import__("traceback").format_exception(*debug.exc_info)
        if not isinstance(debug.exception, SystemExit)
        else []
    )
    assert "Traceback" in shown and "TranslatorFileError" in shown
    env = CliRunner().invoke(cli, _args(line, files), env={"KVLINGO_DEBUG": "1"})
    assert env.exit_code != 0
    assert "TranslatorFileError" in (env.output + repr(env.exception))


def test_programming_errors_keep_their_traceback(monkeypatch):
    """An error no user can cause is not hidden behind a one-line message."""
    import mlx_kvlingo.api as api

    def broken(*a, **k):
        raise TypeError("a bug")

    monkeypatch.setattr(api, "load", broken)
    result = CliRunner().invoke(cli, ["generate", "-m", "1"])
    assert isinstance(result.exception, TypeError)


def test_the_installed_command_prints_one_line(tmp_path):
    """The real entry point in a fresh process: exit status 2, one line, no traceback."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    import mlx_kvlingo

    root = Path(mlx_kvlingo.__file__).resolve().parents[1]  # the code under test
    env = {**os.environ, "PYTHONPATH": str(root), "HF_HUB_OFFLINE": "1"}
    env.pop("KVLINGO_DEBUG", None)
    run = subprocess.run(
        [sys.executable, "-m", "mlx_kvlingo.cli", "info", "/some/missing/folder"],
        capture_output=True, text=True, env=env, cwd=tmp_path, timeout=120,
    )  # fmt: skip
    assert run.returncode == 2, run.stderr
    assert "Traceback" not in run.stderr
    lines = [x for x in run.stderr.splitlines() if x.strip()]
    assert len(lines) == 1 and "/some/missing/folder" in lines[0], run.stderr


def test_only_refusals_raised_on_purpose_become_one_line():
    """A ValueError our code raises with `raise` is a refusal; one raised by a call inside it
    (`int("x")`, NumPy) is a bug and keeps its traceback."""
    from mlx_kvlingo.cli.errors import message
    from mlx_kvlingo.models.loading import load_models_and_translators

    import numpy as np

    with pytest.raises(ValueError) as refused:
        load_models_and_translators(demo_pair="sparse")
    assert message(refused.value) == "unknown demo pair 'sparse' (known: dense, moe)"
    with pytest.raises(ValueError) as bug:
        int("x")
    assert message(bug.value) is None
    with pytest.raises(ValueError) as bug:
        np.zeros(3).reshape(2, 2)
    assert message(bug.value) is None
    assert message(KeyError("k")) is None and message(TypeError("t")) is None
    assert message(FileNotFoundError(2, "No such file or directory", "/x/y")).startswith("/x/y:")


#: bad translator files, each refused from its header before either model loads
# fmt: off
EARLY = [
    ("generate --translator {junk}", ["junk.safetensors", "truncated"]),
    ("generate --source {S} --target {T} --translator {cut} -m 2", ["cut.safetensors", "truncated"]),
    ("generate --source {S} --target {T} --translator {torch_zip} -m 2", ["torch_zip.pt", "PyTorch", "kvlingo convert"]),
    ("generate --source {S} --target {T} --translator {pickle} -m 2", ["pickle.pt", "pickle", "kvlingo convert"]),
    ("generate --source {S} --target {T} --translator {schema} -m 2", ["schema.safetensors", "unknown schema"]),
    ("generate --source {S} --target {T} --translator {BWD} -m 2", ["bwd.safetensors", "other way"]),
    ("chat --source {S} --target {T} --translator {FWD} --backward-translator {FWD}", ["fwd.safetensors", "other way"]),
]
# fmt: on


@pytest.fixture
def no_model_loads(monkeypatch):
    """Fail the test where a model would load."""
    from mlx_kvlingo.models import pair

    def refuse(*a, **k):
        pytest.fail("a model loaded before the translator file was refused")

    monkeypatch.setattr(pair, "load_model", refuse)
    monkeypatch.setattr(pair, "load_pair", refuse)


@pytest.mark.parametrize("line,names", EARLY, ids=[c[0][:60] for c in EARLY])
def test_a_bad_translator_is_refused_before_the_models_load(line, names, files, no_model_loads):
    import mlx.core as mx

    d = files["D"]
    (d / "cut.safetensors").write_bytes(files["FWD"].read_bytes()[:300])
    (d / "torch_zip.pt").write_bytes(b"PK\x03\x04" + b"\0" * 60)
    (d / "pickle.pt").write_bytes(b"\x80\x02}q\x00.")
    meta = {"kvlingo": json.dumps({"schema": "someone-else/translator", "schema_version": 1})}
    mx.save_safetensors(str(d / "schema.safetensors"), {"w": mx.zeros(2)}, metadata=meta)
    paths = {**files, **{k: d / f"{k}.pt" for k in ("torch_zip", "pickle")}}
    paths |= {k: d / f"{k}.safetensors" for k in ("cut", "schema")}
    error = _error_line(CliRunner().invoke(cli, _args(line, paths)), FAILURE)
    for name in names:
        assert name in error, f"{name!r} not named in {error!r}"


def test_the_api_refuses_a_bad_translator_before_the_models_load(files, no_model_loads):
    from mlx_kvlingo import load
    from mlx_kvlingo.models.files import TranslatorFileError

    with pytest.raises(TranslatorFileError, match="truncated or not a safetensors file"):
        load(files["S"], files["T"], files["junk"])
    with pytest.raises(
        TranslatorFileError, match="bwd.safetensors: this translator goes the other"
    ):
        load(files["S"], files["T"], files["BWD"])
    with pytest.raises(
        TranslatorFileError, match="fwd.safetensors: this translator goes the other"
    ):
        load(files["S"], files["T"], files["FWD"], backward_translator=files["FWD"])
