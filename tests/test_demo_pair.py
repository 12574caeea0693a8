"""The shipped demo pair: translators load, validate against the pair, beat the source alone;
the demo runs end to end with no arguments."""

import json

from mlx_kvlingo.data import DataConfig, load_examples
from mlx_kvlingo.demo.pair import demo_data, load_demo, manifest
from mlx_kvlingo.demo.smollm2 import weights_dir
from mlx_kvlingo.format import TranslatorFileError, load_translator
from mlx_kvlingo.measure.evaluate import evaluate

import pytest
from click.testing import CliRunner


@pytest.fixture(scope="module")
def forward():
    return load_demo()


@pytest.fixture(scope="module")
def held(forward):
    pair, _ = forward
    cfg = DataConfig(16, 256, 32, heldout_fraction=1.0, max_heldout=8, seed=1)
    return load_examples(demo_data()[1], pair.tokenizer, cfg)[1]


def test_manifest_lists_files_with_checksums():
    import hashlib

    m = manifest()
    assert m["default"]["forward"] and m["default"]["backward"]
    for row in m["translators"]:
        path = weights_dir() / "translators" / row["file"]
        assert hashlib.sha256(path.read_bytes()).hexdigest() == row["sha256"]
        assert row["direction"] in ("forward", "backward")


def test_every_shipped_translator_validates_against_its_pair(forward):
    pair, _ = forward
    for row in manifest()["translators"]:
        path = weights_dir() / "translators" / row["file"]
        if row["direction"] == "forward":
            load_translator(path, pair)
        else:
            load_translator(path, pair.reversed())
            with pytest.raises(TranslatorFileError):
                load_translator(path, pair)  # the wrong direction is refused


def test_default_translator_beats_source_alone(forward, held):
    pair, tr = forward
    result = evaluate(pair, tr, held, progress=False)
    assert result["translated"]["nll"] < result["source"]["nll"]
    assert result["translated"]["kl_native"] < result["source"]["kl_native"]


def test_demo_runs_with_no_arguments():
    from mlx_kvlingo.cli import cli

    out = CliRunner().invoke(cli, ["generate", "-m", "12"])
    assert out.exit_code == 0, out.output
    assert "translation" in out.output and len(out.output.split("\n")[0].strip()) > 0


def test_eval_on_demo_defaults(tmp_path):
    from mlx_kvlingo.cli import cli

    out = CliRunner().invoke(cli, ["eval", "-n", "3", "--json", str(tmp_path / "e.json")])
    assert out.exit_code == 0, out.output
    result = json.loads((tmp_path / "e.json").read_text())
    assert set(result) >= {"native", "translated", "raw", "source"}
