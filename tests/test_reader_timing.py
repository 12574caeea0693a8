"""Reader "auto" by time (issue 28): the rates a + b * n, the choice between the large model
reading its turn itself and the small one reading for it, the token rule as a tie-breaker,
the warm-up that measures the rates. Exact costs are injected (`helpers.fixed_costs`): no test
here depends on how fast this machine is."""

import json
from dataclasses import replace

from mlx_kvlingo.config import PolicyError, ReaderPolicy
from mlx_kvlingo.conversation.reader import Cost, Paths, ReadCosts, Retention, costs_of, share
from mlx_kvlingo.conversation.session import Session
from mlx_kvlingo.conversation.stream import status_line
from mlx_kvlingo.conversation.warmup import PROBE_READ, warm_up

import pytest
from helpers import PLAIN, assert_session_consistent, fixed_costs, plain

N = 6
SHORT = ["def parse_args(argv):", "class Foo(object):", "print(x)", "return value"]
NAMES = {"source": "s", "target": "t"}


def talk(s, texts):
    out = []
    for text in texts:
        s.add_user(text)
        out.append([e.token for e in s.generate("large", max_tokens=N)])
    return out


def test_cost_fits_a_line_and_follows_newer_measurements():
    c = Cost()
    assert c.predict(10) is None and not c.ready
    c.observe(16, 0.10)
    assert not c.ready and c.predict(32) == pytest.approx(0.20)  # one length: through 0
    c.observe(64, 0.34)
    assert c.ready and c.fit() == pytest.approx((0.02, 0.005, 0.0))  # two lengths: a line
    assert c.predict(32) == pytest.approx(0.18) and c.predict(0) == 0.0
    c.observe(0, 1.0)  # ignored: nothing read
    c.observe(16, 0.0)
    assert c.fit() == pytest.approx((0.02, 0.005, 0.0))
    for _ in range(20):  # the machine got twice as slow: the fit follows
        c.observe(16, 0.20)
        c.observe(64, 0.68)
    assert c.fit() == pytest.approx((0.04, 0.01, 0.0))
    c.observe(64, 0.01)  # a slope < 0 from noise is never fitted
    assert all(x >= 0 for x in c.fit())


def test_cost_learns_the_attention_term_from_a_read_over_a_long_cache():
    """seconds = a + b n + c n (at + n / 2): short reads from an empty cache give a and b, one
    short read over a long cache gives c, and a long read is then predicted whole; a line
    through the short reads alone predicts it at a fraction of its cost."""
    a, b, c = 0.02, 0.005, 2e-6

    def true(n, at=0):
        return a + b * n + c * n * (at + n / 2)

    line, cost = Cost(), Cost()
    for n in (16, 64):
        line.observe(n, true(n))
        cost.observe(n, true(n))
    cost.observe(64, true(64, 2048), at=2048)
    assert cost.fit() == pytest.approx((a, b, c))
    assert cost.predict(4096) == pytest.approx(true(4096))
    assert cost.predict(32, at=4064) == pytest.approx(true(32, 4064))  # a tail over a document
    assert line.predict(4096) < 0.6 * true(4096)
    translate = Cost(attention=False)  # a translation maps each token on its own: a line
    translate.observe(16, 0.1)
    translate.observe(64, 0.34, at=2048)
    assert translate.fit() == pytest.approx((0.02, 0.005))


def test_paths_add_up_the_parts_of_each_ttft():
    costs = fixed_costs(
        source_read=(0.01, 0.001), forward=(0.002, 0.0005), backward=(0.003, 0.0002),
        target_read=(0.02, 0.01),
    )  # fmt: skip
    p = Paths(lacked=40, catch_up=10, read=30, backward=True)
    assert p.large(costs) == pytest.approx(0.02 + 0.4)
    small = (0.003 + 0.002) + (0.01 + 0.03) + (0.002 + 0.0005 * 39) + (0.02 + 0.01)
    assert p.small(costs) == pytest.approx(small)
    # no backward map: the small reads the catch-up span too, in the same read
    q = Paths(lacked=40, catch_up=10, read=30, backward=False)
    assert q.small(costs) == pytest.approx((0.01 + 0.04) + (0.002 + 0.0005 * 39) + 0.03)
    assert costs.large_reads(1) == pytest.approx(0.03)  # one token: target_step
    # frozen: measurements do not move an injected cost
    costs.observe_target(5, 100.0)
    costs.observe_target(1, 100.0)
    assert p.large(costs) == pytest.approx(0.42)
    assert Paths(1, 0, 0, True).small(fixed_costs(target_read=(0, 1))) is None  # not all known


