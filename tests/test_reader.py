"""Reader policy: the small model reads every user turn, the large one answers from the
translated cache (issue 12), on the known-answer tiny pair where translation is exact; and
reader "auto", the default: the small reads the opening span and long turns only."""

import json
from dataclasses import replace

from mlx_kvlingo.config import PolicyError, ReaderPolicy
from mlx_kvlingo.conversation.reader import ReadCosts
from mlx_kvlingo.conversation.session import Session
from mlx_kvlingo.conversation.stream import (
    DEFAULTS,
    Read,
    Sampling,
    SessionError,
    Switch,
    TurnStats,
    resolve,
    status_line,
)

import mlx.core as mx
import pytest
from helpers import (
    PLAIN,
    assert_session_consistent,
    exact_translator,
    native_tokens,
    plain,
    translated_spans,
)
from mlx_lm.sample_utils import make_sampler

MESSAGES = [
    "def parse_args(argv):",
    "class Foo(object):",
    "import json\nimport os",
    "return value",
    "for item in items:",
    "print(x)",
    "with open(path) as f:",
    "raise ValueError(msg)",
    "if __name__ == '__main__':",
    "x = [i for i in range(10)]",
]
N = 12


def converse(s, turns=10, schedule=None, sampler=None, seed=None):
    out = []
    for i in range(turns):
        s.add_user(MESSAGES[i % len(MESSAGES)])
        if seed is not None:
            mx.random.seed(seed + i)
        model = schedule[i] if schedule else "large"
        out.append([e.token for e in s.generate(model, max_tokens=N, sampler=sampler)])
    return out


def native(model, tokenizer, tokens, n=N):
    return native_tokens(model, tokenizer, tokens, n)


assert_consistent = assert_session_consistent


def assert_translated_once(s):
    """Spans into each model never overlap: no span is translated twice."""
    for into in ("source", "target"):
        spans = sorted((a, b) for _, a, b in translated_spans(s, into))
        for (_, b), (c, _) in zip(spans, spans[1:]):
            assert b <= c, spans


@pytest.mark.parametrize("seeded", [False, True])
def test_reader_equals_reprefill_over_ten_turns(pair, translators, seeded):
    fwd, bwd = translators
    sampler = make_sampler(temp=0.8, top_p=0.95) if seeded else None
    seed = 7 if seeded else None
    s = Session(pair, fwd, bwd, policy=plain(reader="small"))
    ref = Session(pair, fwd, bwd, mode="reprefill", policy=PLAIN)
    got, want = converse(s, sampler=sampler, seed=seed), converse(ref, sampler=sampler, seed=seed)
    assert got == want and s.tokens == ref.tokens
    assert all(len(t) > 0 for t in got)
    # the large model read one token per turn; the small read every user turn for it
    large = [t for t in s.turns if t.model == "target"]
    assert [t.prompt_tokens for t in large] == [1] * 10
    assert all(t.read is not None and t.read.tokens > 0 for t in large)
    # and after its first turn, the small got each of the large's answers translated back
    assert all(t.read.catch_up is not None and t.read.catch_up.translated for t in large[1:])
    assert_translated_once(s)
    assert_consistent(s)
    # each span into the large is exactly what it lacked: contiguous from 0 to the last read
    spans = [(a, b) for _, a, b in translated_spans(s, "target")]
    assert spans[0][0] == 0
    n = len(s.tokens)
    assert all(b - a >= 1 for a, b in spans) and spans[-1][1] < n


