"""Run every benchmark, one after the other, each in its own process; each writes its own
section of bench/RESULTS.md. `make bench` calls this.

    .venv/bin/python bench/run_all.py [overhead levels recoverability recoverability-doors dialects
                                       compaction_frontier large_prompt prefix_stability memory wal cluster
                                       shared_counts]
"""
from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

BENCH = Path(__file__).resolve().parent
ROOT = BENCH.parent
SCRIPTS = {name: [name] for name in ("overhead", "levels", "recoverability", "dialects", "compaction_frontier",
                                     "large_prompt", "prefix_stability", "memory", "wal", "cluster", "shared_counts")}
SCRIPTS["recoverability-doors"] = ["recoverability", "--doors"]
"""Each benchmark's script (bench/<name>.py) and its arguments."""


def main() -> int:
    chosen = sys.argv[1:] or list(SCRIPTS)
    unknown = [s for s in chosen if s not in SCRIPTS]
    if unknown:
        print(f"unknown benchmark(s): {', '.join(unknown)} (have {', '.join(SCRIPTS)})", file=sys.stderr)
        return 2
    env = {**os.environ, "LITELLM_LOCAL_MODEL_COST_MAP": "True"}
    failed = []
    for name in chosen:
        started = time.monotonic()
        script, *args = SCRIPTS[name]
        print(f"=== {name}: bench/{script}.py {' '.join(args)}", flush=True)
        rc = subprocess.call([sys.executable, str(BENCH / f"{script}.py"), *args], cwd=ROOT, env=env)
        print(f"=== {name}: {'ok' if rc == 0 else f'exit {rc}'} in {time.monotonic() - started:.0f}s", flush=True)
        if rc != 0:
            failed.append(name)
    print(f"results: {(BENCH / 'RESULTS.md').relative_to(ROOT)}" + (f"; failed: {', '.join(failed)}" if failed else ""))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
