"""Alternation on the known-answer pair: a conversation that crosses models in both directions
must decode exactly as re-prefill does, translating each missing span exactly once."""

from mlx_kvlingo.conversation.session import Session
from mlx_kvlingo.conversation.stream import (
    ContextOverflowError,
    SessionError,
    SessionFileError,
    TurnStats,
)

import mlx.core as mx
import numpy as np
import pytest
from helpers import (
    PLAIN,
    assert_session_consistent,
    exact_translator,
    inverse,
    native_tokens,
    plain,
    translated_spans,
)
from mlx_lm.models.cache import load_prompt_cache, save_prompt_cache
from mlx_lm.sample_utils import make_sampler

# who answers each user message: switches both ways, and a model keeping the turn (turn 5)
SCHEDULE = ["source", "target", "source", "target", "target", "source", "target"]
MESSAGES = [
    "def parse_args(argv):",
    "class Foo(object):",
    "import json\nimport os",
    "return value",
    "for item in items:",
    "print(x)",
    "with open(path) as f:",
]
N = 16


def converse(session, schedule=SCHEDULE, sampler=None, seed=None):
    """Run the schedule; return per turn (model, n0, answer tokens, end)."""
    turns = []
    for i, model in enumerate(schedule):
        session.add_user(MESSAGES[i % len(MESSAGES)])
        n0 = len(session.tokens)
        if seed is not None:
            mx.random.seed(seed + i)
        toks = [e.token for e in session.generate(model, max_tokens=N, sampler=sampler)]
        turns.append((model, n0, toks, len(session.tokens)))
    return turns


def native(model, tokenizer, tokens, n=N):
    return native_tokens(model, tokenizer, tokens, n)


assert_consistent = assert_session_consistent


def test_alternation_equals_reprefill_both_directions(pair, translators):
    fwd, bwd = translators
    ref = Session(pair, fwd, bwd, mode="reprefill", policy=plain(reader="self"))
    alt = Session(pair, fwd, bwd, mode="alternation", policy=plain(reader="self"))
    ref_turns, alt_turns = converse(ref), converse(alt)
    assert [t[2] for t in alt_turns] == [t[2] for t in ref_turns]
    assert all(len(t[2]) > 0 for t in alt_turns)
    assert alt.tokens == ref.tokens
    assert alt.retemplated == 0
    # the last answer is also what the target alone would say over the whole conversation
    *_, (model, n0, toks, _) = alt_turns
    assert toks == native(pair.target.model, pair.tokenizer, alt.tokens[:n0])

    # exactly the missing spans were translated: at each switch into m, from where m left
    # off to where the other model's last answer ended
    ends = {"source": 0, "target": 0}
    expected = []
    for model, _n0, _toks, end in alt_turns:
        other = "target" if model == "source" else "source"
        if ends[other] > ends[model]:
            expected.append((model, ends[model], ends[other]))
        ends[model] = end
    assert [(s.into, s.start, s.end) for s in alt.switches] == expected
    assert translated_spans(alt) == expected
    assert all(s.translated == s.lacked and s.retranslated == 0 for s in alt.switches)
    assert len(expected) == 5  # four handoffs forward/back, one kept turn has no switch
    # per model: translated + read natively + generated = what its cache holds, no overlap
    for name in ("source", "target"):
        spans = sorted((a, b) for m, a, b in expected if m == name)
        assert all(b1 <= a2 for (_, b1), (a2, _) in zip(spans, spans[1:]))
        mine = [t for t in alt.turns if t.model == name]
        read = sum(t.prompt_tokens + t.generation_tokens for t in mine)
        assert sum(b - a for a, b in spans) + read == alt.held(name)
    # re-prefill read all of it natively instead
    assert translated_spans(ref) == []
    assert [(s.into, s.start, s.end) for s in ref.switches] == expected
    assert_consistent(alt)


def test_seeded_sampling_matches_reprefill(pair, translators):
    fwd, bwd = translators
    sampler = make_sampler(temp=0.8, top_p=0.95)
    sched = SCHEDULE[:4]
    a = converse(
        Session(pair, fwd, bwd, policy=PLAIN),
        sched,
        sampler,
        seed=11,
    )
    b = converse(
        Session(pair, fwd, bwd, mode="reprefill", policy=PLAIN),
        sched,
        sampler,
        seed=11,
    )
    assert [t[2] for t in a] == [t[2] for t in b]


