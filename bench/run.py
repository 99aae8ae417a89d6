#!/usr/bin/env python3
"""
``make bench``: run every ``bench/bench_*.py`` one after another, each in its
own process with this interpreter, and print a summary.

* ``BENCH_ONLY=sync,audit`` runs a subset (names without ``bench_``/``.py``);
* ``BENCH_ARGS_SYNC="--keys 2000 --files 1000"`` passes arguments to one
  benchmark (``BENCH_ARGS_<NAME>``, upper case); arguments given to this
  script go to every benchmark.

Exits non-zero when a benchmark crashed, never on timing: the benchmarks print
ratios against their goals, they do not assert on them.  Results go to
bench/results/ (gitignored).
"""

import os
import pathlib
import shlex
import subprocess
import sys
import time

HERE = pathlib.Path(__file__).resolve().parent


def main(argv):
    only = {s.strip() for s in os.environ.get("BENCH_ONLY", "").split(",") if s.strip()}
    scripts = sorted(HERE.glob("bench_*.py"))
    if only:
        scripts = [s for s in scripts if s.stem.removeprefix("bench_") in only]
    if not scripts:
        print("no bench/bench_*.py to run")
        return 0
    summary = []
    for script in scripts:
        name = script.stem.removeprefix("bench_")
        args = shlex.split(os.environ.get(f"BENCH_ARGS_{name.upper()}", "")) + list(argv)
        print(f"\n===== {script.name} {' '.join(args)} =====", flush=True)
        start = time.time()
        try:
            code = subprocess.run([sys.executable, str(script), *args], cwd=HERE.parent,
                                  check=False).returncode
        except KeyboardInterrupt:
            code = 130
        summary.append((script.name, code, time.time() - start))
        if code == 130:
            break
    print("\n===== bench summary =====")
    for name, code, secs in summary:
        state = "ok" if code == 0 else f"FAILED (exit {code})"
        print(f"  {name:<24} {state:<18} {secs:7.0f}s")
    print("results: bench/results/")
    return 1 if any(code for _, code, _ in summary) else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
