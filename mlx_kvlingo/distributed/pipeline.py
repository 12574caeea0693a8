"""The large model pipeline-sharded across ranks (Macs) with MLX's distributed engine.

For N ranks started by `mlx.launch`, rank r owns target layers [a_r, b_r) (mlx-lm's split:
rank 0 the LAST layers, rank N-1 the first):

    rank 0:  the source (whole), the conversation, the terminal; target layers [a_0, L)
    rank r:  target layers [a_r, b_r) only, and the translator rows of those layers

`load_sharded_pair` loads that; `place` puts one translated span on every rank at once (SPMD):

    rank 0 has the span's source K/V (L_s, 1, H_s, T, D_s), RoPE-free
    wire "source": rank r is sent the source layers its target rows read, S_r, and maps them
    wire "target": rank 0 maps every target layer, rank r is sent its rows (b_r - a_r layers)
    every rank: k_norm (pre_norm cut), RoPE at the span's positions, native first token, dtype

`wire="auto"` sends the fewer bytes (`choose_wire`). Only MLX moves data. A rank that dies
surfaces on the others as `RankLostError`; one that never connects or hangs blocks inside MLX
with the GIL held, so `watchdog` ends the process with one line.
"""

from __future__ import annotations

import os
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path

from mlx_kvlingo.distributed import watchdog as _watchdog
from mlx_kvlingo.kv.capture import SpanKV
from mlx_kvlingo.kv.translator import Translator
from mlx_kvlingo.models.pair import (
    LoadedModel,
    ModelPair,
    _folder_of,
    geometry_of,
    vocab_fingerprint,
    with_dtype,
)

import mlx.core as mx

WIRES = ("auto", "source", "target")
DEFAULT_TIMEOUT = 120.0
#: the load ends in a barrier that waits for the slowest rank to read its weights
LOAD_TIMEOUT = 1800.0


class DistributedError(RuntimeError):
    """A distributed run cannot go on (a rank is lost, or the ranks disagree)."""


class RankLostError(DistributedError):
    pass


def launched() -> bool:
    """True when this process was started as one rank of several (mlx.launch or mpirun)."""
    env = os.environ
    if "MLX_RANK" in env and ("MLX_HOSTFILE" in env or "MLX_JACCL_DEVICES" in env):
        return True
    return int(env.get("OMPI_COMM_WORLD_SIZE", "1")) > 1


def init(timeout: float | None) -> mx.distributed.Group:
    """The world group; ends the process with a clear message if the ranks do not all meet
    within `timeout` seconds (a host down, a wrong hostfile, a firewall)."""
    with deadline(os.environ.get("MLX_RANK", "?"), timeout, "connecting to the other ranks"):
        group = mx.distributed.init(strict=launched())
        _eval(mx.distributed.all_sum(mx.array(1.0), group=group, stream=mx.cpu))
    return group


def deadline(rank, timeout: float | None, what: str):
    """End this process with one line if the block runs past `timeout` seconds."""
    message = (
        f"kvlingo: rank {rank}: no answer from the other ranks within {timeout or 0:g} s while {what}. "
        "A rank died, hangs or cannot connect: check that every host in the hostfile is up "
        "and runs the same command, that the hostfile's addresses and ports are reachable "
        "(firewall), and each rank's own error output."
    )
    return _watchdog.deadline(timeout, message)


def _eval(*arrays) -> None:
    with _lost_as_error("waiting for another rank"):
        mx.eval(*arrays)


@contextmanager
def _lost_as_error(what: str):
    """MLX's error for a peer whose connection closed, as a `RankLostError`."""
    try:
        yield
    except RuntimeError as e:
        if any(s in str(e) for s in ("[ring]", "[mpi]", "[jaccl]", "peer")):
            raise RankLostError(
                f"lost a rank of the distributed run while {what} ({e}); "
                "see that rank's own error output"
            ) from None
        raise


