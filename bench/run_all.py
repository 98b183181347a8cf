"""Run the benchmarks one after the other, each in its own process; each writes its own
section of bench/RESULTS.md. `make bench` calls this (then throughput.py and rss.py).

    .venv/bin/python bench/run_all.py [overhead dialects large_prompt prefix_stability wal cluster]
"""
from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

BENCH = Path(__file__).resolve().parent
SCRIPTS = ("overhead", "dialects", "large_prompt", "prefix_stability", "wal", "cluster")


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
        print(f"=== {name}: bench/{name}.py", flush=True)
        rc = subprocess.call([sys.executable, str(BENCH / f"{name}.py")], cwd=BENCH.parent, env=env)
        print(f"=== {name}: {'ok' if rc == 0 else f'exit {rc}'} in {time.monotonic() - started:.0f}s", flush=True)
        if rc != 0:
            failed.append(name)
    print("results: bench/RESULTS.md" + (f"; failed: {', '.join(failed)}" if failed else ""))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