def test_the_small_path_with_a_tail_adds_the_large_models_read_of_it():
    costs = fixed_costs(
        source_read=(0.01, 0.001), forward=(0.002, 0.0005), target_read=(0.02, 0.01),
    )  # fmt: skip
    p = Paths(lacked=40, catch_up=0, read=8, backward=False, tail=32)
    assert p.small(costs) == pytest.approx((0.01 + 0.008) + (0.002 + 0.0005 * 8) + (0.02 + 0.32))
    nothing = Paths(lacked=32, catch_up=0, read=0, backward=False, tail=32)  # nothing to read
    assert nothing.small(costs) == pytest.approx(nothing.large(costs))
    # recomputing 4 of the 8 translated tokens: a read of 32 + 4 + 32 (the tail again), then
    # the answer's step
    r = Paths(lacked=40, catch_up=0, read=8, backward=False, tail=32, recompute=4)
    assert r.small(costs) == pytest.approx((0.01 + 0.008) + (0.002 + 0.0005 * 8) + (0.02 + 0.68)
                                           + (0.02 + 0.01))  # fmt: skip


def test_the_tail_is_dropped_where_it_would_more_than_double_the_ttft(pair, translators):
    """`large_reads_last` holds while its read keeps the small path within TAIL_BUDGET (2x) of
    the plain handoff's predicted TTFT or within TAIL_ALLOWANCE_S of it; beyond both, the large
    reads the last token only, and the status line says why. The answers stay the
    re-prefill's (exact translators)."""
    from mlx_kvlingo.conversation.reader import TAIL_ALLOWANCE_S, TAIL_BUDGET, paths_with

    fwd, bwd = translators
    long = "word " * 80
    cheap = dict(source_read=(0.05, 0.001), forward=(0.01, 0.001), target_read=(0.01, 0.001))
    dear = dict(source_read=(0.05, 0.001), forward=(0.01, 0.001), target_read=(0.01, 0.2))
    # over 2x the handoff, but less than TAIL_ALLOWANCE_S more: kept
    quick = dict(source_read=(0.0, 1e-4), forward=(0.0, 1e-4), target_read=(0.01, 0.03))
    for rates, tail in ((cheap, 8), (quick, 8), (dear, 1)):
        s = Session(pair, fwd, bwd, read_costs=fixed_costs(**rates), policy=ReaderPolicy(large_reads_last=8, recompute_share=0.0, reader="small"))  # fmt: skip
        s.add_user(long)
        n0 = len(s.tokens)
        plain, with_tail = paths_with(s, n0 - 1, 1), paths_with(s, n0 - 1, 8)
        a, b = plain.small(s.read_costs), with_tail.small(s.read_costs)
        assert (b <= max(TAIL_BUDGET * a, a + TAIL_ALLOWANCE_S)) == (tail == 8)
        assert tail == 8 or (b > TAIL_BUDGET * a and b > a + TAIL_ALLOWANCE_S)
        toks = [e.token for e in s.generate("large", max_tokens=N)]
        ref = Session(pair, fwd, bwd, mode="reprefill", policy=PLAIN)
        assert toks == talk(ref, [long])[0]
        (st,) = s.turns
        assert st.prompt_tokens == tail and st.read is not None
        assert ("the large reads the last token only" in status_line(st, NAMES)) == (tail == 1)


