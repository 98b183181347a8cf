"""The prices a turn's compaction is planned with (`ctxgate.pipeline.depth.prices_of`), under
the name `proxy/replay/driver.py` imports them by."""
from ctxgate.pipeline.depth import prices_of as prices_of
