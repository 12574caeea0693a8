"""`kvlingo serve`: the pair behind `mlx_kvlingo.serve`'s endpoint, as `mlx_lm.server`."""

from __future__ import annotations

import ipaddress
import logging
import os
import signal
import sys

from mlx_kvlingo.cli._common import conversation_options, demo_pair_of, pair_options

import click


def _loopback(host: str) -> bool:
    try:
        return host == "localhost" or ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


@click.command("serve", context_settings={"show_default": True})
@pair_options
@click.option("--host", default="127.0.0.1",
              help="Address to bind; anything but loopback needs --api-key (or --insecure)")  # fmt: skip
@click.option("--port", default=8080, type=click.IntRange(0, 65535))
@click.option("--api-key", envvar="KVLINGO_API_KEY",
              help="Require `Authorization: Bearer KEY` (env KVLINGO_API_KEY)")  # fmt: skip
@click.option("--max-tokens", type=click.IntRange(1), default=2048,
              help="Largest max_tokens a request may ask for")  # fmt: skip
@click.option("--default-max-tokens", type=click.IntRange(1), default=512,
              help="max_tokens when a request names none")  # fmt: skip
@click.option("--max-prompt-tokens", type=click.IntRange(1), default=4096,
              help="Longest templated conversation accepted (400 beyond)")  # fmt: skip
@click.option("--max-body-bytes", type=click.IntRange(1), default=1 << 20,
              help="Largest request body (413 beyond)")  # fmt: skip
@click.option("--queue-size", type=click.IntRange(0), default=8,
              help="Requests that may wait behind the running one (503 beyond)")  # fmt: skip
@click.option("--max-conversations", type=click.IntRange(0), default=8,
              help="Conversations held for prefix reuse, least recently used dropped first")  # fmt: skip
@conversation_options
@click.option("--insecure", is_flag=True, help="Allow a non-loopback --host without --api-key")
@click.option("-v", "--verbose", is_flag=True, help="Log every request")
def serve_cmd(source, target, translator, demo_pair, backward_translator, mode, policy, insecure,
              verbose, **settings):  # fmt: skip
    """Serve the pair over the OpenAI chat-completions API (models: small, large, auto)."""
    from mlx_kvlingo.api import load
    from mlx_kvlingo.serve import Limits, ServeConfig, Server

    limits = Limits(**{k: settings.pop(k) for k in ("max_tokens", "default_max_tokens",
                                                    "max_prompt_tokens")})  # fmt: skip
    config = ServeConfig(limits=limits, **settings)  # host, port, api_key, the queue's sizes
    if not _loopback(config.host) and not config.api_key and not insecure:
        raise click.UsageError(f"--host {config.host} exposes the models beyond this machine: set "
                               "--api-key (or KVLINGO_API_KEY), or pass --insecure")  # fmt: skip
    if limits.default_max_tokens > limits.max_tokens:
        raise click.UsageError("--default-max-tokens must not exceed --max-tokens")
    logging.basicConfig(level=logging.INFO if verbose else logging.WARNING,
                        format="%(asctime)s %(levelname)s %(message)s")  # fmt: skip
    demo = demo_pair_of(source, target, demo_pair)
    click.echo("loading models...", err=True)
    pair = load(source, target, translator, backward_translator, pair=demo)
    try:
        server = Server(pair, config, mode=mode, policy=policy(pair))
    except OSError as e:
        raise click.ClickException(f"cannot listen on {config.host}:{config.port}: {e}") from None
    click.echo(f"small: {pair.names['small']}\nlarge: {pair.names['large']}", err=True)
    rates = f", {pair.rates_note}" if pair.rates_note else ""  # pipelined: no warm-up
    click.echo(f"loaded in {pair.load_s:.1f} s (warm-up {pair.warmup_s or 0:.1f} s{rates})",
               err=True)  # fmt: skip
    key = " (API key required)" if config.api_key else ""
    click.echo(f"serving on {server.url}{key} · models small, large, auto · Ctrl-C stops", err=True)
    # SIGTERM (kill, systemd, docker stop) stops as Ctrl-C does: running and waiting requests
    # are told the server is shutting down instead of losing their connection mid-answer
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    try:
        server.serve_forever()  # closes the server and its requests on the way out
    except KeyboardInterrupt:
        click.echo("stopped", err=True)
    # MLX's per-thread state of the request threads aborts in interpreter teardown: skip it
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
