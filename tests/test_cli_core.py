"""`kvlingo translate` (prompt cache file in, prompt cache file out), `generate` and `info`."""

import json
import re
import subprocess
import sys

from mlx_kvlingo.cli import cli
from mlx_kvlingo.models.files import save_translator
from mlx_kvlingo.models.pair import load_pair

import mlx.core as mx
from click.testing import CliRunner
from helpers import exact_translator
from mlx_lm import stream_generate
from mlx_lm.models.cache import load_prompt_cache, make_prompt_cache, save_prompt_cache

PROMPT = "def main(argv=None):\n    parser = argparse.ArgumentParser(prog="
HEAVY = ("mlx_lm", "transformers", "torch")


def test_help_and_usage_errors_import_no_model_library():
    """`kvlingo --help`, every `kvlingo <cmd> --help` and a usage error load neither mlx-lm nor
    transformers nor torch: a command imports what it needs only when it runs."""
    code = (
        "import sys\n"
        "from mlx_kvlingo.cli import main\n"
        "try:\n"
        "    main()\n"
        "except SystemExit as e:\n"
        f"    heavy = sorted(m for m in sys.modules if m.split('.')[0] in {HEAVY!r})\n"
        "    print('EXIT', e.code, 'HEAVY', heavy[:3], file=sys.stderr)\n"
    )
    names = sorted(cli.list_commands(None))
    assert len(names) == 11
    for args in (["--help"], *([n, "--help"] for n in names), ["chat", "--reader", "nope"]):
        run = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True)
        status = 2 if args[-1] == "nope" else 0
        assert run.stderr.splitlines()[-1] == f"EXIT {status} HEAVY []", (args, run.stderr)


def test_translate_prompt_cache_file_for_mlx_lm(tiny_dir, tmp_path):
    pair = load_pair(tiny_dir["qwen3"], tiny_dir["known"])
    tr_path = save_translator(
        exact_translator(pair, tiny_dir["known_answer"]), tmp_path / "t.safetensors", pair
    )
    tokens = pair.tokenizer.encode(PROMPT)
    # what `mlx_lm.cache_prompt` writes: the source's cache of the prompt, with metadata
    src_cache = make_prompt_cache(pair.source.model)
    pair.source.model(mx.array(tokens[:-1])[None], cache=src_cache)
    meta = {"model": str(tiny_dir["qwen3"]), "tokenizer_config": json.dumps({})}
    save_prompt_cache(str(tmp_path / "src.safetensors"), src_cache, meta)
    out = CliRunner().invoke(cli, [
        "translate", "--source", str(tiny_dir["qwen3"]), "--target", str(tiny_dir["known"]),
        "--translator", str(tr_path), "--prompt-cache-file", str(tmp_path / "src.safetensors"),
        "-o", str(tmp_path / "tgt.safetensors"),
    ])  # fmt: skip
    assert out.exit_code == 0, out.output
    cache, meta = load_prompt_cache(str(tmp_path / "tgt.safetensors"), return_metadata=True)
    assert meta["model"] == str(tiny_dir["known"]) and cache[0].offset == len(tokens) - 1
    got = [r.token for r in stream_generate(pair.target.model, pair.tokenizer, mx.array(tokens[-1:]),
                                            max_tokens=40, prompt_cache=cache)]  # fmt: skip
    want = [
        r.token
        for r in stream_generate(pair.target.model, pair.tokenizer, mx.array(tokens), max_tokens=40)
    ]
    assert got == want


def test_translate_refuses_wrong_pair_and_bad_usage(tiny_dir, tmp_path):
    pair = load_pair(tiny_dir["qwen3"], tiny_dir["known"])
    tr_path = save_translator(
        exact_translator(pair, tiny_dir["known_answer"]), tmp_path / "t.safetensors", pair
    )
    out = CliRunner().invoke(cli, [
        "translate", "--source", str(tiny_dir["qwen3"]), "--target", str(tiny_dir["qwen3_moe"]),
        "--translator", str(tr_path), "--prompt", "hello", "-o", str(tmp_path / "x.safetensors"),
    ])  # fmt: skip
    assert out.exit_code != 0 and "wrong model pair" in out.output
    out = CliRunner().invoke(cli, [
        "translate", "--source", str(tiny_dir["qwen3"]), "--target", str(tiny_dir["known"]),
        "--translator", str(tr_path), "-o", str(tmp_path / "x.safetensors"),
    ])  # fmt: skip
    assert out.exit_code != 0 and "exactly one of" in out.output


def test_generate_and_info(tiny_dir, tmp_path):
    pair = load_pair(tiny_dir["qwen3"], tiny_dir["known"])
    tr_path = save_translator(
        exact_translator(pair, tiny_dir["known_answer"]), tmp_path / "t.safetensors", pair
    )
    out = CliRunner().invoke(cli, [
        "generate", "--small", str(tiny_dir["qwen3"]), "--large", str(tiny_dir["known"]),
        "--translator", str(tr_path), "-p", PROMPT, "--no-chat", "-m", "8",
    ])  # fmt: skip
    assert out.exit_code == 0, out.output
    # the library's status line: the small model read the prompt (all but its last token),
    # translated for the large one, which read the last token itself; the TTFT is at least those
    n = len(pair.tokenizer.encode(PROMPT)) - 1
    m = re.search(rf"small read {n} tok (\d+) ms · translated {n} tok ([\d.]+) ms · "
                  r"large read 1 tok .*TTFT (\d+) ms", out.output)  # fmt: skip
    assert m, out.output
    assert int(m.group(3)) >= int(m.group(1)) + float(m.group(2)) - 1
    out = CliRunner().invoke(cli, ["info", str(tiny_dir["qwen3_moe"])])
    assert out.exit_code == 0, out.output
    assert "GFLOP/s" in out.output and "qwen3_moe" in out.output


def test_prompt_longer_than_context_is_refused(tiny_dir):
    from mlx_kvlingo.config import ReaderPolicy
    from mlx_kvlingo.conversation.session import Session
    from mlx_kvlingo.conversation.stream import ContextOverflowError

    import pytest

    pair = load_pair(tiny_dir["qwen3"], tiny_dir["known"])
    tr = exact_translator(pair, tiny_dir["known_answer"])
    limit = pair.target.context_length
    s = Session(pair, tr, policy=ReaderPolicy(reader="small"))
    s.add_tokens([5] * (limit + 1))
    with pytest.raises(ContextOverflowError, match=f"handles at most {limit}"):
        s.generate("target")
    assert s.held("source") == 0 and s.held("target") == 0  # refused before any work