def test_the_large_reads_the_last_tokens_itself_on_the_translated_rest(pair, translators):
    """`large_reads_last=k`: the small model reads up to the turn's last k tokens, only those
    are translated, and the large model reads the last k itself; with exact translators the
    answers are the re-prefill's token for token. A turn of at most k tokens the large reads
    whole, and says why."""
    fwd, bwd = translators
    k = 8
    s = Session(
        pair, fwd, bwd, policy=ReaderPolicy(large_reads_last=k, recompute_share=0.0, reader="small")
    )
    got = []
    for i in range(6):
        s.add_user(MESSAGES[i])
        n0 = len(s.tokens)
        got.append([e.token for e in s.generate("large", max_tokens=N)])
        t = s.turns[-1]
        assert t.prompt_tokens == k and t.read is not None and t.read.tokens > 0
        assert t.switch.end == n0 - k  # translated up to the last k tokens, not beyond
    assert got == converse(
        Session(pair, fwd, bwd, mode="reprefill", policy=PLAIN),
        6,
    )
    assert_translated_once(s)
    assert_consistent(s)
    short = Session(
        pair,
        fwd,
        bwd,
        policy=ReaderPolicy(large_reads_last=10_000, recompute_share=0.0, reader="small"),
    )
    short.add_user(MESSAGES[0])
    list(short.generate("large", max_tokens=2))
    (t,) = short.turns
    assert t.read is None and t.switch is None and t.prompt_tokens > k
    assert "within the 10000 tok the large reads itself" in t.read_note
    with pytest.raises(PolicyError, match="large_reads_last"):
        Session(pair, fwd, bwd, policy=ReaderPolicy(large_reads_last=0, recompute_share=0.0))


def _zero_like(pair, tr, answer):
    import numpy as np

    maps = {f"{kind}_maps": [np.array(w) * 0 for w in getattr(tr, kind)["weight"]]
            for kind in ("key", "value")}  # fmt: skip
    return exact_translator(pair, maps)


def test_the_large_recomputes_the_share_of_the_turn_its_reading_attended_to(pair, translators,
                                                                           tiny_dir):  # fmt: skip
    """`recompute_share`: after the large model reads the turn's last tokens, it recomputes
    that share of the span just translated. With a translator that writes zeros and the large
    model reading only the last token, share 1 recomputes every translated position, so the
    answers are the re-prefill's token for token; share 0 leaves the zeros (and other
    answers). The switch records what was recomputed, the status line says it, the caches
    stay consistent."""
    fwd, bwd = translators
    zero = _zero_like(pair, fwd, tiny_dir["known_answer"])
    want = converse(
        Session(pair, fwd, bwd, mode="reprefill", policy=PLAIN),
        4,
    )
    full = Session(
        pair,
        zero,
        bwd,
        policy=ReaderPolicy(large_reads_last=1, recompute_share=1.0, reader="small"),
        read_costs=ReadCosts(),  # its own: no budget drops the recompute under load
    )
    assert converse(full, 4) == want
    none = Session(pair, zero, bwd, policy=plain(reader="small"))
    assert converse(none, 4) != want
    k = 4
    full = Session(
        pair,
        zero,
        bwd,
        policy=ReaderPolicy(large_reads_last=k, recompute_share=1.0, reader="small"),
        read_costs=ReadCosts(),  # its own: no budget drops the recompute under load
    )
    converse(full, 4)
    half = Session(
        pair,
        zero,
        bwd,
        policy=ReaderPolicy(large_reads_last=k, recompute_share=0.5, reader="small"),
        read_costs=ReadCosts(),  # its own: no budget drops the recompute under load
    )
    converse(half, 4)
    for s, share in ((full, 1.0), (half, 0.5)):
        for t in s.turns:
            sw = t.switch
            # the share, and at least the selection's floor (24) where the span holds it
            want_n = min(sw.translated, max(round(share * sw.translated), 24))
            assert sw.recomputed == want_n and sw.tail_read == k
            assert t.prompt_tokens == 1  # the answer read the last token; the tail came before
        assert_consistent(s)
        assert_translated_once(s)
    line = status_line(half.turns[-1], {"source": "s", "target": "t"})
    assert f"large read the last {k} tok and recomputed {half.turns[-1].switch.recomputed}" in line
    assert half.stats()["recompute_share"] == 0.5
    with pytest.raises(PolicyError, match="recompute_share"):
        ReaderPolicy(large_reads_last=1, recompute_share=1.5)


