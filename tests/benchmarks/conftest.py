"""Tests of the scripts in benchmarks/. A script run by hand has its own folder first on `sys.path` and
imports its siblings as top-level modules (`from side_by_side import ...`); the tests do the same."""
import sys
from pathlib import Path

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"
if str(BENCHMARKS) not in sys.path:
    sys.path.insert(0, str(BENCHMARKS))
