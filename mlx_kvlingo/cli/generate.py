"""`kvlingo generate`: one answer through `mlx_kvlingo.stream_generate`."""

from __future__ import annotations

import json

from mlx_kvlingo.cli import _distributed as dist
from mlx_kvlingo.cli._common import pair_options, refuse_long_prompt, sampling_options

import click


@click.command("generate", context_settings={"show_default": True})
@pair_options
@click.option("-p", "--prompt", default="What is the capital of France?")
@click.option("--chat/--no-chat", default=True, help="Apply the chat template to the prompt")
@click.option("-m", "--max-tokens", type=click.IntRange(1), default=100)
@sampling_options
@dist.options
@click.option("--json", "as_json", is_flag=True,
              help="Print one JSON object (token ids, texts, timings) instead of streaming text")  # fmt: skip
def generate_cmd(source, target, translator, demo_pair, prompt, chat, max_tokens, sampling,
                 distributed, wire, as_json):  # fmt: skip
    """One answer from the large model with no large prefill, with honest timings."""
    from mlx_kvlingo import ReaderPolicy
    from mlx_kvlingo.api import make_prompt_cache, stream_generate

    if as_json and dist.wanted(distributed):
        raise click.UsageError("--json is not available with --distributed")
    pair = dist.pair_from_options(source, target, translator, None, demo_pair, distributed, wire)
    tok = pair.tokenizer
    if chat and getattr(tok, "chat_template", None):
        msgs = [{"role": "user", "content": prompt}]
        tokens = list(tok.apply_chat_template(msgs, add_generation_prompt=True))
    else:
        tokens = tok.encode(prompt)
    refuse_long_prompt(pair.models, len(tokens), "'-p' / '--prompt'")  # before any work
    # the small model reads the prompt, the large one decodes from the translated cache: no large
    # prefill (large_reads_last=1: the last token only), no recompute
    policy = ReaderPolicy(reader="small", large_reads_last=1, recompute_share=0)
    cache = make_prompt_cache(pair, policy=policy)
    ids, pieces = [], []
    with dist.rank_errors():
        for r in stream_generate(pair, tokens, cache, max_tokens=max_tokens, **sampling):
            if r.token is not None:
                if not as_json:
                    click.echo(r.text, nl=False)
                ids.append(int(r.token))
                pieces.append(r.text)
        if not as_json:
            where = f"{dist.describe(pair)} · " if pair.link is not None else ""
            click.echo()
            click.echo(where + r.status, err=True)
            return pair.close()
    st = r.handoff
    read_tokens, read_s = (st.read.tokens, st.read.seconds) if st.read else (0, 0.0)
    sw = st.switch
    translated, translate_s = (sw.translated, sw.seconds) if sw and sw.translated else (0, 0.0)
    out = {
        **pair.names,  # small, large
        "prompt": prompt,
        "prompt_token_ids": [int(x) for x in tokens],
        "token_ids": ids,
        "pieces": pieces,
        "text": "".join(pieces),
        "finish_reason": r.finish_reason,
        "sampling": sampling,  # those given; the rest the large model's own
        "timings": {
            "small_read_tokens": read_tokens,
            "small_read_s": read_s,
            "translated_tokens": translated,
            "translate_s": translate_s,
            "large_prompt_tokens": st.prompt_tokens,
            # TTFT = the small model's read + translation + the large model's first token
            "large_first_token_s": max(st.ttft_s - read_s - translate_s, 0.0),
            "ttft_s": st.ttft_s,
            "generation_tokens": st.generation_tokens,
            "generation_tps": st.generation_tps,
            "peak_memory_gb": st.peak_memory_gb,
        },
    }
    click.echo(json.dumps(out, indent=1))