def test_naive_differs_only_by_retranslation(pair, translators):
    fwd, bwd = translators
    alt = Session(pair, fwd, bwd, mode="alternation", policy=plain(reader="tokens"))
    naive = Session(pair, fwd, bwd, mode="naive", policy=plain(reader="tokens"))
    alt_turns, naive_turns = converse(alt), converse(naive)
    # exact translators: re-translating changes nothing in the answers...
    assert [t[2] for t in naive_turns] == [t[2] for t in alt_turns]
    # ...and the only difference is the prefix each model already held, translated again
    assert len(naive.switches) == len(alt.switches)
    for n, a in zip(naive.switches, alt.switches):
        assert (n.into, n.start, n.end) == (a.into, a.start, a.end)
        assert n.retranslated == a.start
        assert n.translated == a.translated + n.retranslated
        assert (n.end - n.translated, n.end) == (0, a.end)
    extra = sum(n.translated for n in naive.switches) - sum(a.translated for a in alt.switches)
    assert extra == sum(a.start for a in alt.switches) > 0
    assert_consistent(naive)


def test_pre_norm_translators(pair, tiny_dir):
    answer = tiny_dir["known_answer"]
    fwd = exact_translator(pair, answer, key_cut="pre_norm")
    bwd = exact_translator(pair.reversed(), inverse(answer), key_cut="pre_norm")
    sched = SCHEDULE[:4]
    a = converse(Session(pair, fwd, bwd, policy=PLAIN), sched)
    b = converse(
        Session(pair, fwd, bwd, mode="reprefill", policy=PLAIN),
        sched,
    )
    assert [t[2] for t in a] == [t[2] for t in b]
    s = Session(pair, fwd, bwd, mode="naive", policy=plain(reader="tokens"))
    s.add_user("hello")
    with pytest.raises(SessionError, match="naive mode needs post_norm"):
        s.generate("small")


def test_without_backward_switching_back_reprefills(pair, translators):
    fwd, _ = translators
    s = Session(pair, fwd, None, policy=PLAIN)
    turns = converse(s, SCHEDULE[:3])
    ref = converse(
        Session(pair, fwd, None, mode="reprefill", policy=PLAIN),
        SCHEDULE[:3],
    )
    assert [t[2] for t in turns] == [t[2] for t in ref]
    into_target, into_source = s.switches
    assert into_target.translated == into_target.lacked
    assert into_source.translated == 0 and "no backward translator" in into_source.note


def test_escalate_uses_translated_cache(pair, translators):
    fwd, bwd = translators
    s = Session(pair, fwd, bwd, policy=plain(reader="tokens"))
    s.add_user("def parse_args(argv):")
    n0 = len(s.tokens)
    small = [e.token for e in s.generate("small", max_tokens=N)]
    large = [e.token for e in s.escalate(max_tokens=N)]
    assert s.messages[-1]["role"] == "assistant" and len(s.messages) == 2
    assert s.tokens[n0:] == large
    assert large == native(pair.target.model, pair.tokenizer, s.tokens[:n0])
    sw = s.last_turn.switch
    assert (sw.into, sw.start, sw.end, sw.translated) == ("target", 0, n0 - 1, n0 - 1)
    assert len(small) > 0
    assert_consistent(s)


def test_keyboard_interrupt_inside_generation(pair, translators):
    """Ctrl-C lands inside mlx-lm's decode loop: emitted tokens are kept, caches match."""
    fwd, bwd = translators
    s = Session(pair, fwd, bwd, policy=plain(reader="tokens"))
    converse(s, SCHEDULE[:2])
    s.add_user("for item in items:")
    n0 = len(s.tokens)
    calls = []

    def interrupt(tokens, logits):
        calls.append(1)
        if len(calls) == 7:
            raise KeyboardInterrupt
        return logits

    got = []
    with pytest.raises(KeyboardInterrupt):
        for e in s.generate("source", max_tokens=100, logits_processors=[interrupt]):
            got.append(e.token)
    assert 0 < len(got) < 7
    assert s.tokens[n0:] == got
    assert s.held("source") == len(s.tokens)
    assert s.last_turn.finish_reason == "interrupted"
    assert_consistent(s)
    # the next turn, on the other model, is exactly what it would say reading it all itself
    s.add_user("print(x)")
    n1 = len(s.tokens)
    nxt = [e.token for e in s.generate("target", max_tokens=N)]
    assert nxt == native(pair.target.model, pair.tokenizer, s.tokens[:n1])
    assert s.last_turn.switch.translated == s.last_turn.switch.lacked > 0


