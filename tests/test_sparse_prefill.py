"""Speculative prefill, the peer (kv/sparse_prefill.py): its chunk rule and its scores against
transcriptions of the published ones (vllm-mlx 0.6.0, `vllm_mlx/specprefill.py`), kept
tokens at their own positions under traditional and non-traditional RoPE, and 100% kept
answering as the native read, token for token, through `kvlingo eval --task content`."""

import json
import math

from mlx_kvlingo.cli import cli
from mlx_kvlingo.data.content_tasks import build_tasks
from mlx_kvlingo.eval.content import Peer, evaluate_content, native_kv
from mlx_kvlingo.kv.sparse_prefill import (
    positions_shifted,
    score_tokens,
    select_chunks,
    sparse_prefill,
)
from mlx_kvlingo.models.pair import load_pair

import mlx.core as mx
import pytest
from click.testing import CliRunner

TEXT = (
    "The river rose slowly through the night. Farmers moved their cattle to the hills. "
    "By morning the bridge was under water and the school was closed. "
    "Volunteers filled sandbags near the old mill while the rain kept falling. "
    "The mayor asked everyone to stay at home until the water went down. "
) * 8
PROMPT = "def main(argv=None):\n    parser = argparse.ArgumentParser(prog=" * 6


@pytest.fixture(scope="module", params=["qwen3", "llama"])
def pair(request, tiny_dir):
    """A tiny pair whose target rotates non-traditionally (qwen3) or traditionally (llama)."""
    pair = load_pair(tiny_dir["qwen3"], tiny_dir[request.param])
    assert pair.target.layers[0].self_attn.rope.traditional == (request.param == "llama")
    return pair


def published_select(importance, keep_pct, chunk_size=32):
    """vllm-mlx 0.6.0's `select_chunks` (backbone_pct 0, its default), transcribed."""
    M = importance.shape[0]
    if keep_pct >= 1.0:
        return list(range(M))
    n_chunks = math.ceil(M / chunk_size)
    target_tokens = max(1, math.ceil(M * keep_pct))
    keep_n = max(1, math.ceil(n_chunks * keep_pct))
    scores = [mx.mean(importance[i * chunk_size : (i + 1) * chunk_size]).item()
              for i in range(n_chunks)]  # fmt: skip
    ranked = sorted(range(n_chunks), key=lambda i: scores[i], reverse=True)
    selected = set(ranked[:keep_n])

    def count(chunks):
        return sum(min((c + 1) * chunk_size, M) - c * chunk_size for c in chunks)

    if len(selected) < keep_n or count(selected) < target_tokens:
        for c in ranked:
            selected.add(c)
            if len(selected) >= keep_n and count(selected) >= target_tokens:
                break
    return [
        p for c in sorted(selected) for p in range(c * chunk_size, min((c + 1) * chunk_size, M))
    ]


def test_chunk_rule_is_the_published_one():
    """The same kept tokens as the published rule on random scores (short last chunks, shares
    whose whole chunks fall short of the share's tokens), and a case worked by hand."""
    for seed in range(40):
        mx.random.seed(seed)
        M = int(mx.random.randint(1, 700, ()).item())
        scores = mx.random.uniform(shape=(M,))
        for keep in (0.01, 0.1, 0.2, 0.3, 0.55, 0.99, 1.0):
            assert select_chunks(scores, keep) == published_select(scores, keep), (seed, M, keep)
    scores = mx.zeros((100,)).at[40].add(1.0).at[99].add(5.0)  # chunks 1 (32-63) and 3 (96-99)
    # 10% of 4 chunks is one chunk; chunk 3 holds 4 tokens < 10 tokens, so chunk 1 joins
    assert select_chunks(scores, 0.1) == list(range(32, 64)) + [96, 97, 98, 99]
    # ties go to the earlier chunk, as the published stable sort does: 30% of 4 chunks is 2
    assert select_chunks(mx.ones((100,)), 0.3) == list(range(64))
    assert published_select(mx.ones((100,)), 0.3) == list(range(64))
    with pytest.raises(ValueError, match="above 0"):
        select_chunks(scores, 0.0)