@pytest.mark.parametrize("share_", [0.5, 0.0])
def test_the_hand_off_follows_the_one_decision(pair, translators, monkeypatch, share_):
    """`reader.choose` runs once per turn and the hand-off does what its `Decision` says: the
    small model reads up to its cut, the large holds the rest but the last token after its
    recompute, and recomputes only where the decision says so."""
    from mlx_kvlingo.conversation import reader

    fwd, bwd = translators
    real, seen = reader.choose, []
    monkeypatch.setattr(reader, "choose", lambda *a: seen.append(real(*a)) or seen[-1])
    rates = dict(source_read=(0.05, 0.001), forward=(0.01, 0.001), target_read=(0.01, 0.001))
    policy = ReaderPolicy(reader="small", large_reads_last=8, recompute_share=share_)
    s = Session(pair, fwd, bwd, read_costs=fixed_costs(**rates), policy=policy)
    s.add_user("word " * 80)
    st = s.hand_off("target")
    (d,) = seen
    assert d.small and d.cut == len(s.tokens) - 8 == st.read.start + st.read.tokens
    assert d.recompute == bool(share_) == bool(st.switch.recomputed)
    assert s.models["target"].held == (len(s.tokens) - 1 if d.recompute else d.cut)


def test_the_recompute_is_dropped_before_the_tail_where_it_would_exceed_the_budget(
    pair, translators
):
    """The large model's own reading on the small path, within the same budget: the last 8
    tokens and the recompute where both fit, the 8 tokens without it where only they fit (the
    status line says so), the last token only where neither does."""
    fwd, bwd = translators
    long = "word " * 80
    rates = dict(source_read=(0.05, 0.001), forward=(0.01, 0.001))
    for per_token, tail, recomputes in ((0.001, 8, True), (0.02, 8, False), (0.2, 1, False)):
        costs = fixed_costs(**rates, target_read=(0.01, per_token))
        s = Session(pair, fwd, bwd, read_costs=costs, policy=ReaderPolicy(large_reads_last=8, recompute_share=0.5, reader="small"))  # fmt: skip
        s.add_user(long)
        toks = [e.token for e in s.generate("large", max_tokens=N)]
        assert (
            toks
            == talk(
                Session(pair, fwd, bwd, mode="reprefill", policy=PLAIN),
                [long],
            )[0]
        )
        (st,) = s.turns
        assert (st.switch.recomputed > 0) == recomputes
        assert st.switch.tail_read == (tail if recomputes else 0)
        assert st.prompt_tokens == (1 if recomputes else tail)
        line = status_line(st, NAMES)
        assert ("no recompute: recomputing 50% of the turn" in line) == (
            tail == 8 and not recomputes
        )
        assert ("the large reads the last token only" in line) == (tail == 1)


LARGE_FAST = dict(source_read=(0.05, 0.01), forward=(0.05, 0.01), backward=(0.05, 0.01),
                  target_read=(0.001, 0.001))  # fmt: skip
SMALL_FAST = dict(source_read=(0.0, 1e-4), forward=(0.0, 1e-4), backward=(0.0, 1e-4),
                  target_read=(0.01, 0.05))  # fmt: skip


def test_auto_picks_the_large_reading_when_it_is_predicted_faster(pair, translators):
    fwd, bwd = translators
    costs = fixed_costs(**LARGE_FAST)
    s = Session(pair, fwd, bwd, read_costs=costs, policy=PLAIN)
    ref = Session(pair, fwd, bwd, mode="reprefill", policy=PLAIN)
    long = "word " * 80  # the token rule would have the small read it
    texts = [SHORT[0], long, SHORT[1]]
    assert talk(s, texts) == talk(ref, texts)
    for st in s.turns:  # even the opening and the long turn: the large reads them itself
        assert st.read is None and st.switch is None and st.prompt_tokens > 1
        assert st.read_note == "reader auto: the faster"
        assert st.predicted_ttft_s == pytest.approx(costs.large_reads(st.prompt_tokens))
        # the small path's predicted TTFT, shown as a TTFT
        assert st.alternative_ttft_s > st.predicted_ttft_s
        assert f"(small + translation: TTFT ≈ {st.alternative_ttft_s * 1e3:.0f} ms)" in status_line(
            st, NAMES
        )
    opening = s.turns[0]  # nothing to catch up on: read n - 1, translate n - 1, large's step
    n = opening.prompt_tokens
    want = (0.05 + 0.01 * (n - 1)) * 2 + 0.002
    assert opening.alternative_ttft_s == pytest.approx(want)
    assert_session_consistent(s)