def test_keyboard_interrupt_in_consumer_and_cancel(pair, translators):
    fwd, bwd = translators
    s = Session(pair, fwd, bwd, policy=plain(reader="tokens"))
    s.add_user("class Foo(object):")
    n0 = len(s.tokens)
    got = []
    with pytest.raises(KeyboardInterrupt):
        for e in s.generate("target", max_tokens=100):
            got.append(e.token)
            if len(got) == 5:
                raise KeyboardInterrupt  # e.g. while the app prints the token
    s.add_user("return value")  # closes the abandoned generation first
    assert s.tokens[n0 : n0 + 5] == got
    assert_consistent(s)
    n1 = len(s.tokens)
    events = s.generate("source", max_tokens=100)
    toks = []
    for e in events:
        toks.append(e.token)
        if len(toks) == 3:
            s.cancel()
    assert len(toks) == 4 and e.handoff.finish_reason == "cancelled"
    assert s.tokens[n1:] == toks
    s.add_user("print(x)")
    n2 = len(s.tokens)
    nxt = [e.token for e in s.generate("target", max_tokens=N)]
    assert nxt == native(pair.target.model, pair.tokenizer, s.tokens[:n2])


def test_save_load_round_trip(pair, translators, tmp_path):
    fwd, bwd = translators
    # reader "tokens" (as everywhere here): "auto" decides by this process's measured rates, which a restored
    # session has not measured yet, so the two could read the next turn by different paths
    s = Session(pair, fwd, bwd, system_prompt="You are terse.", policy=plain(reader="tokens"))
    converse(s, SCHEDULE[:3])
    path = s.save(tmp_path / "chat")
    assert path.name == "chat.safetensors"
    caches, meta = load_prompt_cache(str(path), return_metadata=True)  # a plain mlx-lm file
    assert len(caches) == pair.source.geometry.layers + pair.target.geometry.layers
    assert "kvlingo_session" in meta

    t = Session(pair, fwd, bwd, policy=plain(reader="tokens"))
    t.load(path)
    assert t.tokens == s.tokens and t.messages == s.messages
    assert (t.held("source"), t.held("target")) == (s.held("source"), s.held("target"))
    assert t.stats()["models"] == s.stats()["models"]
    for session in (s, t):
        session.add_user("return value")
    a = [e.token for e in s.generate("target", max_tokens=N)]
    b = [e.token for e in t.generate("target", max_tokens=N)]
    assert a == b and t.last_turn.switch.translated == s.last_turn.switch.translated
    t.escalate()  # the restored answer bookkeeping works too
    assert_consistent(t)


def test_session_file_from_another_pair_refused(pair, translators, tmp_path, tiny_dir):
    fwd, bwd = translators
    s = Session(pair, fwd, bwd, policy=plain(reader="tokens"))
    converse(s, SCHEDULE[:1])
    path = s.save(tmp_path / "s.safetensors")
    # same geometry, other weights: the reversed pair
    other = Session(pair.reversed(), bwd, fwd, policy=PLAIN)
    with pytest.raises(SessionFileError, match="only loads into the pair that wrote it"):
        other.load(path)
    assert other.tokens == []
    plain_file = tmp_path / "plain.safetensors"
    save_prompt_cache(str(plain_file), s.cache("target"), {"model": "x"})
    with pytest.raises(SessionFileError, match="without kvlingo session state"):
        other.load(plain_file)
    with pytest.raises(SessionFileError, match="no such session file"):
        other.load(tmp_path / "missing.safetensors")


def test_bad_input(pair, translators):
    fwd, bwd = translators
    s = Session(pair, fwd, bwd, max_kv_size=80, policy=plain(reader="tokens"))
    with pytest.raises(SessionError, match="nothing to answer"):
        s.generate("large")
    with pytest.raises(SessionError, match="nothing to escalate"):
        s.escalate()
    with pytest.raises(SessionError, match="unknown model"):
        s.generate("medium")
    with pytest.raises(SessionError, match="unknown mode"):
        s.mode = "fast"
    s.add_user("def parse_args(argv):")
    list(s.generate("small", max_tokens=200))
    assert s.last_turn.finish_reason == "context" and len(s.tokens) == 80
    s.add_user("class Foo(object):")
    with pytest.raises(ContextOverflowError, match="/trim"):
        s.generate("large")
    assert s.trim(40) == 2  # the first exchange goes, the new message stays
    assert s.messages[0]["content"] == "class Foo(object):" and len(s.tokens) <= 40
    n0 = len(s.tokens)
    toks = [e.token for e in s.generate("large", max_tokens=8)]
    assert toks == native(pair.target.model, pair.tokenizer, s.tokens[:n0], 8)
    # a message stopped before its first token waits; escalate hands it to the other model
    s.reset()
    s.add_user("print(x)")
    with pytest.raises(KeyboardInterrupt):
        for _ in s.generate("small", logits_processors=[_interrupt_now]):
            pass
    assert s.pending and s.messages[-1]["content"] == "print(x)"
    list(s.escalate(max_tokens=4))
    assert s.last_turn.model == "target" and not s.pending
    assert_consistent(s)


