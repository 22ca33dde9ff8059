"""pip's build of shardsync: setuptools drives the project's CMake build (pyproject.toml).

`pip install .` (or `pip install --no-build-isolation .` offline, with Debian's python3-setuptools
and python3-wheel) configures CMake with SHARDSYNC_REQUIRE_PYTHON=ON, builds the native module
`shardsync._C` and the `shardsync` CLI, and puts both into the wheel beside the pure-Python package
(python/shardsync). The CLI lands as `shardsync/bin/shardsync`; the `shardsync` console script
(shardsync/_cli.py) execs it.

Environment:
  SHARDSYNC_BUILD_DIR   an existing, configured CMake build dir to build in and take the
                        artifacts from (CI builds once, then installs from it); else a private
                        one under build-pip/, kept between pip runs.
  SHARDSYNC_CMAKE_ARGS  extra configure arguments, e.g. "-DSHARDSYNC_CUDA=OFF".
  SHARDSYNC_BUILD_JOBS  parallel build jobs (default: the CPU count).

Written by hand because no build backend that drives CMake (scikit-build-core, py-build-cmake) is
packaged by Debian 12; this is the pattern of pybind11's own cmake_example.
"""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

ROOT = Path(__file__).resolve().parent


class CMakeExtension(Extension):
    """The native module; its sources are built by CMake, not by setuptools."""

    def __init__(self, name: str) -> None:
        super().__init__(name, sources=[])


def _cache_value(build_dir: Path, key: str) -> str:
    """A CMakeCache.txt entry ("" when absent)."""
    try:
        for line in (build_dir / "CMakeCache.txt").read_text(errors="replace").splitlines():
            if line.startswith(key + ":"):
                return line.split("=", 1)[1]
    except OSError:
        pass
    return ""


class CMakeBuild(build_ext):
    """Builds `shardsync_python` and `shardsync_cli` with CMake and copies them into the package."""

    def build_extension(self, ext: Extension) -> None:
        ext_path = Path(self.get_ext_fullpath(ext.name)).resolve()
        suffix = sysconfig.get_config_var("EXT_SUFFIX") or ".so"
        build_dir, reused = self._build_dir()
        if not reused:
            self._configure(build_dir)
        jobs = os.environ.get("SHARDSYNC_BUILD_JOBS") or str(os.cpu_count() or 1)
        self._run(["cmake", "--build", str(build_dir), "--target", "shardsync_python",
                   "shardsync_cli", "-j", jobs])
        module = build_dir / "python" / "shardsync" / ("_C" + suffix)
        cli = build_dir / "shardsync"
        if not module.is_file():
            py = _cache_value(build_dir, "Python3_EXECUTABLE") or "?"
            sys.exit(f"shardsync: {build_dir} built no {module.name} for this Python "
                     f"({sys.executable}, {suffix}); that build dir was configured for {py}. "
                     "Point SHARDSYNC_BUILD_DIR at a build of this interpreter, or unset it.")
        if not cli.is_file():
            sys.exit(f"shardsync: {build_dir} built no shardsync CLI at {cli}")
        ext_path.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(module, ext_path)
        os.chmod(ext_path, 0o755)
        bin_dir = ext_path.parent / "bin"
        bin_dir.mkdir(exist_ok=True)
        shutil.copyfile(cli, bin_dir / "shardsync")
        os.chmod(bin_dir / "shardsync", 0o755)
        # The package's pure-Python files come from build_py; the stubs ride along with them.

    def _build_dir(self) -> "tuple[Path, bool]":
        given = os.environ.get("SHARDSYNC_BUILD_DIR")
        if given:
            d = Path(given).expanduser().resolve()
            if not (d / "CMakeCache.txt").is_file():
                sys.exit(f"shardsync: SHARDSYNC_BUILD_DIR={given}: no CMakeCache.txt there; "
                         "configure it first (cmake -S . -B DIR) or unset the variable")
            if _cache_value(d, "SHARDSYNC_BUILD_PYTHON").upper() in ("OFF", "0", "FALSE"):
                sys.exit(f"shardsync: SHARDSYNC_BUILD_DIR={given} was configured with "
                         "SHARDSYNC_BUILD_PYTHON=OFF")
            print(f"shardsync: building in the existing CMake build dir {d}", flush=True)
            return d, True
        return Path(self.build_temp).resolve() / "cmake", False

    def _configure(self, build_dir: Path) -> None:
        build_dir.mkdir(parents=True, exist_ok=True)
        # A fresh cache every time, so SHARDSYNC_CMAKE_ARGS of an earlier run never lingers; the
        # object files stay, so an unchanged tree rebuilds nothing.
        (build_dir / "CMakeCache.txt").unlink(missing_ok=True)
        args = [
            "cmake", "-S", str(ROOT), "-B", str(build_dir),
            "-DCMAKE_BUILD_TYPE=Release",
            "-DSHARDSYNC_BUILD_TESTS=OFF",
            "-DSHARDSYNC_BUILD_BENCH=OFF",
            "-DSHARDSYNC_BUILD_PYTHON=ON",
            # A wheel without _C would import and then fail at the first Plan: fail here instead.
            "-DSHARDSYNC_REQUIRE_PYTHON=ON",
            f"-DPython3_EXECUTABLE={sys.executable}",
        ]
        args += shlex.split(os.environ.get("SHARDSYNC_CMAKE_ARGS", ""))
        print(f"shardsync: configuring {build_dir}", flush=True)
        self._run(args)

    @staticmethod
    def _run(cmd: "list[str]") -> None:
        print("shardsync: " + " ".join(shlex.quote(c) for c in cmd), flush=True)
        try:
            subprocess.run(cmd, check=True)
        except FileNotFoundError:
            sys.exit(f"shardsync: {cmd[0]} not found; scripts/install-deps.sh installs the build "
                     "tools (Debian: cmake, build-essential)")
        except subprocess.CalledProcessError as e:
            sys.exit(f"shardsync: {cmd[0]} failed (exit {e.returncode}); its output is above")


def _bdist_wheel():
    """The wheel writer: setuptools' own (>= 70.1), else the `wheel` package's, which the build
    backend (python/build_backend/shardsync_build.py) may have loaded from Debian's python3-wheel
    for an interpreter that has none; registered here since such a copy has no entry point."""
    try:
        from setuptools.command.bdist_wheel import bdist_wheel  # type: ignore[import-not-found]
    except ImportError:
        try:
            from wheel.bdist_wheel import bdist_wheel  # type: ignore[import-not-found,no-redef]
        except ImportError:
            return {}
    return {"bdist_wheel": bdist_wheel}


setup(
    ext_modules=[CMakeExtension("shardsync._C")],
    cmdclass={"build_ext": CMakeBuild, **_bdist_wheel()},
    # setuptools' scratch space beside (not inside) the CMake build dir build/.
    options={"build": {"build_base": "build-pip"}},
)
