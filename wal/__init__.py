"""The session write-ahead log (docs/wal.md).

One append-only JSONL file per session, each line one event with an increasing `seq`
and a CRC32 of its own bytes, so damage is detected rather than guessed. CHECKPOINT
lines carry a full snapshot of the session state, so recovery is "latest intact
checkpoint, then the events after it". This package knows files and events only; what a
snapshot means is the proxy's business (`proxy/engine/journal.py`).
"""