def test_the_small_model_votes_with_its_own_reading_of_the_tail(pair, translators, monkeypatch):
    """With a recompute, the small model reads the turn's last tokens too, over the span it
    read itself: its votes are that reading's attention (`read_positions`), exactly, and its
    cache then holds the turn as its own prefill does."""
    import mlx_kvlingo.kv.recompute as recompute
    from mlx_kvlingo.kv.cache import append_zeros, new_cache
    from mlx_kvlingo.kv.capture import prefill

    fwd, bwd = translators
    seen, real = [], recompute.attended
    monkeypatch.setattr(
        recompute, "attended", lambda *a, **kw: seen.append(kw["votes"]) or real(*a, **kw)
    )
    policy = ReaderPolicy(large_reads_last=4, recompute_share=0.5, reader="small")
    s = Session(pair, fwd, bwd, policy=policy)
    s.add_user(MESSAGES[0])
    sw = s.hand_off("target").switch
    toks, cut = list(s.tokens), len(s.tokens) - sw.tail_read
    assert sw.recomputed and len(seen) == 1 and s.held("source") == len(toks)
    own = new_cache(pair.source)
    prefill(pair.source, toks[:cut], own)
    append_zeros(own, len(toks) - cut)
    want = recompute.read_positions(pair.source.model, own, toks, range(cut, len(toks)), True)
    assert mx.array_equal(seen[0], want)
    whole = new_cache(pair.source)
    prefill(pair.source, toks, whole)
    for a, b in zip(s.cache("source"), whole):
        assert mx.allclose(a.keys[..., : len(toks), :], b.keys[..., : len(toks), :], atol=1e-4)
    assert_consistent(s)


def test_an_interrupted_recompute_leaves_the_caches_consistent(pair, translators, monkeypatch):
    """Ctrl-C inside the recompute: the large model's cache keeps what it held before it (the
    translated span), the turn is unanswered, and asking again answers as the re-prefill."""
    import mlx_kvlingo.kv.recompute as recompute

    fwd, bwd = translators
    s = Session(
        pair, fwd, bwd, policy=ReaderPolicy(large_reads_last=4, recompute_share=0.5, reader="small")
    )
    s.add_user(MESSAGES[0])
    n0, real, calls = len(s.tokens), recompute.read_positions, []

    def interrupted(*a, **k):
        calls.append(1)
        if len(calls) == 2:  # the recompute itself, after the read of the turn's end
            raise KeyboardInterrupt
        return real(*a, **k)

    monkeypatch.setattr(recompute, "read_positions", interrupted)
    with pytest.raises(KeyboardInterrupt):
        list(s.generate("large", max_tokens=N))
    monkeypatch.undo()
    assert_consistent(s)
    assert s.held("target") == n0 - 4 and s.pending
    out = [e.token for e in s.generate("large", max_tokens=N)]
    assert out == native(pair.target.model, pair.tokenizer, s.tokens[:n0])
    assert_consistent(s)


def test_reader_self_keeps_todays_behaviour(pair, translators):
    fwd, bwd = translators
    s = Session(pair, fwd, bwd, policy=plain(reader="self"))
    converse(s, turns=3)
    assert all(t.read is None for t in s.turns)
    assert s.turns[0].prompt_tokens > 1 and not translated_spans(s)
    with pytest.raises(SessionError, match="needs a forward"):
        Session(pair, None, bwd, policy=plain(reader="small"))
    assert Session(pair, None, bwd, policy=PLAIN).policy.reader == "self"


def test_mixed_schedule_and_no_backward_translator(pair, translators):
    fwd, _ = translators
    sched = ["large", "large", "small", "large", "small", "small", "large"]
    s = Session(pair, fwd, None, policy=plain(reader="small"))
    ref = Session(pair, fwd, None, mode="reprefill", policy=PLAIN)
    assert converse(s, 7, sched) == converse(ref, 7, sched)
    large = [t for t in s.turns if t.model == "target"]
    # no backward translator: the small reads the large's answer itself, and says so
    c = large[1].read.catch_up
    assert c is not None and not c.translated and "no backward translator" in c.note
    assert "re-read the last answer" in status_line(large[1], {"source": "s", "target": "t"})
    assert_translated_once(s)
    assert_consistent(s)


