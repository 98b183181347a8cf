"""The garbage collector's policy for a serving process.

A gateway imports litellm, the tokenizers and their tables: about 425,000 tracked containers
that live as long as the process. CPython's full (generation-2) collection walks every one of
them while the event loop waits: 0.6–0.9 s on a loaded 2-core machine, every few hundred
steady turns (bench/gc_pauses.py). Frozen once the process has started, they are never walked
again. The collector stays on, with Python's thresholds, for everything made afterwards: cycles
among requests' and caches' objects are still found and freed, and a full collection walks
only what the gateway keeps (its sessions and caches), no longer its code.

Python's thresholds are kept on purpose: a young generation of 10,000 rather than 700 made
30 times fewer young collections but no shorter longest pause (twice 600 turns with frozen
starts, by hand: young up to 9–26 ms and middle 14–91 ms, against 4–24 and 18–27 ms at 700).

`CTXGATE_GC=python` leaves the interpreter's policy whole (nothing frozen), to compare.
"""
from __future__ import annotations

import gc
import os

ENV = "CTXGATE_GC"


def settle() -> bool:
    """Collect once and freeze what survives (the process's start: imports, tables, the app);
    False when `CTXGATE_GC=python` asks for Python's own policy."""
    if os.environ.get(ENV, "").strip().lower() == "python":
        return False
    gc.collect()
    gc.freeze()
    return True
