"""The conversation: `Session` (session.py) composed of a `Transcript`, two `ModelCache`s and a
`CatchUp`; records, timing, persistence and warm-up beside it."""
