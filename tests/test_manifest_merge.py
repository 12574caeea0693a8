"""weights/build/manifest.py: every writer of weights/manifest.json merges its own rows into its own
part; a rebuild of one part keeps the other part, the rows it did not build and the defaults
(the translators step used to rewrite the whole file, dropping the "moe" part and the later
translator rows and re-picking the default, after which `--pair moe` failed)."""

import json

from helpers import build_module


def _row(file, direction="forward", kl=0.3):
    nll = {"nll": 3.0}
    stats = {"native": nll, "source": nll,
             "translated": {"nll": 3.1, "kl_native": kl, "agree_native": 0.7, "gap_recovered": 0.8}}  # fmt: skip
    return {"file": file, "direction": direction, "variant": "mixing", "nu": 1,
            "key_cut": "post_norm", "heldout": {"stage1": stats, "stage2": stats}}  # fmt: skip


def _manifest():
    return {
        "pair": {"source": "s", "target": "t"},
        "default": {
            "forward": "forward-assistant.safetensors",
            "backward": "backward-a.safetensors",
        },
        "translators": [
            _row("forward-a.safetensors"),
            _row("backward-a.safetensors", "backward"),
            _row("forward-assistant.safetensors", kl=0.2),
        ],  # fmt: skip
        "command": "old",
        "moe": {
            "default": {"forward": "moe/f.safetensors"},
            "translators": [_row("moe/f.safetensors")],
        },  # fmt: skip
    }


def test_a_dense_rebuild_keeps_the_moe_part_other_rows_and_the_defaults(tmp_path):
    build = build_module("translators")
    path = tmp_path / "manifest.json"
    path.write_text(json.dumps(_manifest()))
    rebuilt = [_row("forward-a.safetensors", kl=0.1), _row("backward-a.safetensors", "backward")]
    build.write_manifest(path, rebuilt, "python -m weights.build.translators --steps 1")
    m = json.loads(path.read_text())
    assert m["moe"] == _manifest()["moe"]
    assert [r["file"] for r in m["translators"]] == [
        "forward-assistant.safetensors", "forward-a.safetensors", "backward-a.safetensors"]  # fmt: skip
    assert next(r for r in m["translators"] if r["file"] == "forward-a.safetensors") == rebuilt[0]
    assert m["default"] == _manifest()["default"]  # kept, though forward-a now scores best
    assert m["command"].endswith("--steps 1") and "previous_default" not in m
    build.write_manifest(path, rebuilt, "again", set_default=True)  # asked to: the best rebuilt
    m = json.loads(path.read_text())
    assert m["default"] == {
        "forward": "forward-a.safetensors",
        "backward": "backward-a.safetensors",
    }
    assert m["previous_default"] == _manifest()["default"] and m["moe"] == _manifest()["moe"]


def test_an_added_row_keeps_the_rest(tmp_path):
    path = tmp_path / "manifest.json"
    path.write_text(json.dumps(_manifest()))
    merge = build_module("manifest").merge_rows  # add_translator.py's call, --default
    merge(path, [_row("forward-new.safetensors")], default={"forward": "forward-new.safetensors"})
    m = json.loads(path.read_text())
    assert m["default"] == {**_manifest()["default"], "forward": "forward-new.safetensors"}
    assert m["previous_default"] == _manifest()["default"]
    assert len(m["translators"]) == 4 and m["moe"] == _manifest()["moe"]


def test_a_new_default_forward_drops_the_retention_measured_for_the_old_one(tmp_path):
    merge = build_module("manifest").merge_rows
    path = tmp_path / "manifest.json"
    kept = {"large_reads_last": 32, "recompute_share": 0.1, "points": [[1024, 0.8]]}
    first = _manifest()
    first["default"]["retention"] = kept
    path.write_text(json.dumps(first))
    merge(path, [_row("backward-b.safetensors", "backward")],
          default={"backward": "backward-b.safetensors"})  # fmt: skip
    assert json.loads(path.read_text())["default"]["retention"] == kept  # same forward file
    merge(path, [_row("forward-new.safetensors")], default={"forward": "forward-new.safetensors"})
    m = json.loads(path.read_text())
    assert "retention" not in m["default"] and m["previous_default"]["retention"] == kept


def test_a_fresh_manifest_gets_defaults(tmp_path):
    merge = build_module("manifest").merge_rows
    path = tmp_path / "manifest.json"
    merge(
        path, [_row("f.safetensors")], section="moe", initial_default={"forward": "f.safetensors"}
    )
    assert json.loads(path.read_text()) == {
        "moe": {"translators": [_row("f.safetensors")], "default": {"forward": "f.safetensors"}}}  # fmt: skip
    assert not list(tmp_path.glob(".*"))  # written atomically: no temporary file left


def test_a_rebuild_for_another_demo_source_fills_its_by_source_part(tmp_path):
    """The 8-layer source's grid (`translators` step), rebuilt into a manifest whose default
    source is another: its rows are added, its defaults go to by_source["source"] (filled where
    none), and the default, "pair" and "command" of the default source are kept."""
    build = build_module("translators")
    path = tmp_path / "manifest.json"
    start = {**_manifest(), "default": {**_manifest()["default"], "source": "source15"}}
    path.write_text(json.dumps(start))
    rebuilt = [_row("forward-a.safetensors", kl=0.1), _row("backward-a.safetensors", "backward")]
    build.write_manifest(path, rebuilt, "python -m weights.build.translators --steps 1")
    m = json.loads(path.read_text())
    assert m["default"] == start["default"] and "previous_default" not in m
    assert (m["pair"], m["command"], m["moe"]) == (start["pair"], "old", start["moe"])
    assert m["by_source"] == {"source": {"forward": "forward-a.safetensors",
                                         "backward": "backward-a.safetensors"}}  # fmt: skip
    merge = build_module("manifest").merge_rows  # a later register step's --default for it
    merge(path, [_row("forward-new.safetensors")], default={"forward": "forward-new.safetensors"},
          demo_source="source")  # fmt: skip
    m = json.loads(path.read_text())
    assert m["by_source"]["source"] == {"forward": "forward-new.safetensors",
                                        "backward": "backward-a.safetensors"}  # fmt: skip
    assert m["default"] == start["default"]
