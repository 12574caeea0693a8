"""The measuring side: quality (`evaluate`, `content`), latency (`bench`, `presets`) and other
hand-off methods on one harness (`methods/`, `compare`). It scores with `scoring` and never
imports `calibrate/`: what it compares, the caller fits."""