def test_auto_picks_the_small_reading_when_it_is_predicted_faster(pair, translators):
    fwd, bwd = translators
    costs = fixed_costs(**SMALL_FAST)
    s = Session(pair, fwd, bwd, read_costs=costs, policy=PLAIN)
    ref = Session(pair, fwd, bwd, mode="reprefill", policy=PLAIN)
    assert talk(s, SHORT) == talk(ref, SHORT)
    for st in s.turns:  # even short later turns, which the token rule gives the large
        assert st.read is not None and st.prompt_tokens == 1 and st.read_note == ""
        assert st.alternative_ttft_s == pytest.approx(0.01 + 0.05 * (st.switch.translated + 1))
        assert "(large alone: TTFT ≈ " in status_line(st, NAMES)
    assert s.turns[1].read.catch_up.translated  # the small caught up on the answer (backward)
    assert_session_consistent(s)


def test_auto_weighs_what_the_small_path_keeps(pair, translators):
    """Measured retention under `min_retention` at a turn's length: the large reads it itself
    though the small path is faster, and the status line says what it gave up for what; at
    lengths where the translator keeps enough, or with the threshold at 0, time decides."""
    fwd, bwd = translators
    long = "word " * 80  # about 90 tokens with the template
    kept = Retention(((16, 0.95), (64, 0.9), (256, 0.5)))
    assert kept.expected(8) == 0.95 and kept.expected(1000) == 0.5
    assert kept.expected(128) == pytest.approx(0.7)  # halfway in log n
    s = Session(pair, fwd, bwd, read_costs=fixed_costs(**SMALL_FAST), policy=PLAIN,
                retention=kept)  # fmt: skip
    ref = Session(pair, fwd, bwd, mode="reprefill", policy=PLAIN)
    texts = [long, SHORT[0]]
    assert talk(s, texts) == talk(ref, texts)
    opening, short = s.turns
    n = opening.prompt_tokens
    assert opening.read is None and n > 64 and opening.retention == pytest.approx(kept.expected(n))
    assert opening.read_note == (
        f"reader auto: the small path keeps ≈{share(kept.expected(n))} of the content at {n} tok, "
        "under 0.8"
    )
    # as the injected costs would have it: the small path was predicted far sooner
    as_predicted = replace(opening, ttft_s=opening.predicted_ttft_s)
    assert opening.alternative_ttft_s < 0.1 * as_predicted.ttft_s
    sooner = f"{(as_predicted.ttft_s - opening.alternative_ttft_s) * 1e3:.0f} ms sooner"
    assert f"{sooner}, keeping ≈{share(opening.retention)})" in status_line(as_predicted, NAMES)
    # rounded down: a retention just under the threshold never reads as the threshold
    assert [share(x) for x in (0.795, 0.7999, 0.8, 1.0, 0.0)] == [
        "0.79",
        "0.79",
        "0.80",
        "1.00",
        "0.00",
    ]
    assert short.read is not None and short.read_note == ""  # a short turn keeps 0.95
    # where time picks the large model anyway, retention is not what decided
    u = Session(pair, fwd, bwd, read_costs=fixed_costs(**LARGE_FAST), policy=PLAIN,
                retention=kept)  # fmt: skip
    talk(u, [long])
    assert u.turns[0].read_note == "reader auto: the faster" and u.turns[0].retention is None
    # the threshold at 0: time alone, the small reads the long turn too
    t = Session(pair, fwd, bwd, read_costs=fixed_costs(**SMALL_FAST),
                policy=replace(PLAIN, min_retention=0.0), retention=kept)  # fmt: skip
    talk(t, [long])
    assert t.turns[0].read is not None and t.turns[0].retention is None
    with pytest.raises(PolicyError, match="min_retention"):
        replace(PLAIN, min_retention=1.2)


