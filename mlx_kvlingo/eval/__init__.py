"""The measuring side: quality (`evaluate`, `content`) and latency (`bench`, `presets`). It
scores with `kv.scoring` and never imports `calibrate/`: what it measures, the caller fits."""