def pipeline_model(model, group) -> None:
    """Keep only this rank's layers of an mlx-lm model, with mlx-lm's own `pipeline()` (for
    llama, which has none: `PipelineMixin.pipeline` and qwen2's pipelined forward)."""
    inner = model.model
    if hasattr(inner, "pipeline"):
        inner.pipeline(group)
        return
    from mlx_lm.models.llama import LlamaModel
    from mlx_lm.models.pipeline import PipelineMixin
    from mlx_lm.models.qwen2 import Qwen2Model

    if not isinstance(inner, LlamaModel):
        raise DistributedError(
            f"mlx-lm cannot pipeline {type(model).__module__}: no `pipeline()` for this family"
        )
    if any(getattr(layer, "use_sliding", False) for layer in inner.layers):
        raise DistributedError("pipelining llama models with sliding-window layers is unsupported")
    PipelineMixin.pipeline(inner, group)
    inner.layers = inner.layers[inner.start_idx :]
    # qwen2's pipelined forward is llama's graph without sliding windows, over `pipeline_layers`
    pipelined = {"__call__": Qwen2Model.__call__, "pipeline_layers": property(lambda m: m.layers)}
    inner.__class__ = type("LlamaPipeline", (type(inner),), pipelined)


def load_pipelined(path: str | Path, group) -> LoadedModel:
    """This rank's share of the target, through `mlx_lm.utils.sharded_load` (each rank reads
    only its files); llama through a lazy `mlx_lm.load` and `pipeline_model`."""
    from mlx_lm import load as mlx_lm_load
    from mlx_lm.utils import sharded_load

    name = str(path)
    with deadline(group.rank(), LOAD_TIMEOUT, f"loading {name}"), _lost_as_error(f"loading {name}"):
        try:
            model, tokenizer, config = sharded_load(name, pipeline_group=group, return_config=True)
        except (ValueError, FileNotFoundError) as e:
            # llama (no `pipeline()` in mlx-lm) or a local folder without a weight index
            if isinstance(e, ValueError) and "does not support pipelining" not in str(e):
                raise
            model, tokenizer, config = mlx_lm_load(name, lazy=True, return_config=True)
            pipeline_model(model, group)
        model, _ = with_dtype(model, config, "auto")
        _eval(model.parameters())
        _eval(mx.distributed.all_sum(mx.array(1.0), group=group, stream=mx.cpu))
    return LoadedModel(name, model, tokenizer, config, geometry_of(model, config), _folder_of(name))


@dataclass
class ShardedPair:
    """Everything one rank holds: the source only on rank 0, its own target layers."""

    group: object
    source: LoadedModel | None
    target: LoadedModel  # this rank's layers only
    translator: Translator  # rank 0: every row (it maps); others: their rows
    owners: list[range]  # target layers of each rank
    wire: str
    timeout: float | None
    local: dict = field(default_factory=dict, repr=False)  # per-rank translator parts

    @property
    def rank(self) -> int:
        return self.group.rank()

    @property
    def size(self) -> int:
        return self.group.size()

    def source_rows(self, r: int) -> tuple[int, ...]:
        """Source layers read by rank r's target layers (what wire "source" sends it)."""
        c, own = self.translator.config, self.owners[r]
        rows = c.key_layers[own.start : own.stop] + c.value_layers[own.start : own.stop]
        return tuple(sorted({s for row in rows for s in row}))

    def payload(self, r: int, wire: str):
        """(the geometry, the number of layers) of what rank r is sent on `wire`."""
        c = self.translator.config
        if wire == "source":
            return c.source, len(self.source_rows(r))
        return c.target, len(self.owners[r])

    def choose_wire(self) -> str:
        """`wire`, or for "auto" the one that sends the other ranks fewer bytes (a tie: target)."""
        if self.wire != "auto":
            return self.wire

        def per_token(wire: str) -> int:  # K/V elements per token sent to the other ranks
            sizes = (self.payload(r, wire) for r in range(1, self.size))
            return sum(n * side.kv_heads * (side.head_dim + side.value_dim) for side, n in sizes)

        return min(("target", "source"), key=per_token)

    def part(self, wire: str) -> Translator:
        """This rank's rows of the translator, fed what `wire` sends it."""
        if wire not in self.local:
            rows = self.source_rows(self.rank) if wire == "source" else None
            self.local[wire] = self.translator.restricted(self.owners[self.rank], rows)
        return self.local[wire]


