"""Multi-turn quality: does a conversation that crosses models several times stay sound?

Over real dialogues (the Chit Chat Challenge conversations of the `chitchat-dataset`
package), the two models take turns answering: the first assistant turn by `first`, every
later one by the other model, so each turn after the first is a switch. At every turn the
answering model catches up under each mode (see `session.py`) and then scores the real next
message by teacher forcing: its mean NLL per token. Re-prefill is the reference (the
answering model read everything itself); the report is the deviation of alternation and
naive from it, per switch index.
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable, Sequence
from pathlib import Path

from mlx_kvlingo.config import ReaderPolicy
from mlx_kvlingo.conversation.records import LABEL
from mlx_kvlingo.conversation.session import MODES, Session
from mlx_kvlingo.kv.translator import Translator
from mlx_kvlingo.models.pair import ModelPair

import numpy as np


def load_chitchat(
    n: int = 20,
    *,
    min_messages: int = 22,
    max_chars: int = 400,
    seed: int = 0,
    heldout_only: bool = True,
) -> list[list[str]]:
    """`n` dialogues with at least `min_messages` messages, each a list of message texts.

    With `heldout_only`, only dialogues of the demo's held-out split (never used to heal the
    demo source or calibrate its translators) are used.

    A message joins one speaker's consecutive utterances with spaces; speakers alternate, so
    even indices are the user's and odd ones the assistant's. Texts are cut at `max_chars`.
    """
    try:
        import chitchat_dataset
    except ImportError:
        raise ImportError(
            "the multi-turn evaluation reads the chitchat-dataset package: "
            "pip install chitchat-dataset"
        ) from None
    data = json.loads((Path(chitchat_dataset.__file__).parent / "dataset.json").read_text())
    dialogues = []
    from mlx_kvlingo.models.demo.data import is_heldout

    for key in sorted(data):
        if heldout_only and not is_heldout(key):
            continue
        msgs = [" ".join(u["text"] for u in m).strip()[:max_chars] for m in data[key]["messages"]]
        if len(msgs) >= min_messages and all(msgs[:min_messages]):
            dialogues.append(msgs)
    random.Random(seed).shuffle(dialogues)
    return dialogues[:n]


def evaluate_multiturn(
    pair: ModelPair,
    forward: Translator,
    backward: Translator | None,
    dialogues: Sequence[Sequence[str]],
    switches: int = 10,
    *,
    modes: Sequence[str] = MODES,
    first: str = "source",
    system_prompt: str | None = None,
    progress: Callable[[int, str], None] | None = None,
) -> dict:
    """Score the real next turn under each mode while the models alternate.

    Each dialogue gives `switches + 1` assistant turns (shorter dialogues give fewer). Returns
    a dict: per turn (turn 0 has no switch; turn k is switch k) the answering model, the mean
    NLL per mode and the mean deviation `NLL(mode) - NLL(reprefill)`; a summary per mode;
    translated tokens per mode. `progress(dialogue_index, mode)` is called as it goes.
    """
    modes = list(dict.fromkeys([*modes, "reprefill"]))
    turns = switches + 1
    nll = {m: np.full((len(dialogues), turns), np.nan) for m in modes}
    translated = dict.fromkeys(modes, 0)
    fallbacks = 0
    answering = []
    for t in range(turns):
        answering.append(first if t % 2 == 0 else ("target" if first == "source" else "source"))
    for d, dialogue in enumerate(dialogues):
        for mode in modes:
            s = Session(
                pair,
                forward,
                backward,
                mode,
                system_prompt=system_prompt,
                policy=ReaderPolicy(large_reads_last=1, recompute_share=0.0, reader="self"),
            )
            for t in range(turns):
                if 2 * t + 1 >= len(dialogue):
                    break
                s.add_user(dialogue[2 * t])
                lps = s.score(answering[t], dialogue[2 * t + 1])
                nll[mode][d, t] = -float(np.mean(lps))
            translated[mode] += sum(sw.translated for sw in s.switches)
            if mode == "alternation":
                fallbacks += sum(1 for sw in s.switches if sw.note and not sw.translated)
            if progress:
                progress(d, mode)
    ref = nll["reprefill"]
    rows = _turn_rows(nll, turns)
    for row, model in zip(rows, answering):
        row["model"] = model
    summary = {}
    for m in modes:
        if m == "reprefill":
            continue
        dev = (nll[m] - ref)[:, 1:]  # switches only
        dev = dev[~np.isnan(dev)]
        summary[m] = {
            "mean_deviation": _mean(dev),
            "mean_abs_deviation": _mean(np.abs(dev)),
            "max_abs_turn_deviation": max(
                (abs(r["deviation"][m]) for r in rows[1:] if r["deviation"][m] is not None),
                default=None,
            ),
        }
    return {
        "dialogues": len(dialogues),
        "switches": switches,
        "first": first,
        "modes": modes,
        "backward": backward is not None,
        "fallback_switches": fallbacks,
        "turns": rows,
        "summary": summary,
        "translated_tokens": translated,
        "pair": {"source": pair.source.name, "target": pair.target.name},
    }


READER_CONDITIONS = ("reprefill", "small", "auto", "self")


def evaluate_reader(
    pair: ModelPair,
    forward: Translator,
    backward: Translator | None,
    dialogues: Sequence[Sequence[str]],
    turns: int = 10,
    *,
    system_prompt: str | None = None,
    progress: Callable[[int, str], None] | None = None,
) -> dict:
    """The large model answers every assistant turn; score the real next turn by teacher forcing.

    Conditions per dialogue: `reprefill` (the large model reads every turn itself, all
    native: the reference), `small` (reader "small": the small model reads each user turn,
    gets the large's answers by backward translation, and the large catches up by forward
    translation), `auto` (the token rule, reader "tokens", which reader "auto" falls back to
    on a tie: the small reads the opening span and turns of `reader_min_tokens` or more, the
    large shorter later turns; quality, not time, so not the timed choice) and `self` (reader "self" in
    alternation mode: with the large answering every turn it reads everything itself, so it
    must equal the reference: a sanity row).
    Per turn: the mean NLL per condition and the deviation from the reference.
    """
    nll = {c: np.full((len(dialogues), turns), np.nan) for c in READER_CONDITIONS}
    translated = dict.fromkeys(READER_CONDITIONS, 0)
    read_by_small = dict.fromkeys(READER_CONDITIONS, 0)
    for d, dialogue in enumerate(dialogues):
        for cond in READER_CONDITIONS:
            mode = "reprefill" if cond == "reprefill" else "alternation"
            reader = {"small": "small", "auto": "tokens"}.get(cond, "self")
            s = Session(
                pair,
                forward,
                backward,
                mode,
                system_prompt=system_prompt,
                policy=ReaderPolicy(large_reads_last=1, recompute_share=0.0, reader=reader),
            )
            for t in range(turns):
                if 2 * t + 1 >= len(dialogue):
                    break
                s.add_user(dialogue[2 * t])
                nll[cond][d, t] = -float(np.mean(s.score("target", dialogue[2 * t + 1])))
            translated[cond] += sum(sw.translated for sw in s.switches)
            read_by_small[cond] += sum(t.read.tokens for t in s.turns if t.read is not None)
            if progress:
                progress(d, cond)
    ref = nll["reprefill"]
    rows = _turn_rows(nll, turns)
    summary = {}
    for c in ("small", "auto", "self"):
        dev = nll[c] - ref
        dev = dev[~np.isnan(dev)]
        half = turns // 2
        early, late = (nll[c] - ref)[:, :half], (nll[c] - ref)[:, half:]
        summary[c] = {
            "mean_deviation": _mean(dev),
            "mean_abs_deviation": _mean(np.abs(dev)),
            "mean_abs_first_half": _mean(np.abs(early[~np.isnan(early)])),
            "mean_abs_second_half": _mean(np.abs(late[~np.isnan(late)])),
        }
    return {
        "kind": "reader",
        "dialogues": len(dialogues),
        "turns_per_dialogue": turns,
        "backward": backward is not None,
        "turns": rows,
        "summary": summary,
        "translated_tokens": translated,
        "read_by_small_tokens": read_by_small,
        "pair": {"source": pair.source.name, "target": pair.target.name},
    }


def render_reader_table(result: dict, console=None):
    """Print (and return) the reader-mode table: NLL per turn, deviation from the reference."""
    from rich.console import Console
    from rich.table import Table

    def f(x, signed=False):
        return "-" if x is None else (f"{x:+.4f}" if signed else f"{x:.4f}")

    table = Table(
        "turn", "dialogues", "NLL re-prefill", "NLL small reads", "Δ small reads",
        "|Δ| small reads", "|Δ| reader auto", "Δ reader self",
        title=(
            f"reader mode: the large answers every turn · {result['dialogues']} dialogues · "
            f"{result['pair']['source']} reads for {result['pair']['target']}"
        ),
    )  # fmt: skip
    for r in result["turns"]:
        table.add_row(
            str(r["turn"]), str(r["dialogues"]), f(r["nll"]["reprefill"]), f(r["nll"]["small"]),
            f(r["deviation"]["small"], True), f(r["abs_deviation"]["small"]),
            f(r["abs_deviation"]["auto"]), f(r["deviation"]["self"], True),
        )  # fmt: skip
    sm, auto = result["summary"]["small"], result["summary"]["auto"]
    read = result["read_by_small_tokens"]
    table.caption = (
        f"small reads: mean Δ {f(sm['mean_deviation'], True)}, mean |Δ| "
        f"{f(sm['mean_abs_deviation'])} (turns 0-{result['turns_per_dialogue'] // 2 - 1}: "
        f"{f(sm['mean_abs_first_half'])}, later: {f(sm['mean_abs_second_half'])}); "
        f"{read['small']} tokens read by the small model, "
        f"{result['translated_tokens']['small']} translated · reader auto: mean |Δ| "
        f"{f(auto['mean_abs_deviation'])}, {read['auto']} tokens read by the small model, "
        f"{result['translated_tokens']['auto']} translated · reader self: mean |Δ| "
        f"{f(result['summary']['self']['mean_abs_deviation'])}"
    )
    (console or Console()).print(table)
    return table


def _turn_rows(nll: dict, turns: int) -> list[dict]:
    """Per turn: dialogues scored, mean NLL per condition, and each condition's mean deviation
    (and mean |deviation|) from `nll["reprefill"]`, over the dialogues that reached the turn."""
    ref = nll["reprefill"]
    rows = []
    for t in range(turns):
        ok = ~np.isnan(ref[:, t])
        row = {"turn": t, "dialogues": int(ok.sum()), "nll": {}, "deviation": {}}
        row["abs_deviation"] = {}
        for c, values in nll.items():
            row["nll"][c] = _mean(values[ok, t])
            if c != "reprefill":
                dev = values[ok, t] - ref[ok, t]
                row["deviation"][c] = _mean(dev)
                row["abs_deviation"][c] = _mean(np.abs(dev))
        rows.append(row)
    return rows


def _mean(x) -> float | None:
    x = np.asarray(x, dtype=float)
    return float(x.mean()) if x.size else None


def render_table(result: dict, console=None):
    """Print (and return) the per-switch table: NLL under re-prefill and each mode's deviation."""
    from rich.console import Console
    from rich.table import Table

    others = [m for m in result["modes"] if m != "reprefill"]
    table = Table(
        "switch",
        "answers",
        "dialogues",
        "NLL re-prefill",
        *[h for m in others for h in (f"Δ {m}", f"|Δ| {m}")],
        title=(
            f"multi-turn NLL on the real next turn · {result['dialogues']} dialogues · "
            f"{result['pair']['source']} <-> {result['pair']['target']}"
        ),
    )

    def f(x, signed=False):
        return "-" if x is None else (f"{x:+.4f}" if signed else f"{x:.4f}")

    for r in result["turns"]:
        label = "0 (none)" if r["turn"] == 0 else str(r["turn"])
        model = LABEL[r["model"]]
        table.add_row(
            label,
            model,
            str(r["dialogues"]),
            f(r["nll"]["reprefill"]),
            *[
                c
                for m in others
                for c in (f(r["deviation"][m], signed=True), f(r["abs_deviation"][m]))
            ],
        )
    summary = " · ".join(
        f"{m}: mean Δ {f(s['mean_deviation'], True)}, mean |Δ| {f(s['mean_abs_deviation'])}, "
        f"worst switch |mean Δ| {f(s['max_abs_turn_deviation'])}"
        for m, s in result["summary"].items()
    )
    table.caption = summary + (
        "" if result["backward"] else " · no backward translator: switches to small re-prefill"
    )
    (console or Console()).print(table)
    return table
