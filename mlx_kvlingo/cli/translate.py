"""`kvlingo translate`: a source prompt cache file in, a target prompt cache file out."""

from __future__ import annotations

import json
from pathlib import Path

from mlx_kvlingo._platform.atomic import atomic_write
from mlx_kvlingo.cli._common import pair_options, refuse_long_prompt, resolve_pair
from mlx_kvlingo.cli._params import OutputFile

import click


@click.command("translate", context_settings={"show_default": True})
@pair_options
@click.option("--prompt-cache-file", "cache_in", type=click.Path(exists=True, dir_okay=False),
              help="Source cache written by `mlx_lm.cache_prompt`")  # fmt: skip
@click.option("--prompt", help="Or: a prompt the source prefills now (instead of a cache file)")
@click.option("-o", "--output", required=True, type=OutputFile(),
              help="Target prompt cache file for `mlx_lm.generate --prompt-cache-file`")  # fmt: skip
def translate_cmd(source, target, translator, demo_pair, cache_in, prompt, output):
    """Translate a source prompt cache into the target's, with no target prefill."""
    from mlx_kvlingo.kv.cache import new_cache
    from mlx_kvlingo.kv.capture import capture_from_cache, trace
    from mlx_kvlingo.kv.translator import append_translation

    from mlx_lm.models.cache import load_prompt_cache, save_prompt_cache

    pair, tr, _ = resolve_pair(source, target, translator, demo_pair=demo_pair)
    if (cache_in is None) == (prompt is None):
        raise click.UsageError("give exactly one of --prompt-cache-file and --prompt")
    metadata = {}
    if cache_in:
        if tr.config.key_cut == "pre_norm" and pair.source.geometry.has_k_norm:
            raise click.ClickException("this translator reads pre-k_norm keys, which a prompt cache "
                                       "file does not hold; use --prompt so the source prefills "
                                       "with recording")  # fmt: skip
        src_cache, metadata = load_prompt_cache(cache_in, return_metadata=True)
        if len(src_cache) != (layers := pair.source.geometry.layers):
            raise click.ClickException(
                f"{cache_in} has {len(src_cache)} layers; the source has {layers}"
            )
        span = capture_from_cache(pair.source, src_cache, 0, src_cache[0].offset)
    else:
        tokens = pair.tokenizer.encode(prompt)
        refuse_long_prompt(pair, len(tokens), "'--prompt'")  # before any work
        span = trace(pair.source, tokens, tr.config.key_cut)
    tgt_cache = new_cache(pair.target)
    append_translation(pair.target, tr, span, tgt_cache)
    metadata = {"tokenizer_config": json.dumps({}), **metadata, "model": pair.target.name,
                "kvlingo_translated_from": pair.source.name}  # fmt: skip
    out = Path(output if str(output).endswith(".safetensors") else f"{output}.safetensors")
    with atomic_write(out) as tmp:  # crash-safe: the previous file stays until the rename
        save_prompt_cache(str(tmp), tgt_cache, metadata)
    click.echo(f"wrote {output}: {span.length} tokens translated for {pair.target.name}")
