"""Readers of the protocols agents speak, one per dialect, behind one interface.

Structural protocols (OpenAI `tool_calls` + `tool` messages, Anthropic `tool_use` /
`tool_result` content blocks) are read wherever they appear. Text protocols put the
action in assistant text and the observation in the user turn after it; which one a
session speaks is detected from its messages (`detect_dialect`) and then remembered.
"""
from __future__ import annotations

from .base import TextReader
from .detect import PLAIN, STRUCTURAL_DIALECTS, TEXT_READERS, detect_dialect, text_reader

__all__ = ["PLAIN", "STRUCTURAL_DIALECTS", "TEXT_READERS", "TextReader", "detect_dialect", "text_reader"]
