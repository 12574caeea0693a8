"""`kvlingo generate`: the source reads the prompt, the target answers from the translated cache."""

from __future__ import annotations

import click
from mlx_lm.sample_utils import make_sampler

from ..decode import PromptTooLongError, handoff
from ._common import resolve_pair, source_option, target_option, translator_option


@click.command("generate")
@source_option
@target_option
@translator_option
@click.option("-p", "--prompt", default="What is the capital of France?", show_default=True)
@click.option("--chat/--no-chat", default=True, help="Apply the chat template to the prompt")
@click.option("-m", "--max-tokens", default=100, show_default=True)
@click.option("--temp", default=0.0, show_default=True)
@click.option("--top-p", default=1.0, show_default=True)
@click.option("--seed", type=int, default=None)
def generate_cmd(source, target, translator, prompt, chat, max_tokens, temp, top_p, seed):
    """One answer from the target with no target prefill, with honest timings."""
    import mlx.core as mx
    from mlx_lm import stream_generate

    pair, tr = resolve_pair(source, target, translator)
    if chat and getattr(pair.tokenizer, "chat_template", None):
        tokens = pair.tokenizer.apply_chat_template(
            [{"role": "user", "content": prompt}], add_generation_prompt=True
        )
    else:
        tokens = pair.tokenizer.encode(prompt)
    if seed is not None:
        mx.random.seed(seed)
    try:
        h = handoff(pair, tr, tokens)
    except PromptTooLongError as e:
        raise click.ClickException(str(e)) from None
    last = None
    for r in stream_generate(
        pair.target.model, pair.tokenizer, mx.array(tokens[-1:]), max_tokens=max_tokens,
        prompt_cache=h.target_cache, sampler=make_sampler(temp=temp, top_p=top_p),
    ):  # fmt: skip
        click.echo(r.text, nl=False)
        last = r
    click.echo()
    click.echo(
        f"source prefill {len(tokens) - 1} tokens {h.source_prefill_s * 1e3:.1f} ms · "
        f"translation {h.translate_s * 1e3:.1f} ms · target decode {last.generation_tokens} tokens "
        f"{last.generation_tps:.1f} tok/s · peak {last.peak_memory:.2f} GB",
        err=True,
    )
