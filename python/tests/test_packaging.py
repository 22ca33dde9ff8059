"""Packaging: the pip build refuses to make a wheel without `_C`, and an installed package carries
its CLI. The configure check runs CMake on the source tree (under 2 s with CUDA off)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import shardsync

SOURCE = Path(os.environ.get("SHARDSYNC_SOURCE_DIR") or Path(__file__).resolve().parents[2])


def test_configure_without_pybind11_fails_naming_it(tmp_path):
    if shutil.which("cmake") is None or not (SOURCE / "CMakeLists.txt").is_file():
        pytest.skip("needs cmake and the source tree")
    # What setup.py passes, with pybind11 hidden from find_package.
    r = subprocess.run(
        ["cmake", "-S", str(SOURCE), "-B", str(tmp_path / "b"), "-DSHARDSYNC_REQUIRE_PYTHON=ON",
         "-DCMAKE_DISABLE_FIND_PACKAGE_pybind11=ON", "-DSHARDSYNC_CUDA=OFF",
         "-DSHARDSYNC_BUILD_TESTS=OFF", "-DSHARDSYNC_BUILD_BENCH=OFF",
         f"-DPython3_EXECUTABLE={sys.executable}"],
        capture_output=True, text=True, timeout=120)
    out = r.stdout + r.stderr
    assert r.returncode != 0, out
    assert "shardsync._C cannot be built" in out and "pybind11" in out, out


def test_installed_package_carries_the_cli():
    from shardsync import _cli

    exe = _cli.cli_path()
    if not exe.is_file():
        pytest.skip("not a pip-installed package (a CMake build tree has no shardsync/bin)")
    r = subprocess.run([sys.executable, "-c", "from shardsync._cli import main; main()", "version"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == f"shardsync {shardsync.__version__}"
    bad = subprocess.run([sys.executable, "-c", "from shardsync._cli import main; main()", "plan",
                          "--model", "qwen2.5-0.5b", "--trainer", "fsdp=0", "--rollout", "dp=1"],
                         capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and bad.stdout == "" and "trainer" in bad.stderr


_HIDE_WHEEL = r"""
import importlib.abc, sys
class Hide(importlib.abc.MetaPathFinder):  # an interpreter without the `wheel` package
    def find_spec(self, name, path=None, target=None):
        if name == "wheel" and "wheel" not in sys.modules:
            raise ImportError("no wheel here")
        return None
sys.meta_path.insert(0, Hide())
sys.path.insert(0, sys.argv[1])
import shardsync_build
from wheel.bdist_wheel import bdist_wheel
print(sys.modules["wheel"].__file__)
print(callable(shardsync_build.build_wheel))
"""


def test_build_backend_writes_wheels_without_a_wheel_package():
    """A Python without `wheel` (pyenv's, a venv of it; setuptools < 70.1 needs it) still builds:
    the backend loads Debian's python3-wheel, and setup.py registers its bdist_wheel."""
    backend = SOURCE / "python" / "build_backend"
    if not (backend / "shardsync_build.py").is_file():
        pytest.skip("needs the source tree")
    if not Path("/usr/lib/python3/dist-packages/wheel/bdist_wheel.py").is_file():
        pytest.skip("Debian's python3-wheel is not installed")
    pytest.importorskip("setuptools")
    r = subprocess.run([sys.executable, "-c", _HIDE_WHEEL, str(backend)], capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr
    where, callable_ = r.stdout.split()
    assert where.startswith("/usr/lib/python3/dist-packages/wheel/"), where
    assert callable_ == "True"
