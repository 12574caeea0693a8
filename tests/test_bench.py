"""The latency benchmark: formulas by hand, an end-to-end run on the tiny preset (no timing
assertions) with the peer that drops tokens beside ours, length skipping, and the opt-in
per-expert MoE path computing the same thing."""

import mlx_kvlingo  # noqa: F401, I001  (OpenBLAS before mlx)

import json

import mlx.core as mx
import numpy as np
import pytest
from click.testing import CliRunner

from mlx_kvlingo._platform import moe_cpu
from mlx_kvlingo.config import ReaderPolicy
from mlx_kvlingo.eval import bench, report
from mlx_kvlingo.data import synthetic as syn
from mlx_kvlingo.cli.bench import bench_cmd
from mlx_kvlingo.eval.presets import PRESETS, QWEN3_MOE, load_preset

# -- formulas ------------------------------------------------------------------------------


def test_targets_flag_a_regression():
    """The goals block says, per goal, the measured value and whether it was met: an
    efficiency under the goal at any length, a slow translation or a small speed-up at the
    shortest length is flagged."""

    def derived(eff, step, speedup):
        return {"derived": {"gemm_efficiency": eff, "map_efficiency": 0.9,
                            "translation_vs_target_step": step, "gemm_vs_target_step": 0.05,
                            "switch_speedup": speedup}}  # fmt: skip

    good = {"lengths": {"64": derived(0.75, 0.1, 9.5), "256": derived(0.8, 0.3, 20.0)}}
    t = bench.check_targets(good)
    assert all(g["met"] for g in t.values())
    assert t["translation_vs_target_step"]["at"] == 64 and t["switch_speedup"]["value"] == 9.5
    bad = {"lengths": {"64": derived(0.75, 0.2, 3.5), "256": derived(0.25, 0.3, 20.0)}}
    t = bench.check_targets(bad)
    assert not any(g["met"] for g in t.values())
    assert t["gemm_efficiency"]["value"] == {64: 0.75, 256: 0.25}
    md = "\n".join(bench.targets_lines(t))
    assert md.count("**missed**") == 3 and "256: 25% (maps alone 90%)" in md
    assert bench.check_targets({"lengths": {}}) == {}


def test_summary():
    s = report.stats([1.0, 2.0, None, 3.0, 10.0])  # None: not measured, left out
    assert s["median"] == 2.5 and s["min"] == 1 and s["max"] == 10 and s["n"] == 4
    assert s["mean"] == 4.0 and report.stats([None]) is None and report.stats([2.0])["std"] == 0


def test_kernel_work_counts_translator_matmuls(tiny_pair):
    _, tr = tiny_pair
    flops, nbytes = bench.kernel_work(tr, 10)
    size = tr.key["weight"].size + tr.value["weight"].size
    assert flops == 2 * 10 * size
    assert nbytes > 4 * size


def test_qwen3_preset_keeps_the_geometry():
    p = PRESETS[QWEN3_MOE]
    src, tgt = p.config("source", 1000), p.config("target", 1000)
    assert (src["num_hidden_layers"], src["hidden_size"], src["num_attention_heads"]) == (
        28, 1024, 16)  # fmt: skip
    assert (src["num_key_value_heads"], src["head_dim"]) == (8, 128)
    assert tgt["model_type"] == "qwen3_moe"
    assert (tgt["num_hidden_layers"], tgt["num_attention_heads"]) == (48, 32)
    assert (tgt["num_key_value_heads"], tgt["head_dim"], tgt["num_experts_per_tok"]) == (4, 128, 8)
    total = 4 * (p.parameter_count("source") + p.parameter_count("target"))
    assert total < 16 * 2**30  # float32 weights leave room on a 24 GiB machine


# -- end to end on the tiny preset ----------------------------------------------------------


@pytest.fixture(scope="module")
def preset_cache(tmp_path_factory):
    """The cache folder presets are built into (`$KVLINGO_CACHE`) for this module's tests."""
    folder = tmp_path_factory.mktemp("presets")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("KVLINGO_CACHE", str(folder))
        yield folder


@pytest.fixture(scope="module")
def tiny_pair(preset_cache):
    pair, tr, _ = load_preset("tiny", preset_cache)
    return pair, tr


