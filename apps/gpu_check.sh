#!/usr/bin/env bash
# The GPU check (issue 15): on a Linux machine with an NVIDIA GPU, in a fresh venv, install
# MLX's CUDA build and this package, run the exactness tests, and `kvlingo bench` on the
# Qwen3-shaped preset in float16 and bfloat16; print the tables. Budget: under 8 minutes
# (most of it the preset's one-time build and the benches). Needs nothing beyond PyPI: the
# preset's models, tokenizer and translator are generated locally.
#
#   bash apps/gpu_check.sh                 mlx[cuda13], else mlx[cuda12]
#   bash apps/gpu_check.sh --cpu-dry-run   the same steps with mlx[cpu] and the tiny preset
#
# Environment: VENV (default /tmp/kvlingo-gpu-venv, removed and remade), OUT (results folder,
# default gpu-check-results), PRESET (default the Qwen3-shaped preset; tiny for a dry run),
# LENGTHS, PYTHON (default python3), KVLINGO_CACHE (where presets are built); REUSE_VENV=1 keeps
# an existing VENV's dependencies and reinstalls only this package (for a second run).
set -euo pipefail
cd "$(dirname "$0")/.."
start=$SECONDS
mode=cuda
case "${1:-}" in
  "") ;;
  --cpu-dry-run) mode=cpu ;;
  *) echo "usage: bash apps/gpu_check.sh [--cpu-dry-run]" >&2; exit 2 ;;
esac
VENV=${VENV:-/tmp/kvlingo-gpu-venv}
OUT=${OUT:-gpu-check-results}
PY=${PYTHON:-python3}
if [[ $mode == cuda ]]; then
  PRESET=${PRESET:-"qwen3-0.6b>qwen3-30b-a3b-scaled"}; LENGTHS=${LENGTHS:-64,256,1024,4096}
  DTYPES="float16 bfloat16"
else
  # MLX's CPU gather_mm (the MoE target's experts) is float32 only: the dry run benches float32;
  # the translator's half-precision path runs in tests/test_half_precision.py either way
  PRESET=${PRESET:-tiny}; LENGTHS=${LENGTHS:-64,256}
  DTYPES="float32"
fi
last_dtype=${DTYPES##* }
step() { printf '\n== [%4ds] %s\n' $((SECONDS - start)) "$*"; }

if [[ $mode == cuda ]] && ! command -v nvidia-smi >/dev/null; then
  echo "no nvidia-smi: this needs an NVIDIA GPU and its driver (or use --cpu-dry-run)" >&2
  exit 1
fi

if [[ ${REUSE_VENV:-0} == 1 && -x "$VENV/bin/python" ]]; then
  step "reusing $VENV (REUSE_VENV=1): this package only"
  # shellcheck disable=SC1091
  source "$VENV/bin/activate"
  pip install -q --no-deps --force-reinstall .
else
  step "fresh venv in $VENV ($($PY --version))"
  rm -rf "$VENV"
  $PY -m venv "$VENV"
  # shellcheck disable=SC1091
  source "$VENV/bin/activate"
  pip install -q --upgrade pip

  if [[ $mode == cuda ]]; then
    step "MLX's CUDA build"
    if ! pip install -q "mlx[cuda13]>=0.32"; then
      echo "mlx[cuda13] did not install (driver or platform); trying mlx[cuda12]"
      pip install -q "mlx[cuda12]>=0.32"
    fi
  else
    step "MLX's CPU build (dry run)"
    pip install -q "mlx[cpu]>=0.32"
  fi

  step "the package (--no-deps: its Linux dependency is mlx[cpu]) and its other dependencies"
  deps=$(python - <<'PYEOF'
import re
from pathlib import Path

text = Path("pyproject.toml").read_text()
block = re.search(r"^dependencies = \[(.*?)^\]", text, re.S | re.M).group(1)
print(" ".join(d for d in re.findall(r'"([^"]+)"', block) if not re.match(r"mlx(\[|[<>=;]|$)", d)))
PYEOF
  )
  # shellcheck disable=SC2086
  pip install -q $deps pytest
  pip install -q --no-deps .
  if [[ $mode == cuda ]] && pip show -q mlx-cpu 2>/dev/null; then
    echo "mlx-cpu got installed next to the CUDA build; something pulled mlx[cpu]" >&2
    exit 1
  fi
fi
pip list 2>/dev/null | grep -iE "^(mlx|mlx-cuda-1[23]|mlx-cpu|mlx-lm|mlx-kvlingo) " || true

step "backend"
python - "$mode" <<'PYEOF'
import sys

import mlx.core as mx

mode = sys.argv[1]
print("default device:", mx.default_device(), "| cuda available:", mx.cuda.is_available())
if mode == "cuda" and not (mx.cuda.is_available() and mx.default_device().type == mx.gpu):
    sys.exit("MLX does not run on the GPU here: check the driver and the mlx-cuda wheel")
if hasattr(mx, "device_info"):
    info = mx.device_info()
    print({k: info[k] for k in list(info)[:6]})
PYEOF
[[ $mode == cuda ]] && nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader

step "exactness tests (known answer token for token, the maps' formula, float16 files)"
# from a copy of tests/ outside the checkout, so the installed package is what is tested
tests=$(mktemp -d)
cp -r tests "$tests/"
(cd "$tests" && python -m pytest -q -p no:cacheprovider tests/test_known_answer.py \
  tests/test_half_precision.py \
  "tests/test_translator.py::test_map_features_match_the_formula_per_layer" \
  "tests/test_translator.py::test_span_translation_is_tokenwise_and_positioned" \
  -k "not float64")
rm -rf "$tests"

for dtype in $DTYPES; do
  step "kvlingo bench --preset $PRESET --dtype $dtype (the first run builds the preset)"
  kvlingo bench --preset "$PRESET" --dtype "$dtype" --lengths "$LENGTHS" -n 3 --warmup 1 \
    --max-minutes 2 --no-progress -o "$OUT/$dtype" >/dev/null
done
step "kvlingo bench --conversation (cascade: escalation TTFT, small decode), $last_dtype"
kvlingo bench --preset "$PRESET" --dtype "$last_dtype" --conversation --turns 6 --user-lengths 64,256 \
  --answer-tokens 32 --escalation-rate 0.5 -o "$OUT/conversation" >/dev/null

for dtype in $DTYPES; do
  printf '\n\n######## %s ########\n\n' "$dtype"
  cat "$OUT/$dtype/bench.md"
done
printf '\n\n######## conversation (%s) ########\n\n' "$last_dtype"
cat "$OUT/conversation/conversation.md"
step "done in $((SECONDS - start)) s (budget 480 s); results in $OUT/"
(( SECONDS - start <= 480 )) || echo "over the 8-minute budget: see the step times above"
