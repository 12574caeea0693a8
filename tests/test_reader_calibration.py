"""Reader-mode calibration examples: earlier replies the target reads itself, the rest translated."""

import json

from mlx_kvlingo.calibrate.distill import Stage2Config, distill
from mlx_kvlingo.data.examples import DataConfig, load_examples
from mlx_kvlingo.kv.scoring import kl, prepare, student_logp

import mlx.core as mx
import pytest
from helpers import exact_translator

CONV = [
    {"role": "user", "content": "hello there, how are you doing today?"},
    {"role": "assistant", "content": "fine thanks, and you? the weather is lovely here"},
    {"role": "user", "content": "good, what should I cook tonight"},
    {"role": "assistant", "content": "a soup with carrots and lentils"},
    {"role": "user", "content": "and for dessert"},
    {"role": "assistant", "content": "baked apples"},
]


@pytest.fixture(scope="module")
def examples(tmp_path_factory, known_pair):
    f = tmp_path_factory.mktemp("reader") / "chat.jsonl"
    f.write_text(json.dumps({"messages": CONV}) + "\n" + json.dumps({"messages": CONV[:4]}) + "\n")
    cfg = DataConfig(min_prefix=4, heldout_fraction=0.0, replies_per_chat=None, reply_spans=True)
    train, held = load_examples(f, known_pair.tokenizer, cfg)  # one of the two is held out
    return train + held


def test_reply_spans_hold_the_replies_words(examples, known_pair):
    tok = known_pair.tokenizer
    last = max(examples, key=lambda e: len(e.replies))
    assert len(last.replies) == 2  # the reply to the third question follows two earlier ones
    texts = [tok.decode(list(last.prefix[s:e])) for s, e in last.replies]
    assert texts == [CONV[1]["content"], CONV[3]["content"]]
    first = min(examples, key=lambda e: len(e.prefix))
    assert first.replies == ()  # the first reply has none before it


def test_reply_spans_follow_a_truncated_prefix(tmp_path, known_pair):
    tok = known_pair.tokenizer
    f = tmp_path / "chat.jsonl"
    f.write_text(json.dumps({"messages": CONV}) + "\n")
    full, _ = load_examples(f, tok, DataConfig(min_prefix=4, heldout_fraction=0.0, replies_per_chat=None, reply_spans=True))  # fmt: skip
    ex = max(full, key=lambda e: len(e.prefix))
    cut = ex.replies[0][0] + 3  # cuts into the first reply
    short, _ = load_examples(
        f,
        tok,
        DataConfig(
            4, len(ex.prefix) - cut, heldout_fraction=0.0, replies_per_chat=None, reply_spans=True
        ),
    )
    ex_short = max(short, key=lambda e: len(e.prefix))
    assert ex_short.prefix == ex.prefix[cut:]
    assert ex_short.replies == ((0, ex.replies[0][1] - cut), (ex.replies[1][0] - cut, ex.replies[1][1] - cut))  # fmt: skip


def test_reader_mode_with_an_exact_translator_is_the_native_cache(examples, known_pair, tiny_dir):
    """Translated pieces at their true positions between the target's own replies: exact."""
    exact = exact_translator(known_pair, tiny_dir["known_answer"])
    ex = max(examples, key=lambda e: len(e.replies))
    p = prepare(known_pair, ex, "post_norm", reader_mode=True)
    assert len(p.replies) == 2
    assert kl(p.teacher_logp, student_logp(exact, known_pair, p)).item() < 1e-5


def test_reader_mode_reads_the_replies_natively(examples, known_pair, tiny_dir):
    """A wrong translator: the student moves toward the teacher as more is read natively, and
    a 'reply' covering the whole prefix leaves nothing translated (the native cache, exactly)."""
    answer = tiny_dir["known_answer"]
    wrong = exact_translator(known_pair, {k: [m[::-1] for m in answer[k]] for k in ("key_maps", "value_maps")})  # fmt: skip
    ex = max(examples, key=lambda e: len(e.replies))
    translated = prepare(known_pair, ex, "post_norm")
    reader = prepare(known_pair, ex, "post_norm", reader_mode=True)
    kl_translated = kl(translated.teacher_logp, student_logp(wrong, known_pair, translated))
    kl_reader = kl(reader.teacher_logp, student_logp(wrong, known_pair, reader))
    assert kl_reader.item() < kl_translated.item()
    reader.replies = ((0, len(ex.prefix) - 1),)
    assert kl(reader.teacher_logp, student_logp(wrong, known_pair, reader)).item() < 1e-5


def test_stage2_reader_share(examples, known_pair, tiny_dir):
    with pytest.raises(ValueError, match="reader_share"):
        Stage2Config(reader_share=1.5)
    tr = exact_translator(known_pair, tiny_dir["known_answer"])
    tr.value["weight"] = tr.value["weight"] * 0.5
    before = mx.array(tr.value["weight"])
    cfg = Stage2Config(steps=2, learning_rate=1e-3, warmup=1, reader_share=1.0, eval_every=2)
    distill(tr, known_pair, examples, examples[:2], cfg)
    assert not mx.array_equal(before, tr.value["weight"])
    assert tr.config.metadata["calibration"]["stage2"]["config"]["reader_share"] == 1.0