def test_cli_end_to_end_writes_json_markdown_png(preset_cache, tmp_path):
    out = tmp_path / "out"
    result = CliRunner().invoke(
        bench_cmd,
        ["--preset", "tiny", "--lengths", "8,96", "--specprefill", "0.25,1", "--trials", "2",
         "--warmup", "1", "--out", str(out), "--no-progress"],
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    data = json.loads((out / "bench.json").read_text())
    assert data["schema"] == bench.SCHEMA
    assert {"mlx", "mlx-lm"} <= set(data["software"])
    assert {"os", "backend", "blas", "cpu"} <= set(data["machine"])
    assert data["pair"]["preset"]["name"] == "tiny"
    assert data["pair"]["source"]["dtype"] == "float32"
    assert set(data["lengths"]) == {"8", "96"}
    assert data["settings"]["specprefill_keep"] == [0.25, 1.0]
    for v in data["lengths"].values():
        for phase in ("source_prefill", "target_ttft", "translate", "target_step", "switch_ttft",
                      "translate_map", "gemm", "specprefill 0.25", "specprefill 1"):  # fmt: skip
            assert len(v["trials"][phase]) == 2
            assert all(t > 0 for t in v["trials"][phase])
        assert v["derived"]["switch_speedup"] > 0
        med = {p: s["median"] for p, s in v["stats"].items()}
        assert v["derived"]["gemm_vs_target_step"] == med["gemm"] / med["target_step"]
        assert v["derived"]["map_efficiency"] == med["gemm"] / med["translate_map"]
        assert v["derived"]["switch_speedup"] == med["target_ttft"] / med["switch_ttft"]
        # each path's TTFT over the large model's own read, ours beside the peer's
        ratio = v["ttft_over_target"]
        assert ratio["ours"] == (med["source_prefill"] + med["switch_ttft"]) / med["target_ttft"]
        assert ratio["specprefill 0.25"] == med["specprefill 0.25"] / med["target_ttft"]
    md = (out / "bench.md").read_text()
    assert "| path | phase | test | ms | t/s |" in md
    assert "ttft96" in md and "tr95+tg1" in md and "±" in md
    assert "| kernel | translator maps alone | map95 |" in md
    assert "| specprefill | speculative prefill TTFT, 0.25 kept | sp0.25@96 |" in md
    row = next(r for r in md.splitlines() if r.startswith("| 96 | ") and r.count("|") == 7)
    r96 = data["lengths"]["96"]["ttft_over_target"]
    assert row.endswith(f"| {r96['ours']:.2f} | {r96['switch alone']:.3f} | "
                        f"{r96['specprefill 0.25']:.2f} (32) | {r96['specprefill 1']:.2f} (95) |")  # fmt: skip
    goals = data["targets"]  # the goals block: each goal, its value, met or not
    assert set(goals) == set(bench.TARGETS)
    assert goals["switch_speedup"]["at"] == 8 and goals["switch_speedup"]["value"] == (
        data["lengths"]["8"]["derived"]["switch_speedup"])  # fmt: skip
    assert set(goals["gemm_efficiency"]["value"]) == {"8", "96"}
    assert all(isinstance(g["met"], bool) for g in goals.values())
    assert "## Goals" in md
    png = (out / "ttft.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n"
    import matplotlib.image

    assert matplotlib.image.imread(str(out / "ttft.png")).ndim == 3


def test_the_peer_reads_its_kept_share(tiny_pair):
    """Speculative prefill is timed from a run of the product's own read: at each kept share
    the large model's cache held the kept 32-token chunks of the n-1 tokens before the last
    (a quarter of 128: one chunk, 31 or 32 entries; everything kept: all 127), every trial;
    with no share given the peer is not run."""
    pair, tr = tiny_pair
    results = bench.run_bench(pair, tr, [128], trials=2, warmup=0, keeps=(0.25, 1.0))
    v = results["lengths"]["128"]
    peer = v["specprefill"]
    assert set(peer) == {"specprefill 0.25", "specprefill 1"}
    assert peer["specprefill 0.25"]["keep"] == 0.25 and peer["specprefill 1"]["keep"] == 1.0
    assert all(31 <= h <= 32 for h in peer["specprefill 0.25"]["cache_entries"])
    assert peer["specprefill 1"]["cache_entries"] == [127, 127]
    for k in peer:
        assert len(v["trials"][k]) == 2 and all(t > 0 for t in v["trials"][k])
        assert (
            v["ttft_over_target"][k]
            == v["stats"][k]["median"] / v["stats"]["target_ttft"]["median"]
        )
    alone = bench.run_bench(pair, tr, [16], trials=1, warmup=0)
    assert not alone["lengths"]["16"]["specprefill"] and alone["settings"]["specprefill_keep"] == []


def test_bench_reports_the_map_reading(preset_cache, tmp_path):
    """The strategy the maps were measured to read by, at the start of the run, is kept."""
    out = tmp_path / "out"
    result = CliRunner().invoke(
        bench_cmd,
        ["--preset", "tiny", "--lengths", "8,24",
         "--trials", "1", "--warmup", "0", "--out", str(out), "--no-progress"],
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    data = json.loads((out / "bench.json").read_text())
    assert set(data["map_reading"]) == {"key@64", "value@64", "key@256", "value@256"}
    assert "Map reading measured at the start" in (out / "bench.md").read_text()


def test_lengths_that_do_not_fit_are_skipped(tiny_pair, monkeypatch, tmp_path):
    pair, tr = tiny_pair
    real = bench.working_bytes
    monkeypatch.setattr(bench, "working_bytes", lambda p, t, n: 10**15 if n > 10 else real(p, t, n))
    messages = []
    results = bench.run_bench(pair, tr, [6, 40], trials=1, warmup=0, log=messages.append)
    assert list(results["lengths"]) == ["6"]
    assert results["skipped"][0]["length"] == 40 and "GB" in results["skipped"][0]["reason"]
    assert any("skipping n=40" in m for m in messages)
    paths = bench.write_outputs(results, tmp_path)
    assert "Skipped: n=40" in paths["markdown"].read_text()


# -- the opt-in per-expert MoE path -------------------------------------------------------


def test_moe_per_expert_loop_computes_the_same():
    cfg = syn.model_config("qwen3_moe", 300)
    model = syn.build_model(cfg, seed=3)
    tokens = mx.array(np.random.default_rng(0).integers(0, 300, (1, 40)))  # 80 assignments
    one = tokens[:, :1]  # a decode step keeps gather_mm
    ref, ref1 = model(tokens), model(one)
    with moe_cpu.per_expert_loop() as active:
        assert active == (not mx.metal.is_available())
        out, out1 = model(tokens), model(one)
    assert not moe_cpu.enabled()
    np.testing.assert_allclose(np.array(out), np.array(ref), rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(np.array(out1), np.array(ref1))
    assert (mx.argmax(out, -1) == mx.argmax(ref, -1)).all().item()
    with moe_cpu.per_expert_loop(False) as active:
        assert not active


def test_bench_with_moe_loop_runs(tiny_pair):
    pair, tr = tiny_pair
    with moe_cpu.per_expert_loop():
        results = bench.run_bench(pair, tr, [40], trials=1, warmup=0)
    assert results["lengths"]["40"]["trials"]["target_ttft"][0] > 0


def test_bench_times_the_maps_of_a_pre_norm_translator(tiny_pair):
    """A pre_norm translator's keys are not in the cache: the maps-alone phase reads them
    from a prefill, as the hand-off does."""
    from dataclasses import replace

    from mlx_kvlingo.kv.translator import Translator

    pair, tr = tiny_pair
    pre = Translator(replace(tr.config, key_cut="pre_norm"))
    pre.key, pre.value = tr.key, tr.value
    results = bench.run_bench(pair, pre, [12], trials=1, warmup=0)
    assert results["lengths"]["12"]["trials"]["translate_map"][0] > 0
    assert results["pair"]["translator"]["key_cut"] == "pre_norm"


def test_extrapolate_between_linear_and_quadratic():
    assert bench.extrapolate({100: 1.0, 200: 2.0}, 400) == pytest.approx(4.0)  # linear
    assert bench.extrapolate({100: 1.0, 200: 8.0}, 400) == pytest.approx(32.0)  # capped at n^2
    assert bench.extrapolate({100: 1.0}, 400) == pytest.approx(8.0)  # n^1.5 from one point


def test_warm_up_rounds_run_every_length_and_are_not_recorded(tiny_pair, monkeypatch):
    """No measured trial is the first to run a length (its buffers, the heap's growth)."""
    pair, tr = tiny_pair
    runs = []
    real = bench.run_switch
    monkeypatch.setattr(
        bench, "run_switch", lambda p, t, toks, *a: runs.append(len(toks)) or real(p, t, toks, *a)
    )
    results = bench.run_bench(pair, tr, [6, 30], trials=2, warmup=1)
    assert runs[:2] == [6, 30] and sorted(runs) == [6, 6, 6, 30, 30, 30]
    for n in ("6", "30"):  # the warm-up round is not among the recorded trials
        assert {len(t) for t in results["lengths"][n]["trials"].values()} == {2}


def test_time_budget_skips_longer_lengths(tiny_pair):
    pair, tr = tiny_pair
    results = bench.run_bench(pair, tr, [6, 30], trials=1, warmup=1, max_seconds=0.0,
                              log=lambda m: None)  # fmt: skip
    assert list(results["lengths"]) == ["6"]
    assert "budget" in results["skipped"][0]["reason"]


def test_conversation_bench_policies(tmp_path):
    """`kvlingo bench --conversation` on the tiny preset: every policy answers every turn, the
    large model reads one token per turn when the small reads for it, escalations happen."""
    from mlx_kvlingo.cli import cli
    from mlx_kvlingo.eval.conversation_bench import POLICIES

    out = CliRunner().invoke(cli, ["bench", "--preset", "tiny", "--conversation", "--turns", "4",
                                   "--user-lengths", "8,24", "--answer-tokens", "3",
                                   "--escalation-rate", "0.5", "--seed", "1", "-o", str(tmp_path),
                                   "--large-reads-last", "1"])  # fmt: skip
    assert out.exit_code == 0, out.output
    result = json.loads((tmp_path / "conversation.json").read_text())
    turns = result["turns"]
    assert len(turns) == 4 * len(POLICIES) == 4 * 4
    small = [t for t in turns if t["policy"] == "small reads"]
    large = [t for t in turns if t["policy"] == "large reads"]
    assert all(t["large_read_tokens"] == 1 and t["read_s"] > 0 for t in small)
    assert [t["large_read_tokens"] for t in large[1:]] == [24, 8, 24]  # the user turns, itself
    # reader auto: by the rates the warm-up measured, one way or the other; the report
    # compares it with the better of the two per turn
    auto = [t for t in turns if t["policy"] == "auto reads"]
    for t, r in zip(auto[1:], [24, 8, 24]):
        assert t["large_read_tokens"] == (1 if t["small_read"] else r)
    assert result["warmup_s"] > 0 and len(result["summary"]["auto"]["turns"]) == 4
    md = (tmp_path / "conversation.md").read_text()
    assert "Reader auto against the better" in md and "small / large TTFT" in md
    esc = [t for t in turns if t["policy"] == "cascade" and t["escalated"]]
    assert [t["turn"] for t in esc] == result["escalated_turns"] and esc
    assert all(t["ttft_s"] > 0 and t["total_s"] >= t["ttft_s"] for t in turns)
    assert all(t["escalation_ttft_s"] > 0 for t in esc)
    c = result["summary"]["cascades"]["cascade"]
    assert c["escalations"] == len(esc) and c["escalation_ttft_in_steps"] > 0
    bad = CliRunner().invoke(cli, ["bench", "--preset", "tiny", "--conversation",
                                   "--policies", "tokens reads"])  # fmt: skip
    assert bad.exit_code == 2 and "tokens reads: expected some of large reads" in bad.output


def test_conversation_bench_auto_weighs_the_chats_retention(tiny_pair):
    """The benchmark's reader auto is the chat's: with a measured retention under the threshold
    (`Pair.retention`), it lets the large model read every turn itself, and the report
    measures it against the large path alone; without one, against the faster of both."""
    from mlx_kvlingo.conversation import reader
    from mlx_kvlingo.eval.conversation_bench import ConversationBenchConfig, run_conversation_bench

    from helpers import fixed_costs

    pair, tr = tiny_pair
    cfg = ConversationBenchConfig(turns=2, user_lengths=(64,), answer_tokens=2,
                                  policies=("large reads", "small reads", "auto reads"),
                                  warmup=False, policy=ReaderPolicy(reader_min_tokens=1))  # fmt: skip
    k = reader.retention_key(pair, tr, cfg.policy)
    reader.record_retention(k, "a test", [(8, 0, 3), (64, 0, 3)])
    path = reader.path_for(reader.RETENTION, k)
    # by time the small path wins: the large model's reading costs 10 ms a token
    pair.__dict__["_kvlingo_read_costs"] = fixed_costs(
        source_read=(0, 1e-4), forward=(0, 1e-5), backward=(0, 1e-5), target_read=(0, 1e-2)
    )
    try:
        res = run_conversation_bench(pair, tr, None, cfg, log=lambda m: None)
    finally:
        path.unlink()
    rows = res["summary"]["auto"]["turns"]
    assert [r["small_read"] for r in rows] == [False, False]
    assert all(r["retention"] == 0.0 and not r["small_keeps"] for r in rows)
    assert all(r["auto_over_best"] == r["auto_ms"] / r["large_reads_ms"] for r in rows)
    res = run_conversation_bench(pair, tr, None, cfg, log=lambda m: None)  # none measured
    del pair.__dict__["_kvlingo_read_costs"]
    rows = res["summary"]["auto"]["turns"]
    assert all(r["small_read"] and r["retention"] is None and r["small_keeps"] for r in rows)
