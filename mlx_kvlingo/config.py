"""The reader policy: every setting of who reads a turn and how much the large model recomputes,
in one frozen value with the one set of defaults.

Before the large model answers a turn it lacks, someone reads it:

    reader "self"    the large model reads the turn itself (exact, the slow path on long turns);
    reader "small"   the small model reads it, the span the large lacks is translated, then the
                     large reads the last `large_reads_last` tokens itself and recomputes
                     `recompute_share` of the translated span (the tokens its read attended to;
                     on a span past 2,048 tokens as many as on one of 2,048: kv.recompute.Selection);
    reader "tokens"  "small" for the opening span and spans of `reader_min_tokens` or more;
    reader "auto"    whichever path is predicted to start the answer sooner (ties within
                     `reader.READER_MARGIN` go to the token rule), but the small path only where this
                     translator is measured to keep at least `min_retention` of what the large
                     model gets right reading the turn itself, at the turn's length
                     (conversation/reader.py; 0: time alone). None: "auto" with a forward
                     translator, "self" without.

Change a policy with `dataclasses.replace`; it validates itself on construction, and
`to_dict` / `from_dict` save and restore it whole (the conversation files keep it).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields, replace

READERS = ("auto", "tokens", "small", "self")
#: how a model catches up on the turns it lacks (conversation/session.py)
MODES = ("alternation", "naive", "reprefill")
#: model "auto": the large model answers again where the small answer's confidence is below this
AUTO_THRESHOLD = -1.5
#: the conversation bench's policies (eval/conversation_bench.py), as changes to the reader policy
POLICIES = {
    "large reads": {"reader": "self"},
    "small reads": {"reader": "small"},
    "auto reads": {"reader": "auto"},
    "cascade": {"reader": "self"},
}
#: settings files kept that became constants beside their code or were retired: read, dropped
RETIRED = ("reader_margin", "ahead_chunk", "ahead_share", "translate_ahead")


class PolicyError(ValueError):
    """A reader-policy value out of range (the message names the setting)."""


@dataclass(frozen=True)
class ReaderPolicy:
    reader: str | None = None
    reader_min_tokens: int = 64
    large_reads_last: int = 32
    recompute_share: float = 0.1
    min_retention: float = 0.8

    def __post_init__(self):
        if self.reader is not None and self.reader not in READERS:
            raise PolicyError(
                f"unknown reader {self.reader!r}; expected one of {', '.join(READERS)}"
            )
        _whole("reader_min_tokens", self.reader_min_tokens, 0)
        _whole("large_reads_last", self.large_reads_last, 1)
        _number("recompute_share", self.recompute_share, 0.0, 1.0)
        _number("min_retention", self.min_retention, 0.0, 1.0)

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict, base: ReaderPolicy | None = None) -> ReaderPolicy:
        """The policy a file saved; settings it lacks keep `base`'s (default: today's
        defaults), retired ones are dropped, unknown ones fail."""
        names = {f.name for f in fields(cls)}
        unknown = sorted(set(d) - names - set(RETIRED))
        if unknown:
            raise PolicyError(f"unknown reader-policy setting(s): {', '.join(unknown)}")
        return replace(base or cls(), **{k: v for k, v in d.items() if k in names})


def _whole(name: str, n, least: int) -> None:
    if not isinstance(n, int) or isinstance(n, bool) or n < least:
        raise PolicyError(f"{name} must be a whole number >= {least} (got {n!r})")


def _number(name: str, x, low: float, high: float) -> None:
    if isinstance(x, bool) or not isinstance(x, (int, float)) or not low <= x <= high:
        raise PolicyError(f"{name} must be a number in [{low}, {high}] (got {x!r})")


__all__ = ["READERS", "PolicyError", "ReaderPolicy"]
