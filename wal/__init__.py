"""The session write-ahead log (docs/wal.md).

An append-only log per session, each line one event with an increasing `seq` and a CRC32
of its own bytes, so damage is detected rather than guessed: a JSONL file (`file_log.py`)
or a Redis stream (`redis_log.py`), behind one interface (`backend.py`). CHECKPOINT lines
carry a full snapshot of the session state, so recovery is "latest intact checkpoint, then
the events after it". This package knows logs and events only; what a snapshot means is
the proxy's business (`proxy/engine/journal.py`).
"""