def test_naive_mode_with_reader(pair, translators):
    fwd, bwd = translators
    s = Session(pair, fwd, bwd, mode="naive", policy=plain(reader="small"))
    ref = Session(pair, fwd, bwd, mode="reprefill", policy=PLAIN)
    assert converse(s, 4) == converse(ref, 4)
    assert sum(sw.retranslated for sw in s.switches) > 0  # naive re-translates what it held
    assert_consistent(s)


def test_ctrl_c_during_the_small_read_and_the_large_decode(pair, translators, monkeypatch):
    fwd, bwd = translators
    s = Session(pair, fwd, bwd, policy=plain(reader="small"))
    converse(s, 2)
    s.add_user("a long user turn " * 12)
    real = pair.source.model.__class__.__call__
    calls = {"n": 0}

    def interrupted(self, *a, **k):
        calls["n"] += 1
        if calls["n"] == 2:  # the second chunk of the small model's read
            raise KeyboardInterrupt
        return real(self, *a, **k)

    monkeypatch.setattr(pair.source.model.__class__, "__call__", interrupted)
    with pytest.raises(KeyboardInterrupt):
        list(s.generate("large", max_tokens=N, prefill_step_size=8))
    monkeypatch.undo()
    assert calls["n"] == 2 and 0 < s.held("source") < len(s.tokens) - 1
    assert_consistent(s)
    assert s.pending  # nothing was answered: the user turn is still open
    n0 = len(s.tokens)
    out = [e.token for e in s.generate("large", max_tokens=N)]
    assert out == native(pair.target.model, pair.tokenizer, s.tokens[:n0])

    # Ctrl-C in the large model's decode (raised from a logits processor at the 4th token)
    s.add_user(MESSAGES[5])
    seen = []

    def stop_at_four(tokens, logits):
        seen.append(1)
        if len(seen) == 4:
            raise KeyboardInterrupt
        return logits

    with pytest.raises(KeyboardInterrupt):
        list(s.generate("large", max_tokens=N, logits_processors=[stop_at_four]))
    assert_consistent(s)
    assert s.last_turn.finish_reason == "interrupted" and 0 < s.last_turn.generation_tokens < 4
    s.add_user(MESSAGES[6])
    n0 = len(s.tokens)
    out = [e.token for e in s.generate("large", max_tokens=N)]
    assert out == native(pair.target.model, pair.tokenizer, s.tokens[:n0])
    assert_translated_once(s)


@pytest.mark.parametrize("reader", ["small", "self"])
def test_a_long_turn_reports_progress_and_survives_ctrl_c(pair, translators, reader):
    """The reading model reports each chunk (`progress`); Ctrl-C raised from the report of the
    second chunk leaves both caches whole chunks long and the turn unanswered, and the answer
    then equals the large model's own reading of the conversation, token for token."""
    fwd, bwd = translators
    s = Session(pair, fwd, bwd, policy=plain(reader=reader))
    converse(s, 2)
    s.add_user("a long user turn that is read in chunks " * 8)
    reports = []

    def progress(who, done, total):
        reports.append((who, done, total))

    list(s.generate("large", max_tokens=1, prefill_step_size=8, progress=progress))
    who = "source" if reader == "small" else "target"
    mine = [r for r in reports if r[0] == who]  # the large may then read the turn's last token
    total = mine[0][2]
    assert mine[0] == (who, 0, total) and mine[-1] == (who, total, total) and len(mine) > 3
    assert [r[1] for r in mine] == sorted(r[1] for r in mine)
    read = s.last_turn.read.tokens if reader == "small" else s.last_turn.prompt_tokens
    assert total == read and read >= 8 * 8
    assert all(r[2] <= 1 for r in reports if r[0] != who)

    s.add_user("another long user turn read in chunks " * 8)
    n0 = len(s.tokens)
    calls = []

    def stop_at_second(who, done, total):
        calls.append(total)
        if len(calls) == 3:  # 0, the first chunk, the second chunk: Ctrl-C
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        list(s.generate("large", max_tokens=N, prefill_step_size=8, progress=stop_at_second))
    assert_consistent(s)
    assert s.pending and len(calls) == 3
    # stopped after two whole chunks of the turn (the small reads up to the last token, the
    # large itself reads up to its first step: mlx-lm leaves it the last token)
    start = n0 - (1 if reader == "small" else 0) - calls[0]
    assert s.held(who) == start + 16 < n0 - 1
    out = [e.token for e in s.generate("large", max_tokens=N)]
    assert out == native(pair.target.model, pair.tokenizer, s.tokens[:n0])
    assert_consistent(s)
    assert_translated_once(s)