def test_retention_is_kept_in_the_cache_folder_and_found_by_the_runtime(
    pair, translators, tmp_path, monkeypatch
):
    """Each draw's counts are stored per length; a re-run of a draw replaces its counts at the
    lengths it measured (the same tasks never count twice), other draws pool, and a length
    counts once the native read got `MIN_RIGHT` right there."""
    from mlx_kvlingo.api import Conversation, Pair
    from mlx_kvlingo.conversation import reader

    monkeypatch.setattr(reader, "RETENTION", tmp_path / "retention")
    fwd, bwd = translators
    rt = Pair(pair, fwd, bwd)
    assert rt.retention() is None and Conversation(rt).cache.retention is None
    k = reader.retention_key(pair, fwd, ReaderPolicy())
    reader.record_retention(k, "seed 1", [(128, 3, 3), (2048, 1, 2)])
    assert Pair(pair, fwd, bwd).retention().points == ((128, 1.0),)  # 2048: too few yet
    reader.record_retention(k, "seed 1", [(2048, 0, 2)])  # the same draw again: replaces
    reader.record_retention(k, "seed 2", [(2048, 2, 3)])  # another draw: pools
    assert reader.load_retention(k) == {
        "seed 1": ((128, 3, 3), (2048, 0, 2)),
        "seed 2": ((2048, 2, 3),),
    }
    rt = Pair(pair, fwd, bwd)
    conv = Conversation(rt)
    kept = Retention(((128, 1.0), (2048, 0.4)), "seed 1; seed 2")
    assert conv.cache.retention == kept and rt.retention() == kept
    conv.policy = replace(conv.policy, recompute_share=0.2)  # measured for other settings
    assert conv.cache.retention is None
    for broken in ("{not json", json.dumps({"schema": reader.SCHEMA, "key": k,
                                            "draws": {"x": [[64, 4, 3]]}})):  # fmt: skip
        (next((tmp_path / "retention").iterdir())).write_text(broken)
        assert Pair(pair, fwd, bwd).retention() is None  # a broken file: unmeasured
    with pytest.raises(ValueError, match="count"):
        reader.pooled([(64, True, 3)])


def test_a_demo_translator_ships_its_retention_and_measured_counts_pool_with_it(
    pair, translators, tmp_path, monkeypatch
):
    """The demo's default forward file carries its retention counts in the manifest (found by
    the file the translator came from, whatever dtype it computes in); counts measured on this
    pair (`kvlingo eval --task content`, in the cache folder) pool with them."""
    from mlx_kvlingo.api import Pair
    from mlx_kvlingo.conversation import reader
    from mlx_kvlingo.models.demo import pair as demo

    monkeypatch.setattr(reader, "RETENTION", tmp_path / "retention")
    fwd, bwd = translators
    shipped = tmp_path / "forward.safetensors"
    shipped.write_bytes(b"")
    entry = {"large_reads_last": 32, "recompute_share": 0.1, "counts": [[1024, 3, 3], [4096, 1, 4]],
             "source": "kvlingo eval --task content"}  # fmt: skip
    monkeypatch.setattr(demo, "manifest", lambda p="dense": {"default": {"retention": entry}})
    monkeypatch.setattr(demo, "translator_path", lambda *a, **k: shipped)
    fwd.path = shipped
    try:
        got = Pair(pair, fwd, bwd).retention()
        assert got == Retention(((1024, 1.0), (4096, 0.25)), "kvlingo eval --task content")
        assert Pair(pair, fwd, bwd).retention(ReaderPolicy(large_reads_last=8)) is None
        fwd.path = tmp_path / "another.safetensors"
        assert Pair(pair, fwd, bwd).retention() is None  # not the shipped file
        fwd.path = shipped
        k = reader.retention_key(pair, fwd, ReaderPolicy())
        reader.record_retention(k, "measured here", [(4096, 3, 4)])
        got = Pair(pair, fwd, bwd).retention()
        assert got.points == ((1024, 1.0), (4096, 0.5)) and got.source.endswith("measured here")
        entry["counts"] = [[1024, 4, 3]]  # a malformed manifest: only what was measured here
        assert Pair(pair, fwd, bwd).retention().points == ((4096, 0.75),)
    finally:
        del fwd.path


