#!/usr/bin/env python
"""Runs ``decisiond bench`` with the defaults of issue 5 and writes benchmarks/RESULTS.md (and RESULTS.json).

    .venv/bin/python benchmarks/bench.py            # 200 tickets, 3 and 10 questions, 1/4/16 HTTP clients
    .venv/bin/python benchmarks/bench.py --tickets 30 --long-documents 6   # the recorded run: adds ~2K-token
                                                    # documents (5 questions) and documents asked again

Extra arguments go to ``decisiond bench`` (e.g. ``--tickets 50``). Run it on a quiet machine: every row of the
report comes from the same run, so only the ratios between rows are meant to carry over.
"""

import sys
from pathlib import Path

from decisiond.cli import main

HERE = Path(__file__).resolve().parent

if __name__ == "__main__":
    args = sys.argv[1:]
    command = "python benchmarks/bench.py" + ("" if not args else " " + " ".join(args))
    sys.exit(main(["bench", "--out", str(HERE / "RESULTS.md"), "--json", str(HERE / "RESULTS.json"),
                   "--command-line", command, *args]))
