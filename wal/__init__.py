"""The session write-ahead log: built by issue 4."""
