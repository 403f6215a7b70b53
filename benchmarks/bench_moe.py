"""Forward benchmark: the `moe-ops-bench` console script (moe_ops/tools/bench.py), run from this
checkout with the same flags, e.g. `python benchmarks/bench_moe.py --tiny --plot tiny.png`."""
import os
import sys

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)   # this checkout's moe_ops, without PYTHONPATH or an install

from moe_ops.tools.bench import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