def test_a_long_span_is_translated_chunk_by_chunk_into_room_reserved_for_the_turn(
    pair, translators, monkeypatch
):
    """The span is captured and translated `READ_CHUNK` tokens at a time into a cache
    that already has room for the whole turn (it never grows while the turn is read); Ctrl-C
    in the third chunk leaves the large model's cache two whole chunks long, and the answer
    then equals the large model's own reading, token for token."""
    from mlx_kvlingo.conversation import session as sess

    monkeypatch.setattr(sess, "READ_CHUNK", 8)  # the translation reads it per call
    fwd, bwd = translators
    s = Session(pair, fwd, bwd, policy=plain(reader="small"))
    converse(s, 2)
    real, seen = sess.append_translation, []

    def record(model, tr, span, cache):
        if model is pair.source:  # the small model catching up on the last answer
            return real(model, tr, span, cache)
        seen.append((span.length, cache[0].keys.shape[2], cache[-1].values.shape[2]))
        if stop and len(seen) == 3:
            raise KeyboardInterrupt
        real(model, tr, span, cache)

    monkeypatch.setattr(sess, "append_translation", record)
    stop = False
    s.add_user("a long user turn that is translated in chunks " * 12)  # past 256: a step
    n0 = len(s.tokens)
    out = [e.token for e in s.generate("large", max_tokens=N)]
    assert out == native(pair.target.model, pair.tokenizer, s.tokens[:n0])
    assert len(seen) > 3 and all(n <= 8 for n, _, _ in seen)
    assert sum(n for n, _, _ in seen) == s.last_turn.switch.translated
    assert {room for _, room, _ in seen} == {seen[0][1]} and seen[0][1] >= n0 + 1  # no growth
    assert {room for _, _, room in seen} == {seen[0][1]}

    seen.clear()
    stop = True
    s.add_user("another long user turn translated chunk by chunk " * 6)
    n0, start = len(s.tokens), s.held("target")
    with pytest.raises(KeyboardInterrupt):
        list(s.generate("large", max_tokens=N))
    assert_consistent(s)
    assert s.pending and s.held("target") == start + 16
    monkeypatch.setattr(sess, "append_translation", real)
    out = [e.token for e in s.generate("large", max_tokens=N)]
    assert out == native(pair.target.model, pair.tokenizer, s.tokens[:n0])
    assert_consistent(s)
    assert_translated_once(s)


def test_the_small_read_takes_shorter_chunks_as_its_cache_grows(pair, translators, monkeypatch):
    """Each chunk of the small model's read keeps its attention scores, rows x cached tokens x
    heads in float32, under `SCORES_BYTES` (the first chunk whole, later ones shorter), and the
    cache it leaves is the one read in a single pass."""
    from mlx_kvlingo.conversation import session as sess
    from mlx_kvlingo.kv.cache import new_cache

    heads = pair.source.query_heads
    monkeypatch.setattr(sess, "SCORES_BYTES", 4 * heads * 48 * 64)  # 48 rows over 64 tokens
    fwd, bwd = translators
    s = Session(pair, fwd, bwd, policy=plain(reader="small"))
    real, reads = pair.source.model.__class__.__call__, []

    def record(self, inputs, cache=None, **k):
        if self is pair.source.model:
            reads.append((inputs.shape[1], cache[0].offset))
        return real(self, inputs, cache=cache, **k)

    monkeypatch.setattr(pair.source.model.__class__, "__call__", record)
    s.add_user("a long user turn that the small model reads in chunks " * 8)
    list(s.generate("large", max_tokens=1, prefill_step_size=32))
    monkeypatch.undo()
    assert reads[0][0] == 32 and reads[-2][0] < 32 and len(reads) > 5
    for n, held in reads[:-1]:  # the last call is the answer's first step, not the read
        assert n * (held + n) * heads * 4 <= sess.SCORES_BYTES or n == 32 // 8
    whole = new_cache(pair.source)
    pair.source.model(mx.array(s.tokens[: s.held("source")])[None], cache=whole)
    for c, w in zip(s.cache("source"), whole):
        assert c.offset == w.offset
        assert mx.allclose(c.keys[..., : c.offset, :], w.keys[..., : w.offset, :], atol=1e-5)
        assert mx.allclose(c.values[..., : c.offset, :], w.values[..., : w.offset, :], atol=1e-5)


