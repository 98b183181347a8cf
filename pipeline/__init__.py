"""Tokens, the four compression strategies, and the planner that decides what a compaction
point does (`planner.py`): pure functions over message lists and plain data.

Nothing here imports `ctxgate.proxy`; the only I/O is the Autocompact LLM call, which the
caller passes in as a callable.
"""