def load_sharded_pair(source, target, translator, group, wire: str, timeout) -> ShardedPair:
    """Load the pair on every rank: the source on rank 0 only, the target pipelined;
    `translator` a file every rank reads and checks against the whole target (rank 0: the pair)."""
    from mlx_kvlingo.models.files import check_pair, load_translator, read_metadata
    from mlx_kvlingo.models.pair import check_same_tokenizer, load_model

    if wire not in WIRES:
        raise ValueError(f"unknown wire {wire!r}; expected one of {WIRES}")
    tgt = load_pipelined(target, group)
    inner = tgt.model.model
    gathered = mx.distributed.all_gather(mx.array([inner.start_idx, inner.end_idx]), group=group)
    _eval(gathered)
    owners = [range(a, b) for a, b in gathered.reshape(-1, 2).tolist()]
    whole = replace(tgt, geometry=replace(tgt.geometry, layers=sum(len(r) for r in owners)))
    tr = load_translator(translator)
    src = None
    if group.rank() == 0:
        src = load_model(source)
        check_same_tokenizer(src.tokenizer, tgt.tokenizer)
        pair = ModelPair(src, whole, tgt.tokenizer, vocab_fingerprint(tgt.tokenizer))
        check_pair(read_metadata(translator), tr.config, pair, translator)
    tr.check_target(whole)
    return ShardedPair(group, src, tgt, tr, owners, wire, timeout)


def _broadcast(x: mx.array, group, timeout, what="waiting for rank 0") -> mx.array:
    """Rank 0's `x` on every rank (a sum where the others add zeros); shapes must agree."""
    x = x if group.rank() == 0 else mx.zeros_like(x)
    with deadline(group.rank(), timeout, what):
        y = mx.distributed.all_sum(x, group=group, stream=mx.cpu)
        _eval(y)
    return y


def place(
    sp: ShardedPair, span: SpanKV | None, wire: str, length: int, start: int, first: int
) -> tuple[list, list, int]:
    """Every rank (SPMD): this rank's target layers' K/V for a translated span, ready to append,
    and the bytes it sent (rank 0) or received. Rank 0 passes the source span (RoPE-free,
    tokens [start, start + length)), the others None; `first`: the span's first token id when
    it starts at 0, else -1 (a native-first translator keeps the target's own K/V there)."""
    with deadline(sp.rank, sp.timeout, f"placing a {length}-token span"):
        if sp.rank == 0:
            payloads, sent = _send_payloads(sp, span, wire)
        else:
            payloads = recv_kv(sp, 0, *sp.payload(sp.rank, wire), length)
            sent = sum(x.nbytes for x in payloads)
        tokens = (first,) if start == 0 and first >= 0 else None
        part = sp.part(wire)
        if wire == "source":
            keys, values = part.translate(SpanKV(*payloads, start, tokens), sp.target)
        else:
            meta = SpanKV(mx.zeros((0,)), mx.zeros((0,)), start, tokens)
            keys, values = part.finish(payloads[0], payloads[1], meta, sp.target)
    return keys, values, sent


def _send_payloads(sp: ShardedPair, span: SpanKV, wire: str) -> tuple[tuple, int]:
    """Rank 0: send every other rank its payload (float32); -> its own, the bytes sent."""
    # wire "target": every target layer translated here, RoPE-free; a rank gets its own layers
    keys, values = sp.translator(span) if wire == "target" else (span.keys, span.values)
    payloads = []
    for r in range(sp.size):
        rows = mx.array(list(sp.source_rows(r) if wire == "source" else sp.owners[r]))
        payloads.append((keys[rows].astype(mx.float32), values[rows].astype(mx.float32)))
    _eval(
        [mx.distributed.send(x, r, group=sp.group) for r in range(1, sp.size) for x in payloads[r]]
    )
    return payloads[0], sum(x.nbytes for kv in payloads[1:] for x in kv)


def recv_kv(sp: ShardedPair, src: int, side, n: int, length: int) -> tuple[mx.array, mx.array]:
    """K and V (float32) of `n` layers of geometry `side` and `length` tokens, from rank `src`."""
    dims = (side.head_dim, side.value_dim)
    k, v = (
        mx.distributed.recv((n, 1, side.kv_heads, length, d), mx.float32, src, group=sp.group)
        for d in dims
    )
    _eval(k, v)
    return k, v
