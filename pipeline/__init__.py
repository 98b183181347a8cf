"""Tokens and the four compression strategies: pure functions over message lists.

Nothing here imports `ctxgate.proxy`; the only I/O is the Autocompact LLM call, which the
caller passes in as a callable.
"""
