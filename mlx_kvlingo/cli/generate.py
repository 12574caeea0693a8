"""`kvlingo generate`: the source reads the prompt, the target answers from the translated cache."""

from __future__ import annotations

import json
import time

import click

from ..decode import PromptTooLongError, handoff
from ..sampling import resolve as resolve_sampling
from ._common import (
    pair_option,
    resolve_pair,
    sampling_options,
    sampling_settings,
    source_option,
    target_option,
    translator_option,
)
from ._distributed import describe, distributed_option, fail, load_runtime, wanted, wire_option


@click.command("generate")
@source_option
@target_option
@translator_option
@pair_option
@click.option("-p", "--prompt", default="What is the capital of France?", show_default=True)
@click.option("--chat/--no-chat", default=True, help="Apply the chat template to the prompt")
@click.option("-m", "--max-tokens", default=100, show_default=True)
@sampling_options
@distributed_option
@wire_option
@click.option("--json", "as_json", is_flag=True,
              help="Print one JSON object (token ids, texts, timings) instead of streaming text")  # fmt: skip
def generate_cmd(source, target, translator, demo_pair, prompt, chat, max_tokens, as_json,
                 **sampling):  # fmt: skip
    """One answer from the target with no target prefill, with honest timings."""
    distributed, wire = sampling.pop("distributed"), sampling.pop("wire")
    if wanted(distributed):  # mlx.launch: the target pipelined over the ranks
        if as_json:
            raise click.UsageError("--json is not available with --distributed")
        return _generate_distributed(source, target, translator, wire, prompt, chat, max_tokens,
                                     sampling_settings(sampling), demo_pair)  # fmt: skip
    import mlx.core as mx
    from mlx_lm import stream_generate

    pair, tr, _ = resolve_pair(source, target, translator, demo_pair=demo_pair)
    if chat and getattr(pair.tokenizer, "chat_template", None):
        tokens = pair.tokenizer.apply_chat_template(
            [{"role": "user", "content": prompt}], add_generation_prompt=True
        )
    else:
        tokens = pair.tokenizer.encode(prompt)
    cfg = resolve_sampling(pair.target, **sampling_settings(sampling))
    if cfg.seed is not None:
        mx.random.seed(cfg.seed)
    try:
        h = handoff(pair, tr, tokens)
    except PromptTooLongError as e:
        raise click.ClickException(str(e)) from None
    last, ids, pieces, t0, ttft = None, [], [], time.perf_counter(), None
    for r in stream_generate(
        pair.target.model, pair.tokenizer, mx.array(tokens[-1:]), max_tokens=max_tokens,
        prompt_cache=h.target_cache, sampler=cfg.sampler(),
        logits_processors=cfg.logits_processors(),
    ):  # fmt: skip
        ttft = ttft if ttft is not None else time.perf_counter() - t0
        if not as_json:
            click.echo(r.text, nl=False)
        ids.append(int(r.token))
        pieces.append(r.text)
        last = r
    total_ttft = h.source_prefill_s + h.translate_s + ttft  # the small model's read counted
    if as_json:
        out = {
            "source": pair.source.name,
            "target": pair.target.name,
            "prompt": prompt,
            "prompt_token_ids": [int(t) for t in tokens],
            "token_ids": ids,
            "pieces": pieces,
            "text": "".join(pieces),
            "finish_reason": last.finish_reason,
            "sampling": cfg.as_dict(),
            "timings": {
                "source_prefill_tokens": len(tokens) - 1,
                "source_prefill_s": h.source_prefill_s,
                "translated_tokens": h.translated_tokens,
                "translate_s": h.translate_s,
                "target_prompt_tokens": 1,
                "target_first_token_s": ttft,
                "ttft_s": total_ttft,
                "generation_tokens": last.generation_tokens,
                "generation_tps": last.generation_tps,
                "peak_memory_gb": last.peak_memory,
            },
        }
        click.echo(json.dumps(out, indent=1))
        return
    click.echo()
    click.echo(
        f"source prefill {len(tokens) - 1} tokens {h.source_prefill_s * 1e3:.1f} ms · "
        f"translation {h.translate_s * 1e3:.1f} ms · target first token {ttft * 1e3:.1f} ms · "
        f"TTFT {total_ttft * 1e3:.0f} ms · "
        f"target decode {last.generation_tokens} tokens "
        f"{last.generation_tps:.1f} tok/s · peak {last.peak_memory:.2f} GB",
        err=True,
    )


def _generate_distributed(source, target, translator, wire, prompt, chat, max_tokens, sampling,
                          demo_pair="dense"):  # fmt: skip
    """Rank 0: the same switch through a conversation on the distributed runtime (the small
    model reads the prompt, the span is placed on the ranks, the pipelined target decodes)."""
    from ..distributed import DistributedError
    from ..session import status_line

    runtime = load_runtime(source, target, translator, None, wire, demo_pair)  # ranks > 0 stop here
    try:
        session = runtime.new_conversation()._session
        if chat:
            session.add_user(prompt)
        else:
            session.add_tokens(session.pair.tokenizer.encode(prompt))
        cfg = resolve_sampling(runtime.pair.target, **sampling)
        if cfg.seed is not None:
            import mlx.core as mx

            mx.random.seed(cfg.seed)
        for ev in session.generate("target", max_tokens=max_tokens, sampler=cfg.sampler(),
                                   logits_processors=cfg.logits_processors()):  # fmt: skip
            click.echo(ev.text, nl=False)
        click.echo()
        names = {"source": runtime.pair.source.name, "target": runtime.pair.target.name}
        click.echo(f"{describe(runtime)} · {status_line(session.last_turn, names)}", err=True)
        runtime.close()
    except DistributedError as e:
        fail(e)
