#!/usr/bin/env python3
"""The size rule (issue 34): no source file under src/ longer than --max lines (600): a file that
outgrows it is split by responsibility, as device_rank.cc was (ctest `file_size_rule`).
`--self-test` checks that the rule can fail: one line under the largest file's length must name it.
Exit 1 with one line per file over the limit."""
import argparse
import os
import sys

SOURCES = (".h", ".cc", ".cu", ".cuh")


def sizes(root):
    out = {}
    for d, _, files in os.walk(os.path.join(root, "src")):
        for f in files:
            if f.endswith(SOURCES):
                p = os.path.join(d, f)
                with open(p, "rb") as fh:
                    out[os.path.relpath(p, root)] = fh.read().count(b"\n")
    return out


def over(found, limit):
    return sorted(f"{p}: {n} lines (the limit is {limit})" for p, n in found.items() if n > limit)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--root", required=True)
    ap.add_argument("--max", type=int, default=600)
    ap.add_argument("--self-test", action="store_true")
    a = ap.parse_args()
    found = sizes(a.root)
    if len(found) < 100:
        print(f"file size rule: only {len(found)} source files under {a.root}/src: wrong root?")
        return 1
    if a.self_test:
        largest = max(found, key=found.get)
        bad = over(found, found[largest] - 1)
        if not any(line.startswith(largest + ":") for line in bad):
            print(f"file size rule self-test: a limit under {largest}'s {found[largest]} lines "
                  "did not name it")
            return 1
        print(f"file size rule self-test: ok ({largest}, {found[largest]} lines, is caught)")
        return 0
    bad = over(found, a.max)
    for line in bad:
        print(line)
    if not bad:
        print(f"file size rule: ok ({len(found)} files, the largest {max(found.values())} lines)")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
