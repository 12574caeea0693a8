"""`kvlingo generate`: the source reads the prompt, the target answers from the translated cache."""

from __future__ import annotations

import json

from mlx_kvlingo.cli._common import (
    pair_option,
    refuse_long_prompt,
    resolve_pair,
    sampling_options,
    sampling_settings,
    source_option,
    target_option,
    translator_option,
)
from mlx_kvlingo.cli._distributed import (
    describe,
    distributed_option,
    fail,
    load_runtime,
    wanted,
    wire_option,
)
from mlx_kvlingo.config import ReaderPolicy
from mlx_kvlingo.conversation.sampling import resolve as resolve_sampling

import click


@click.command("generate")
@source_option
@target_option
@translator_option
@pair_option
@click.option("-p", "--prompt", default="What is the capital of France?", show_default=True)
@click.option("--chat/--no-chat", default=True, help="Apply the chat template to the prompt")
@click.option("-m", "--max-tokens", type=click.IntRange(1), default=100, show_default=True)
@sampling_options
@distributed_option
@wire_option
@click.option("--json", "as_json", is_flag=True,
              help="Print one JSON object (token ids, texts, timings) instead of streaming text")  # fmt: skip
def generate_cmd(source, target, translator, demo_pair, prompt, chat, max_tokens, as_json,
                 **sampling):  # fmt: skip
    """One answer from the target with no target prefill, with honest timings."""
    from mlx_kvlingo.api import Runtime
    from mlx_kvlingo.distributed.pipeline import DistributedError

    distributed, wire = sampling.pop("distributed"), sampling.pop("wire")
    settings = sampling_settings(sampling)
    if wanted(distributed):  # mlx.launch: the target pipelined over the ranks
        if as_json:
            raise click.UsageError("--json is not available with --distributed")
        runtime = load_runtime(source, target, translator, None, wire, demo_pair)  # ranks > 0 stop
    else:
        runtime = Runtime(*resolve_pair(source, target, translator, demo_pair=demo_pair)[:2])
    pair = runtime.pair
    # the small model reads the prompt, the large one decodes from the translated cache: no
    # target prefill, not even of the question (large_reads_last=1: the last token only) and
    # no recompute
    policy = ReaderPolicy(reader="small", large_reads_last=1, recompute_share=0)
    conv = runtime.new_conversation(policy=policy)
    try:
        if chat and getattr(pair.tokenizer, "chat_template", None):
            conv.add_messages([{"role": "user", "content": prompt}])
        else:
            conv.add_tokens(pair.tokenizer.encode(prompt))
        tokens = conv.token_ids
        refuse_long_prompt(pair, len(tokens), "'-p' / '--prompt'")  # before any work
        ids, pieces = [], []
        for ev in conv.answer("large", max_tokens=max_tokens, sampling=settings):
            if ev.kind == "token":
                if not as_json:
                    click.echo(ev.text, nl=False)
                ids.append(int(ev.token))
                pieces.append(ev.text)
        if runtime.pipelined:
            click.echo()
            click.echo(f"{describe(runtime)} · {ev.status}", err=True)
            return runtime.close()
    except DistributedError as e:
        fail(e)
    done, t = ev, ev.timings
    # TTFT = the small model's read + translation + the large model's first token
    first = max(t.ttft_s - t.read_s - t.translate_s, 0.0)
    if as_json:
        out = {
            "source": pair.source.name,
            "target": pair.target.name,
            "prompt": prompt,
            "prompt_token_ids": [int(x) for x in tokens],
            "token_ids": ids,
            "pieces": pieces,
            "text": "".join(pieces),
            "finish_reason": done.finish_reason,
            "sampling": resolve_sampling(pair.target, settings).as_dict(),
            "timings": {
                "source_prefill_tokens": t.read_tokens,
                "source_prefill_s": t.read_s,
                "translated_tokens": t.translated_tokens,
                "translate_s": t.translate_s,
                "target_prompt_tokens": t.prompt_tokens,
                "target_first_token_s": first,
                "ttft_s": t.ttft_s,
                "generation_tokens": t.generation_tokens,
                "generation_tps": t.generation_tps,
                "peak_memory_gb": t.peak_memory_gb,
            },
        }
        click.echo(json.dumps(out, indent=1))
        return
    click.echo()
    click.echo(
        f"source prefill {t.read_tokens} tokens {t.read_s * 1e3:.1f} ms · "
        f"translation {t.translate_s * 1e3:.1f} ms · target first token {first * 1e3:.1f} ms · "
        f"TTFT {t.ttft_s * 1e3:.0f} ms · "
        f"target decode {t.generation_tokens} tokens "
        f"{t.generation_tps:.1f} tok/s · peak {t.peak_memory_gb:.2f} GB",
        err=True,
    )
