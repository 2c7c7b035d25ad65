"""Tools benchmark: runs benchmarks/tools/tools_python.py (sandbox cold vs warm pool, 64 concurrent calls, hostile
programs) and benchmarks/tools/search_cache.py (lookups and writes per second at 10^5 entries vs the reference's
rewrite-the-JSON cache), shows their tables, and prints one combined final JSON line.

    python benchmarks/tools/tools.py
"""

import json
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).parent


def _run(script: str) -> dict:
    proc = subprocess.run([sys.executable, str(HERE / script)], capture_output=True, text=True, check=True)
    print(proc.stdout.rstrip())
    return json.loads(proc.stdout.strip().splitlines()[-1])


if __name__ == "__main__":
    python = _run("tools_python.py")
    cache = _run("search_cache.py")
    print(json.dumps({"benchmark": "tools", "python": python, "search_cache": cache}))