def opening_tie(pair, n0: int, ratio: float) -> ReadCosts:
    """Costs under which the small path of an opening turn of n0 tokens is `ratio` x the
    large path: large = b * n0, small = 2 c (n0 - 1) + b."""
    b = 0.01
    c = (ratio * b * n0 - b) / (2 * (n0 - 1))
    return fixed_costs(source_read=(0, c), forward=(0, c), backward=(0, c), target_read=(0, b))


@pytest.mark.parametrize(
    "ratio, margin, small_reads",
    [
        (1.03, 0.05, True),  # a tie: the token rule, which has the small read the opening
        (1.03, 0.0, False),  # no margin: time alone, the large is 3% faster
        (1.10, 0.05, False),  # beyond the margin: time
        (0.90, 0.05, True),
    ],
)
def test_the_token_rule_breaks_ties(pair, translators, monkeypatch, ratio, margin, small_reads):
    from mlx_kvlingo.conversation import reader

    assert reader.READER_MARGIN == 0.05  # what the cases with 0.05 stand for
    fwd, bwd = translators
    s = Session(pair, fwd, bwd, policy=PLAIN)
    s.add_user(SHORT[0])
    s.read_costs = opening_tie(pair, len(s.tokens), ratio)
    monkeypatch.setattr(reader, "READER_MARGIN", margin)
    d = reader.choose(s, "target", len(s.tokens) - 1)
    small, why, paths = d.small, d.note, d.paths
    assert small is small_reads and paths == Paths(len(s.tokens), 0, len(s.tokens) - 1, True)
    assert paths.small(s.read_costs) == pytest.approx(ratio * paths.large(s.read_costs))
    assert why == ("" if small else "reader auto: the faster")
    # a short later turn on a tie: the token rule has the large read it, and says so
    next(s.generate("large", max_tokens=N))
    s.cancel()
    s.add_user(SHORT[1])
    s.read_costs = fixed_costs(**SMALL_FAST)
    monkeypatch.setattr(reader, "READER_MARGIN", 1e9)
    d = reader.choose(s, "target", len(s.tokens) - 1)
    small, why = d.small, d.note
    assert not small and why == "reader auto, a tie: the large reads turns under 64 tok"


def test_auto_before_any_timing_is_the_token_rule(pair, translators):
    """Nothing measured yet: the opening is read by the small, a short later turn by the large
    (its own read is timed once after the first answer, for the status line)."""
    fwd, bwd = translators
    s = Session(pair, fwd, bwd, read_costs=ReadCosts(), policy=PLAIN)
    talk(s, SHORT[:2])
    opening, short = s.turns
    assert opening.read is not None and opening.read_note == ""
    assert opening.alternative_ttft_s > 0 and s.read_costs.target_read.ready
    assert short.read is None and short.prompt_tokens > 1
    assert short.read_note == "reader auto, not timed yet: the large reads turns under 64 tok"
    # each turn measured what it ran
    assert [n for n, _, _ in s.read_costs.source_read.samples] == [opening.read.tokens]
    assert s.read_costs.forward.samples[0][0] == opening.switch.translated
    # the large read the short turn over the opening turn and its answer, which it held
    held = len(s.tokens) - short.generation_tokens - short.prompt_tokens
    assert s.read_costs.target_read.samples[-1] == (short.prompt_tokens, short.prompt_s, held)
    assert s.read_costs.source_read.samples[0][2] == 0  # the opening: read from the start


def test_reader_tokens_and_the_others_ignore_the_rates(pair, translators):
    fwd, bwd = translators
    for reader, costs, reads in (
        ("tokens", fixed_costs(**LARGE_FAST), [True, False]),
        ("small", fixed_costs(**LARGE_FAST), [True, True]),
        ("self", fixed_costs(**SMALL_FAST), [False, False]),
    ):
        s = Session(pair, fwd, bwd, read_costs=costs, policy=plain(reader=reader))
        talk(s, SHORT[:2])
        assert [t.read is not None for t in s.turns] == reads, reader
        assert all(t.alternative_ttft_s is not None for t in s.turns)


