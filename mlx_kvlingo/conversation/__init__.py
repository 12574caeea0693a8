"""The conversation: `Session` (session.py: the transcript, catching up, session files), who
reads a turn (reader.py, its rates measured by warmup.py), what the stream yields (stream.py)."""
