"""The shipped demo pair: translators load, validate against the pair, beat the source alone;
the demo runs end to end with no arguments."""

import json

from mlx_kvlingo.data.examples import DataConfig, load_examples
from mlx_kvlingo.eval.evaluate import evaluate
from mlx_kvlingo.models.demo.pair import demo_data, load_demo, manifest
from mlx_kvlingo.models.demo.smollm2 import weights_dir
from mlx_kvlingo.models.files import TranslatorFileError, load_translator

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


def test_every_shipped_translator_validates_against_its_pair():
    from mlx_kvlingo.models.demo.pair import demo_models, source_for
    from mlx_kvlingo.models.pair import load_pair

    pairs = {}
    for row in manifest()["translators"]:
        path = weights_dir() / "translators" / row["file"]
        small = source_for(str(path), reverse=row["direction"] == "backward")
        if small not in pairs:
            pairs[small] = load_pair(*demo_models("dense", small))
        pair = pairs[small]
        if row["direction"] == "forward":
            load_translator(path, pair)
        else:
            load_translator(path, pair.reversed())
            with pytest.raises(TranslatorFileError):
                load_translator(path, pair)  # the wrong direction is refused


def test_default_translator_beats_source_alone(forward, held):
    pair, tr = forward
    result = evaluate(pair, tr, held)
    assert result["translated"]["nll"] < result["source"]["nll"]
    assert result["translated"]["kl_native"] < result["source"]["kl_native"]


def test_demo_runs_with_no_arguments():
    from mlx_kvlingo.cli import cli

    out = CliRunner().invoke(cli, ["generate", "-m", "12"])
    assert out.exit_code == 0, out.output
    assert "translated" in out.output and len(out.output.split("\n")[0].strip()) > 0


def test_eval_on_demo_defaults(tmp_path):
    from mlx_kvlingo.cli import cli

    out = CliRunner().invoke(cli, ["eval", "-n", "3", "--json", str(tmp_path / "e.json")])
    assert out.exit_code == 0, out.output
    result = json.loads((tmp_path / "e.json").read_text())
    assert set(result) >= {"native", "translated", "raw", "source"}


def test_each_translator_reads_the_demo_source_with_its_layer_count():
    """The small model of a demo pair is the one the translator reads, found by its layer count
    (15: `source15`, the default); a file that reads the large model going forward, or a
    translator for a small model not shipped, is refused."""
    from mlx_kvlingo.kv.translator import Side, Translator, TranslatorConfig, nearest_layer_map
    from mlx_kvlingo.models.demo.pair import default_source, source_for

    assert default_source() == manifest()["default"]["source"] == "source15"
    assert source_for(None) == "source15"
    assert source_for("source15/forward-mixing-nu2-content-chat.safetensors") == "source15"
    assert source_for("source15/backward-mixing-nu2.safetensors", reverse=True) == "source15"
    with pytest.raises(ValueError, match="reads a 30-layer small model.*other way"):
        source_for("source15/backward-mixing-nu2.safetensors")  # forward, it reads the large one
    rows = tuple(map(tuple, nearest_layer_map(8, 30, 2)))
    eight = Translator(
        TranslatorConfig("mixing", Side(8, 3, 64, 64), Side(30, 3, 64, 64), rows, rows)
    )
    with pytest.raises(
        ValueError, match=r"reads a 8-layer small model; the demo's are source15 \(15"
    ):
        source_for(eight)  # weights/source/ (8 layers) is not shipped


def test_the_defaults_load_the_15_layer_source_both_ways():
    from mlx_kvlingo.models.demo.pair import defaults
    from mlx_kvlingo.models.loading import load_models_and_translators

    pair, fwd, back = load_models_and_translators()
    assert pair.source.geometry.layers == fwd.config.source.layers == 15
    assert back.config.target.layers == 15
    with pytest.raises(FileNotFoundError, match="ships no translators for 'source'"):
        defaults(source="source")  # the 8-layer source's translators left the tree
