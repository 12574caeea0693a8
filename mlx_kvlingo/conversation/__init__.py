"""The parts of `Session` (session.py), one concern each: records, messages, catching up,
answering, persistence."""
