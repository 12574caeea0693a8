"""The conversation: `Session` (session.py, its catching up in catchup.py) over a `Transcript`;
who reads a turn (reader.py), the public stream (stream.py), files and warm-up beside it."""