def published_scores(model, tokens, n_lookahead=8, pool_kernel=13):
    """vllm-mlx 0.6.0's `score_tokens` (greedy look-ahead), transcribed: queries rebuilt from
    each attention's input (q_proj, q_norm where the family has it, RoPE at the cache offset),
    keys repeated per group, softmaxes of every layer pooled by prefix sums, max, mean."""
    from mlx_lm.models.cache import make_prompt_cache

    attns = [layer.self_attn for layer in model.layers]
    captured = [[] for _ in attns]

    class Capture:
        def __init__(self, attn, out):
            self.attn, self.out = attn, out

        def __call__(self, x, mask=None, cache=None):
            a = self.attn
            q = a.q_proj(x).reshape(1, x.shape[1], a.n_heads, -1)
            q = (a.q_norm(q) if hasattr(a, "q_norm") else q).transpose(0, 2, 1, 3)
            self.out.append(a.rope(q, offset=cache.offset))
            return self.attn(x, mask=mask, cache=cache)

    M = len(tokens)
    cache = make_prompt_cache(model.model)
    model.model(mx.array(tokens[:-1])[None], cache=cache)
    logits = model.model(mx.array(tokens[-1:])[None], cache=cache)
    for layer, attn, out in zip(model.layers, attns, captured):
        layer.self_attn = Capture(attn, out)
    try:
        for _ in range(n_lookahead):
            logits = model.model(mx.argmax(logits[:, -1, :], axis=-1)[None], cache=cache)
    finally:
        for layer, attn in zip(model.layers, attns):
            layer.self_attn = attn
    weights = []
    for c, out, attn in zip(cache, captured, attns):
        k = c.keys[..., :M, :]
        k = mx.repeat(k, attn.n_heads // k.shape[1], axis=1)
        s = (mx.concatenate(out, axis=2) @ k.transpose(0, 1, 3, 2)) * k.shape[-1] ** -0.5
        weights.append(mx.softmax(s.astype(mx.float32), axis=-1)[0])
    combined = mx.concatenate(weights, axis=0)
    pad = pool_kernel // 2
    padded = mx.pad(combined, [(0, 0), (0, 0), (pad, pad)])
    prefix = mx.concatenate([mx.zeros((*combined.shape[:-1], 1)), mx.cumsum(padded, -1)], -1)
    pooled = (prefix[..., pool_kernel:] - prefix[..., :-pool_kernel]) / pool_kernel
    return pooled.max(axis=0).mean(axis=0)


def test_scores_are_the_published_ones(pair):
    """A model's scores equal the transcription's (greedy look-ahead on both sides), up to
    float32 rounding, with q_norm (qwen3) and without (llama); they single out positions."""
    tokens = pair.tokenizer.encode(PROMPT)
    got = score_tokens(pair.target, tokens, temp=0.0)
    ref = published_scores(pair.target, tokens)
    assert got.shape == (len(tokens),)
    assert mx.allclose(got, ref, rtol=1e-5, atol=1e-7).item()
    assert got.max().item() > 2 * got.min().item()


def test_kept_tokens_sit_at_their_own_positions(pair):
    """Every kept token's keys in the first layer (which see the token and its position only)
    equal the native read's at its position, and the decode reads the next token at the
    prompt's length, not at the cache's, in both RoPE layouts (to float32 rounding: a product
    over fewer rows rounds differently; 1e-6 here). Reading them at the cache's positions (no
    shift) gives other keys: the check can fail."""
    model = pair.target
    tokens = pair.tokenizer.encode(PROMPT)
    M = len(tokens)
    keys, _ = native_kv(model, tokens)
    kept = [p for p in range(M - 1) if p % 3 == 0 or 40 <= p < 72]
    cache = sparse_prefill(model, tokens, kept, step=16)  # several reads of 16
    N = len(kept)
    assert cache[0].offset == N
    same = dict(rtol=0, atol=1e-5)
    assert mx.allclose(cache[0].keys[..., :N, :], keys[0][..., mx.array(kept), :], **same).item()
    with positions_shifted(model, M - 1 - N):
        model.model(mx.array(tokens[-1:])[None], cache=cache)
    assert mx.allclose(cache[0].keys[..., N, :], keys[0][..., M - 1, :], **same).item()
    plain = sparse_prefill(model, [tokens[p] for p in kept] + tokens[-1:], list(range(N)))
    assert not mx.allclose(plain[0].keys[..., 1:N, :], cache[0].keys[..., 1:N, :], atol=0.1).item()
    # with every token kept, the sparse read is the native one bit for bit (same reads of 512)
    full = sparse_prefill(model, tokens, list(range(M - 1)))
    for c, k in zip(full, native_kv(model, tokens[:-1])[0]):
        assert mx.array_equal(c.keys[..., : c.offset, :], k).item()


def test_all_kept_answers_as_native_and_fewer_kept_differ(pair):
    """At 100% kept the peer's replies are the native ones token for token (both RoPE
    layouts); at 10% kept the large model reads a tenth and answers from its own decode."""
    tasks = build_tasks(pair.tokenizer, [TEXT], [160], 1, ("fact", "qa"), seed=1)
    res = evaluate_content(pair, tasks, {"all": Peer(1.0), "tenth": Peer(0.1)}, small=False)
    replies = {c: [r["reply"] for r in res.records if r["condition"] == c] for c in res.conditions}
    assert replies["all"] == replies["native"] and any(replies["native"])
    assert replies["tenth"] != replies["native"]
    assert all(r["read_s"] > 0 for r in res.records)


def test_eval_runs_the_peer_beside_ours(tiny_dir, tmp_path):
    """`kvlingo eval --task content --specprefill` adds one condition per kept share; a share
    outside (0, 1] is refused in one line, and so is the option without --task content."""
    from helpers import exact_translator

    pair = load_pair(tiny_dir["qwen3"], tiny_dir["known"])
    tr = tmp_path / "tr.safetensors"
    from mlx_kvlingo.models.files import save_translator

    save_translator(exact_translator(pair, tiny_dir["known_answer"]), tr, pair)
    text = tmp_path / "doc.txt"
    text.write_text(TEXT)
    out = tmp_path / "r.json"
    args = ["eval", "--source", str(tiny_dir["qwen3"]), "--target", str(tiny_dir["known"]),
            "--translator", str(tr), "--task", "content", "--data", str(text), "--lengths", "96",
            "--per-kind", "1", "--kinds", "fact", "--json", str(out)]  # fmt: skip
    r = CliRunner().invoke(cli, [*args, "--specprefill", "0.2,1"])
    assert r.exit_code == 0, r.output
    result = json.loads(out.read_text())
    assert result["conditions"] == [
        "native", "translated", "chat", "specprefill 0.2", "specprefill 1", "small"
    ]  # fmt: skip
    by = {x["condition"]: x["reply"] for x in result["records"]}
    assert by["specprefill 1"] == by["native"]
    for bad in ("0", "1.5", "x"):
        r = CliRunner().invoke(cli, [*args, "--specprefill", bad])
        assert r.exit_code == 2 and "Traceback" not in r.output, r.output
    r = CliRunner().invoke(cli, ["eval", "--specprefill", "0.2"])
    assert r.exit_code == 2 and "--task content" in r.output
