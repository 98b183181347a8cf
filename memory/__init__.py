"""Long-term memory: built by issue 5."""
