"""Long-term memory (docs/memory.md): four categories with their own lifecycles,
stores behind one interface, a loader that injects what is relevant, capture from the
traffic, and auto-dream consolidation. Nothing here imports `proxy`."""
