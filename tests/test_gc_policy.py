"""The collector's policy of a serving process (proxy/gc_policy.py): `ctxgate serve` freezes
what it built before serving and keeps collecting the rest; `CTXGATE_GC=python` leaves
Python's own policy."""
from __future__ import annotations

import gc
import re
import weakref
from pathlib import Path
from typing import Iterator

import pytest

from ctxgate.proxy import gc_policy
from servers import ADMIN_KEY, METRICS_HEADERS, Gateway, launch, stop_all


def metric(gw: Gateway, name: str) -> float:
    status, text = gw.get("/metrics", METRICS_HEADERS)
    assert status == 200
    found = re.search(rf"^{re.escape(name)} (\S+)$", text, re.M)
    assert found, f"{name} not in /metrics"
    return float(found.group(1))


def serve(tmp_path: Path) -> Iterator[Gateway]:
    gw = launch("gc", tmp_path, {"model_list": [], "ctxgate": {"admin_key": ADMIN_KEY}}).wait_ready()
    try:
        yield gw
    finally:
        stop_all([gw])


def test_serve_freezes_its_start_and_keeps_collecting(tmp_path: Path) -> None:
    for gw in serve(tmp_path):
        assert metric(gw, "ctxgate_gc_frozen_objects") > 10_000  # litellm's and the tokenizers' objects
        assert metric(gw, 'python_gc_collections_total{generation="0"}') >= 0


def test_python_policy_on_request(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(gc_policy.ENV, "python")
    for gw in serve(tmp_path):
        assert metric(gw, "ctxgate_gc_frozen_objects") == 0


class Node:
    def __init__(self) -> None:
        self.other: Node | None = None


def test_cycles_made_after_the_freeze_are_still_collected(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(gc_policy.ENV, raising=False)
    try:
        assert gc_policy.settle()
        assert gc.isenabled() and gc.get_freeze_count() > 0
        a, b = Node(), Node()
        a.other, b.other = b, a
        gone = weakref.ref(a)
        del a, b
        gc.collect()
        assert gone() is None
    finally:
        gc.unfreeze()