def test_cancel_during_the_small_read(pair, translators, monkeypatch):
    fwd, bwd = translators
    s = Session(pair, fwd, bwd, policy=plain(reader="small"))
    s.add_user("word " * 40)
    real = pair.source.model.__class__.__call__

    def cancel_then_read(self, *a, **k):
        s.cancel()  # as another thread would, while the small model reads
        return real(self, *a, **k)

    monkeypatch.setattr(pair.source.model.__class__, "__call__", cancel_then_read)
    events = list(s.generate("large", max_tokens=N, prefill_step_size=8))
    monkeypatch.undo()
    assert events == [] and s.last_turn.finish_reason == "cancelled"
    assert s.held("source") == 8 and s.held("target") == 0 and s.pending
    assert_consistent(s)
    n0 = len(s.tokens)
    out = [e.token for e in s.generate("large", max_tokens=N)]
    assert out == native(pair.target.model, pair.tokenizer, s.tokens[:n0])


def test_save_load_and_trim_with_reader(pair, translators, tmp_path):
    fwd, bwd = translators
    s = Session(
        pair, fwd, bwd, policy=ReaderPolicy(large_reads_last=5, recompute_share=0.5, reader="small")
    )
    converse(s, 3)
    path = s.save(tmp_path / "chat")
    t = Session(pair, fwd, bwd, policy=plain(reader="self"))
    t.load(path)
    assert t.policy.reader == "small" and t.turns[-1].read.tokens == s.turns[-1].read.tokens
    assert t.policy.large_reads_last == 5 and t.policy.recompute_share == 0.5
    assert t.turns[-1].switch.recomputed == s.turns[-1].switch.recomputed > 0
    assert converse(s, 2) == converse(t, 2)
    dropped = t.trim(len(t.tokens) // 2)
    assert dropped > 0
    t.add_user(MESSAGES[3])
    n0 = len(t.tokens)
    out = [e.token for e in t.generate("large", max_tokens=N)]
    assert out == native(pair.target.model, pair.tokenizer, t.tokens[:n0])
    assert_consistent(t)


def test_status_and_stats_show_the_read_and_the_saving(pair, translators):
    fwd, bwd = translators
    s = Session(pair, fwd, bwd, policy=plain(reader="small"))
    converse(s, 2)
    st = s.last_turn
    line = status_line(st, {"source": "S", "target": "T"})
    assert line.startswith("large (T)") and "small read" in line and "translated" in line
    assert "(large alone: TTFT ≈ " in line and st.alternative_ttft_s > 0
    stats = s.stats()
    assert stats["reader"] == "small"
    src, tgt = stats["models"]["source"], stats["models"]["target"]
    assert src["read_for_other_tokens"] == sum(t.read.tokens for t in s.turns)
    assert tgt["prompt_tokens"] == 2 and tgt["translated_into"] > 0
    assert isinstance(stats["estimated_saving_ms"], float)


def test_sampling_defaults_and_generation_config(tmp_path):
    class M:
        folder = tmp_path

    assert resolve(None) == DEFAULTS and DEFAULTS.repetition_penalty > 1
    (tmp_path / "generation_config.json").write_text(
        json.dumps({"temperature": 0.6, "top_k": 20, "top_p": 0.95, "eos_token_id": 2})
    )
    got = resolve(M())
    assert (got.temp, got.top_k, got.top_p, got.min_p) == (0.6, 20, 0.95, DEFAULTS.min_p)
    assert resolve(M(), {"temp": 0.2, "seed": 3}).temp == 0.2
    greedy = resolve(M(), {"temp": 0})
    assert greedy.temp == 0 and greedy.repetition_penalty == 1.0 and not greedy.logits_processors()
    assert resolve(M(), {"temp": 0, "repetition_penalty": 1.3}).logits_processors()
    (tmp_path / "generation_config.json").write_text(json.dumps({"do_sample": False}))
    assert resolve(M()).temp == 0 and resolve(M()).repetition_penalty == 1.0
    (tmp_path / "generation_config.json").write_text("{not json")
    assert resolve(M()) == DEFAULTS
    with pytest.raises(ValueError, match="unknown sampling"):
        resolve(None, {"temperature": 1.0})
    assert Sampling(temp=0.0).sampler()(mx.array([[0.1, 3.0, 0.2]])).item() == 1  # argmax


def test_sampling_overrides_merge_over_the_model_defaults(tmp_path):
    """A dict of overrides changes only its fields (None: not set), the rest stay the model's
    own; an unknown field is a ValueError naming it."""

    class M:
        folder = tmp_path

    (tmp_path / "generation_config.json").write_text(
        json.dumps({"temperature": 0.6, "top_k": 20, "top_p": 0.95, "repetition_penalty": 1.2})
    )
    own = resolve(M())
    got = resolve(M(), {"temp": 0.3, "min_p": None})
    assert got == replace(own, temp=0.3)
    assert (got.top_p, got.top_k, got.repetition_penalty, got.min_p) == (0.95, 20, 1.2, 0.05)
    assert resolve(M(), {"seed": 4}) == replace(own, seed=4)
    known = r"known: temp, top_p, top_k, min_p, repetition_penalty, repetition_context_size, seed"
    with pytest.raises(ValueError, match=r"\['temperature'\] \(temperature is 'temp'\); " + known):
        resolve(M(), {"temperature": 0.3})
    with pytest.raises(ValueError, match=r"unknown sampling settings \['top'\]; known"):
        resolve(M(), {"temp": 0.3, "top": 1})


@pytest.mark.parametrize("reader", ["small", "self"])
def test_logits_processors_see_the_answers_not_the_turns(pair, translators, reader):
    """A repetition penalty must see earlier answers (with the small model reading, the large
    model's own prompt is one token), and not the user's text, which an answer may need to
    repeat: the same history whoever read the turn."""
    fwd, bwd = translators
    s = Session(pair, fwd, bwd, policy=plain(reader=reader))
    converse(s, 1)
    s.add_user(MESSAGES[1])
    seen = []

    def record(tokens, logits):
        seen.append(tokens.tolist())
        return logits

    out = [e.token for e in s.generate("large", max_tokens=3, logits_processors=[record])]
    read_itself = s.last_turn.prompt_tokens  # one token, or the whole turn
    assert read_itself == 1 if reader == "small" else read_itself > 1
    first = [m["content"] for m in s.messages if m["role"] == "assistant"][0]
    answer = pair.tokenizer.encode(first, add_special_tokens=False)
    assert answer and seen[0] == answer  # the first answer, nothing of either user turn
    assert seen[1] == answer + out[:1]


def and_translated_ok(s) -> bool:
    assert_translated_once(s)
    assert_consistent(s)
    return True


def test_reader_tokens_reads_the_opening_and_long_turns_only(pair, translators, tmp_path):
    """The token rule (the default before reader "auto" went by time): the small model reads
    the opening span and turns of at least `reader_min_tokens`; the large reads shorter later
    turns itself and the status line says why. Token-for-token equal to re-prefill on the
    exact pair, each span translated once."""
    fwd, bwd = translators
    s = Session(pair, fwd, bwd, policy=plain(reader="tokens", reader_min_tokens=48))
    assert Session(pair, fwd, bwd, policy=PLAIN).policy.reader == "auto"
    assert Session(pair, fwd, bwd, policy=PLAIN).policy.reader_min_tokens == 64
    ref = Session(pair, fwd, bwd, mode="reprefill", policy=PLAIN)
    turns = [MESSAGES[0], MESSAGES[1], "word " * 60, MESSAGES[2]]
    got, want = [], []
    for text in turns:
        for sess, out in ((s, got), (ref, want)):
            sess.add_user(text)
            out.append([e.token for e in sess.generate("large", max_tokens=N)])
    assert got == want and s.tokens == ref.tokens
    opening, short, long, short2 = s.turns
    assert opening.read is not None and opening.prompt_tokens == 1 and not opening.read_note
    lacked = len(s.tokens)  # the short turns are under 48 tokens, the long one over
    for st in (short, short2):
        assert st.read is None and st.prompt_tokens > 1 and st.switch is None
        assert "reader tokens: the large reads turns under 48 tok" in status_line(
            st, {"source": "s", "target": "t"}
        )
        lacked = min(lacked, st.prompt_tokens)
    assert lacked < 48 <= long.read.tokens and long.prompt_tokens == 1
    # the small caught up on what the large read and answered (backward), then read the turn
    assert long.read.catch_up is not None and long.read.catch_up.translated
    assert_translated_once(s)
    assert_consistent(s)
    assert s.stats()["reader_min_tokens"] == 48
    # the policy survives a save / load
    t = Session(pair, fwd, bwd, policy=plain(reader="self"))
    t.load(s.save(tmp_path / "auto"))
    assert (t.policy.reader, t.policy.reader_min_tokens) == ("tokens", 48)


def test_reader_auto_limits_and_zero(pair, translators):
    fwd, bwd = translators
    s = Session(
        pair, fwd, bwd, policy=plain(reader="tokens", reader_min_tokens=0)
    )  # 0: the small reads all
    converse(s, 3)
    assert all(t.read is not None and t.prompt_tokens == 1 for t in s.turns)
    for bad in (-1, 2.5, True, "8"):
        with pytest.raises(PolicyError, match="reader_min_tokens"):
            s.policy = replace(s.policy, reader_min_tokens=bad)
    with pytest.raises(SessionError, match="'auto' needs a forward"):
        Session(pair, None, bwd, policy=plain(reader="auto"))
    with pytest.raises(PolicyError, match="unknown reader"):
        s.policy = replace(s.policy, reader="big")


def test_status_line_accounts_for_the_ttft():
    """Every part of a turn's time-to-first-token is shown with its time: the small model's
    read, the translation and the answering model's own read (up to its first token)."""
    st = TurnStats(
        "target",
        "alternation",
        read=Read("source", tokens=18, seconds=0.035),
        switch=Switch("target", "alternation", 0, 19, translated=19, seconds=0.005),
        prompt_tokens=1,
        prompt_tps=50.0,
        prompt_s=0.02,
        ttft_s=0.061,
    )
    st.alternative_ttft_s = 0.42
    line = status_line(st, {"source": "s", "target": "t"})
    assert "small read 18 tok 35 ms · translated 19 tok 5.0 ms · large read 1 tok 20 ms · " in line
    assert "TTFT 61 ms (large alone: TTFT ≈ 420 ms)" in line
    st.prompt_tokens, st.prompt_tps, st.prompt_s, st.read, st.switch = 18, 45.0, 0.4, None, None
    st.ttft_s, st.alternative_ttft_s = 0.401, 0.061
    line = status_line(st, {"source": "s", "target": "t"})
    assert (
        "large read 18 tok 400 ms 45.0 tok/s · TTFT 401 ms (small + translation: TTFT ≈ 61 ms)"
        in line
    )
    st.alternative_ttft_s = None
    line = status_line(st, {"source": "s", "target": "t"})
    assert "large read 18 tok 400 ms 45.0 tok/s · TTFT 401 ms · " in line