def _interrupt_now(tokens, logits):
    raise KeyboardInterrupt


def test_confidence(pair, translators):
    assert TurnStats("source", "alternation", logprobs=[-1.0, -3.0]).confidence == -2.0
    assert TurnStats("source", "alternation").confidence is None  # no answer, no score
    fwd, bwd = translators
    s = Session(pair, fwd, bwd, policy=plain(reader="tokens"))
    s.add_user("import json")
    events = list(s.generate("small", max_tokens=N))
    lps = [e.logprobs[e.token].item() for e in events]
    assert events[-1].handoff.confidence == pytest.approx(np.mean(lps))
    assert all(lp <= 0 for lp in lps)


def forcing(tokens):
    """A logits processor that makes the model say exactly `tokens`."""
    it = iter(tokens)

    def proc(_, logits):
        t = next(it, tokens[-1])  # mlx-lm computes one step ahead
        return mx.where(mx.arange(logits.shape[-1]) == t, 0.0, -1e9)[None].astype(logits.dtype)

    return proc


def test_template_diff_keeps_generated_tokens(pair, translators):
    """Answers whose re-tokenization differs, ending with EOS or cut at max_tokens, keep
    their exact tokens; the next message is appended after them (no cache trimmed)."""
    fwd, bwd = translators
    tok = pair.tokenizer
    eos = next(iter(tok.eos_token_ids))
    merged = tok.encode("def", add_special_tokens=False)
    pieces = [t for c in "def" for t in tok.encode(c, add_special_tokens=False)]
    assert len(merged) < len(pieces)  # "def" is one token, the model spells it out
    s = Session(pair, fwd, bwd, system_prompt="Be brief.", policy=plain(reader="self"))
    s.add_user("hi")
    n0 = len(s.tokens)
    list(s.generate("small", max_tokens=10, logits_processors=[forcing(pieces + [eos])]))
    assert s.tokens[n0:] == pieces + [eos] and s.messages[-1]["content"] == "def"
    new = s.add_user("more")
    assert s.tokens[n0 : n0 + len(pieces) + 1] == pieces + [eos]
    assert tok.decode(new).startswith("\n<|im_start|>user\nmore")
    n1 = len(s.tokens)
    list(s.generate("large", max_tokens=len(pieces), logits_processors=[forcing(pieces)]))
    assert s.last_turn.finish_reason == "length"
    s.add_user("again")  # no EOS: the template closes the turn itself
    assert tok.decode(s.tokens[n1:]).startswith("def<|im_end|>\n<|im_start|>user\nagain")
    assert s.retemplated == 0
    assert s.held("source") == n0 + len(pieces) + 1  # nothing was trimmed
    n2 = len(s.tokens)
    out = [e.token for e in s.generate("small", max_tokens=N)]
    assert out == native(pair.source.model, tok, s.tokens[:n2])


def test_template_not_prefix_stable(pair, translators, monkeypatch):
    """A template that rewrites earlier turns: re-tokenize, trim both caches to the common
    prefix, and the next answer is still exactly the model's own."""
    counting = "<|im_start|>system\n{{ messages|length }} messages<|im_end|>\n" + (
        pair.tokenizer._tokenizer.chat_template
    )
    monkeypatch.setattr(pair.tokenizer._tokenizer, "chat_template", counting)
    fwd, bwd = translators
    s = Session(pair, fwd, bwd, policy=plain(reader="tokens"))
    turns = converse(s, SCHEDULE[:3])
    assert s.retemplated == 2
    assert all(len(t[2]) > 0 for t in turns)
    assert_consistent(s)
    *_, (model, n0, toks, _) = turns
    assert toks == native(pair.source.model, pair.tokenizer, s.tokens[:n0])
