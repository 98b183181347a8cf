"""`ctxgate replay`: recorded agent sessions through the real pipeline, offline, with a report."""
