"""The kill test: a process that saves a file over and over is killed with SIGKILL at a random
moment, and the file it was replacing must still load, whole, as the last version it finished
or the one it was writing (never a torn file, never nothing).

Kinds: translator files (`format.save_translator`), session files (`Session.save`) and
stage-2 checkpoints (`distill.save_checkpoint`: the translator, the optimizer state and
`state.json` must agree). Each version saved carries its number (translator metadata, the
session's system prompt, the checkpoint's step); the saver logs each number once its save
returned.

The savers are forked from a "zygote" process that has imported everything but never run an
MLX computation (forking after one deadlocks MLX's CPU threads), so a saver starts in a
fraction of a second; loading and checking happens here, in the parent. POSIX only.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import random
import signal
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
KINDS = ("translator", "session", "checkpoint")
FILES = {"translator": "t.safetensors", "session": "s.safetensors", "checkpoint": "ckpt"}


# -- the savers (run in forked children) ---------------------------------------------------


def _saver(kind: str, out: Path, fixtures: Path, log: Path, size_mb: float) -> None:
    """Save version 0, 1, 2, ... of a `kind` file at `out` until killed; log each one."""
    from mlx_kvlingo.kv.translator import Side, Translator, TranslatorConfig
    from mlx_kvlingo.models.files import save_translator

    import mlx.core as mx

    logf = open(log, "a", buffering=1)
    n = int(size_mb * 2**20 / 4 / 2) // 4  # floats per layer map: two maps of 4 layers
    dim = max(int(n**0.5), 8)
    side = Side(4, 1, dim, dim)
    rows = tuple((t,) for t in range(4))
    tr = Translator(TranslatorConfig("mixing", side, side, rows, rows))
    tr.key["weight"] = mx.random.normal(tr.key["weight"].shape)
    tr.value["weight"] = mx.random.normal(tr.value["weight"].shape)
    mx.eval(tr.parameters())
    if kind == "session":
        from mlx_kvlingo.config import ReaderPolicy
        from mlx_kvlingo.conversation.session import Session
        from mlx_kvlingo.models.files import load_translator
        from mlx_kvlingo.models.pair import load_pair

        pair = load_pair(fixtures / "qwen3", fixtures / "known")
        s = Session(
            pair,
            load_translator(fixtures / "fwd.safetensors", pair),
            None,
            policy=ReaderPolicy(large_reads_last=1, recompute_share=0.0),
        )
        s.add_user("def parse_args(argv):\n    return argv[1:] " * 12)
        list(s.generate("source", max_tokens=2))
    if kind == "checkpoint":
        from mlx_kvlingo.calibrate.distill import Stage2Config, save_checkpoint

        import mlx.optimizers as optim

        opt = optim.AdamW(learning_rate=1e-3)
        opt.init(tr.trainable_parameters())
        opt.update(tr, tr.trainable_parameters())  # fills the moments
        mx.eval(opt.state)
    import time as _time

    for v in range(10**9):
        t0 = _time.perf_counter()
        if kind == "translator":
            save_translator(tr, out, version=v)
        elif kind == "session":
            s.system_prompt = f"v{v}"
            s.save(out)
        else:
            tr.config.metadata["version"] = v
            save_checkpoint(out, tr, opt, v, Stage2Config(), [{"step": v}])
        logf.write(f"{v} {_time.perf_counter() - t0:.6f}\n")


def _zygote(conn, fixtures: str) -> None:
    """Import everything, compute nothing; fork a saver per request."""
    sys.path[:0] = [str(ROOT / "tests"), str(ROOT)]
    import mlx_kvlingo  # noqa: F401
    from mlx_kvlingo.calibrate import distill  # noqa: F401
    from mlx_kvlingo.conversation.session import Session  # noqa: F401
    from mlx_kvlingo.models.pair import load_pair  # noqa: F401

    import mlx.optimizers  # noqa: F401

    conn.send("ready")
    while True:
        try:
            msg = conn.recv()
        except EOFError:
            return
        if msg is None:
            return
        if msg[0] == "reap":
            os.waitpid(msg[1], 0)
            conn.send("reaped")
            continue
        _, kind, out, log, size_mb = msg
        pid = os.fork()
        if pid == 0:  # the saver
            code = 0
            try:
                conn.close()
                _saver(kind, Path(out), Path(fixtures), Path(log), size_mb)
            except BaseException:  # noqa: BLE001
                import traceback

                traceback.print_exc()
                code = 1
            os._exit(code)
        conn.send(pid)


# -- the campaign (runs here) -------------------------------------------------------------


@dataclass
class KillReport:
    kind: str
    kills: int = 0
    intact: int = 0  # the file loaded, whole, at a version the saver had reached
    previous: int = 0  # ... the last version it had finished (killed mid-save)
    newer: int = 0  # ... the version it was writing (killed after the rename)
    failures: list = field(default_factory=list)
    leftover_temp_files: int = 0
    save_ms: float = 0.0  # mean time per save
    seconds: float = 0.0


class Verifier:
    """Loads what the savers wrote (here: this process may compute)."""

    def __init__(self, fixtures: Path):
        self.fixtures = fixtures
        self._session = None

    def version(self, kind: str, out: Path) -> int:
        if kind == "translator":
            from mlx_kvlingo.models.files import load_translator

            return load_translator(out).config.metadata["version"]
        if kind == "session":
            if self._session is None:
                from mlx_kvlingo.config import ReaderPolicy
                from mlx_kvlingo.conversation.session import Session
                from mlx_kvlingo.models.pair import load_pair

                pair = load_pair(self.fixtures / "qwen3", self.fixtures / "known")
                self._session = Session(
                    pair, None, None, policy=ReaderPolicy(large_reads_last=1, recompute_share=0.0)
                )
            self._session.load(out)
            return int(self._session.system_prompt[1:])
        from mlx_kvlingo.calibrate.distill import load_checkpoint
        from mlx_kvlingo.models.files import load_translator

        import mlx.core as mx

        state, tr_file, opt_file = load_checkpoint(out)
        v = load_translator(tr_file).config.metadata["version"]
        mx.load(str(opt_file))
        if v != state["step"]:
            raise AssertionError(
                f"checkpoint state.json says step {state['step']}, its translator {v}"
            )
        return v


def kill_campaign(kind: str, kills: int, folder: Path, fixtures: Path, *, seed: int = 0,
                  size_mb: float = 4.0, zygote=None, verifier=None) -> KillReport:  # fmt: skip
    """Start a saver, let it finish at least one save, SIGKILL it at a random moment, check."""
    rng = random.Random(f"{seed}:{kind}")
    report = KillReport(kind)
    own = zygote is None
    zygote = zygote or Zygote(fixtures)
    verifier = verifier or Verifier(fixtures)
    t0 = time.perf_counter()
    durations: list[float] = []
    try:
        for k in range(kills):
            d = folder / f"{kind}-{k}"
            d.mkdir(parents=True, exist_ok=True)
            out, log = d / FILES[kind], d / "log"
            log.write_text("")
            pid = zygote.fork(kind, out, log, size_mb)
            try:
                _wait_for(log, 1, 120)  # version 0 is on disk
                took = _log(log)[0][1]  # how long one save takes: kill within about two
                time.sleep(rng.uniform(0, 2 * took))
                os.kill(pid, signal.SIGKILL)
            finally:
                zygote.reap(pid)
            entries = _log(log)
            durations += [t for _, t in entries]
            report.save_ms = 1000 * sum(durations) / len(durations)
            done = [v for v, _ in entries]
            report.kills += 1
            last = done[-1]
            try:
                v = verifier.version(kind, out)
            except Exception as e:  # noqa: BLE001 - the finding
                report.failures.append((k, f"{type(e).__name__}: {e}"))
                continue
            if v == last:
                report.previous += 1
            elif v == last + 1:
                report.newer += 1
            else:
                report.failures.append((k, f"loaded version {v}, the saver had finished {last}"))
                continue
            report.intact += 1
            report.leftover_temp_files += len(list(d.glob(".*.tmp*"))) + len(
                list(d.glob("*/.*.tmp*"))
            )
    finally:
        if own:
            zygote.close()
    report.seconds = time.perf_counter() - t0
    return report


def _log(log: Path) -> list[tuple[int, float]]:
    out = []
    for line in log.read_text().splitlines():
        parts = line.split()
        if len(parts) == 2:  # a line being written when the saver was killed is not counted
            out.append((int(parts[0]), float(parts[1])))
    return out


def _versions(log: Path) -> list[int]:
    return [v for v, _ in _log(log)]


def _wait_for(log: Path, n: int, timeout: float) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if len(_versions(log)) >= n:
            return True
        time.sleep(0.002)
    raise TimeoutError(f"the saver did not finish {n} save(s) within {timeout} s")


class Zygote:
    def __init__(self, fixtures: Path):
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_zygote, args=(child, str(fixtures)), daemon=True)
        self.proc.start()
        child.close()
        if not self.conn.poll(300):
            raise RuntimeError("the zygote did not start within 300 s")
        self.conn.recv()

    def fork(self, kind, out, log, size_mb) -> int:
        self.conn.send(("fork", kind, str(out), str(log), size_mb))
        return self.conn.recv()

    def reap(self, pid: int) -> None:
        with _suppress():
            os.kill(pid, signal.SIGKILL)
        self.conn.send(("reap", pid))
        self.conn.recv()

    def close(self) -> None:
        with _suppress():
            self.conn.send(None)
        self.proc.join(10)
        if self.proc.is_alive():
            self.proc.kill()


class _suppress:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return exc[0] is not None and issubclass(exc[0], (OSError, ProcessLookupError))
