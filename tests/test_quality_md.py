"""weights/build/quality_md.py: the build steps rewrite their own section of QUALITY.md only
(the translators step used to rewrite the whole file, dropping every later section)."""

from helpers import build_module


def test_sections_are_replaced_and_the_rest_kept(tmp_path):
    q = build_module("quality_md")
    path = tmp_path / "QUALITY.md"
    path.write_text("## Notes by hand\n\nkeep me\n")
    q.write_section(path, "demo-pair", "# Demo\n\ntable v1\n", first=True)
    q.write_section(path, "moe-pair", "## MoE\n\nmoe v1\n")
    text = path.read_text()
    assert text.index("table v1") < text.index("keep me") < text.index("moe v1")
    q.write_section(path, "demo-pair", "# Demo\n\ntable v2\n", first=True)
    q.write_section(path, "moe-pair", "## MoE\n\nmoe v2\n")
    again = path.read_text()
    assert again == text.replace("table v1", "table v2").replace("moe v1", "moe v2")
    q.write_section(path, "moe-pair", "## MoE\n\nmoe v2\n")  # idempotent: no blank lines pile up
    assert path.read_text() == again