def test_warm_up_measures_every_cost_and_pays_the_first_turn(pair, translators):
    fwd, bwd = translators
    costs = ReadCosts()
    assert warm_up(pair, fwd, bwd, lengths=(8, 24), costs=costs) is costs
    for name in ("source_read", "forward", "backward", "target_read"):
        assert getattr(costs, name).ready, name
    assert costs.warmup_s > 0
    # its first step after a translation, apart from its reads of more than one token
    assert {n for n, _, _ in costs.target_step.samples} == {1}
    assert min(n for n, _, _ in costs.target_read.samples) > 1
    # each model read a few tokens over a long scratch cache: the attention term
    for cost in (costs.source_read, costs.target_read):
        assert any(n == PROBE_READ and at >= PROBE_READ for n, _, at in cost.samples)
    # the pair's shared costs: what sessions get by default
    s = Session(pair, fwd, bwd, policy=PLAIN)
    assert (
        s.read_costs is costs_of(pair)
        and Session(pair, fwd, bwd, policy=PLAIN).read_costs is s.read_costs
    )


def test_warm_up_without_translators(pair):
    """No forward map: only the large reading itself is timed (and the small answering)."""
    costs = warm_up(pair, None, None, lengths=(8, 24), costs=ReadCosts())
    assert costs.target_read.ready and not costs.source_read.samples


def test_a_session_file_from_before_keeps_loading(pair, translators, tmp_path):
    """A file whose policy lacks later settings and has retired ones (`config.RETIRED`: the
    margin, translate-ahead), whose turns lack later fields and carry 0.2.0's `alone_prefill_s`
    and translate-ahead's `ahead`, loads; one of the flat layout (before the policy value) is
    refused."""
    import json

    from mlx_kvlingo.conversation.stream import SessionFileError

    from mlx_lm.models.cache import load_prompt_cache, save_prompt_cache

    fwd, bwd = translators
    s = Session(pair, fwd, bwd, policy=plain(reader_min_tokens=40))
    talk(s, SHORT[:1])
    path = s.save(tmp_path / "new")
    caches, meta = load_prompt_cache(str(path), return_metadata=True)
    state = json.loads(meta["kvlingo_session"])
    del state["policy"]["min_retention"]
    state["policy"].update(reader_margin=0.3, translate_ahead=True)
    for t in state["turns"]:  # fields a turn did not have then, and ones it had
        del t["alternative_ttft_s"], t["predicted_ttft_s"]
        ahead = {"into": "target", "mode": "alternation", "start": 0, "end": 8, "translated": 8}
        t.update(alone_prefill_s=0.4, ahead=ahead)
    old = tmp_path / "old.safetensors"
    save_prompt_cache(str(old), caches, {**meta, "kvlingo_session": json.dumps(state)})
    t = Session(pair, fwd, bwd, policy=plain(reader="self"))
    t.load(old)
    assert (t.policy.reader, t.policy.reader_min_tokens) == ("auto", 40)
    state.update(state.pop("policy"))  # flat, as files before the policy value kept it
    flat = tmp_path / "flat.safetensors"
    save_prompt_cache(str(flat), caches, {**meta, "kvlingo_session": json.dumps(state)})
    with pytest.raises(SessionFileError, match="start a new conversation") as e:
        Session(pair, fwd, bwd, policy=PLAIN).load(flat)
    assert "\n" not in str(e.value)
    # a file of the policy value with the settings since retired
    retired = {"reader_margin": 0.3, "ahead_chunk": 8, "ahead_share": None, "reader_min_tokens": 9}
    assert ReaderPolicy.from_dict(retired, PLAIN) == plain(reader_min_tokens=9)
    ahead = ReaderPolicy.from_dict({"translate_ahead": True, "reader": "small"}, PLAIN)
    assert ahead == plain(reader="small") and "translate_ahead" not in ahead.to_dict()
    with pytest.raises(PolicyError, match="unknown reader-policy setting"):
        ReaderPolicy.from_dict({"reader_margins": 0.3})
    assert t.turns[0].alternative_ttft_s is None and t.tokens == s.tokens
