"""The `shardsync` console script: execs the C++ CLI that pip installed inside the package.

The CLI is a native executable (tools/cli), not Python; this entry point only finds it, so the
process, its exit code (0 ok, 1 failed, 2 bad input) and its signals are the binary's own.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

__all__ = ["cli_path", "main"]


def cli_path() -> Path:
    """Path of the installed `shardsync` executable (shardsync/bin/shardsync)."""
    return Path(__file__).resolve().parent / "bin" / "shardsync"


def main() -> None:
    """Replaces this process with the C++ CLI, passing the arguments through."""
    exe = cli_path()
    if not os.access(exe, os.X_OK):
        sys.stderr.write(
            f"shardsync: the CLI executable is missing at {exe}; this package was not installed "
            "by `pip install .` (from a CMake build tree, run build/shardsync)\n"
        )
        sys.exit(2)
    os.execv(str(exe), ["shardsync"] + sys.argv[1:])  # argv[0]: the name in its usage lines
