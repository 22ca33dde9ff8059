"""PEP 517 build backend of shardsync: setuptools.build_meta (pyproject.toml, setup.py), able to
write the wheel on interpreters that lack the `wheel` package.

setuptools before 70.1 (Debian 12 has 66; a pyenv or a venv Python may carry 65) writes wheels
through the `wheel` package's bdist_wheel. Debian installs it for its own python3 (python3-wheel),
but another CPython 3 on the same machine (pyenv, a venv made from it) has none, and offline pip
cannot fetch it. The package is pure Python and serves any CPython 3, so when `import wheel` fails
this loads Debian's copy (only that package, not the rest of dist-packages); setup.py then
registers its bdist_wheel command. Where `wheel` is importable nothing changes.
"""

from __future__ import annotations

import importlib.util
import os
import sys

_DEBIAN_WHEEL_DIRS = ("/usr/lib/python3/dist-packages",)


def _ensure_wheel() -> None:
    try:
        import wheel  # noqa: F401

        return
    except ImportError:
        pass
    for d in _DEBIAN_WHEEL_DIRS:
        pkg = os.path.join(d, "wheel")
        init = os.path.join(pkg, "__init__.py")
        if not os.path.isfile(init):
            continue
        spec = importlib.util.spec_from_file_location("wheel", init,
                                                      submodule_search_locations=[pkg])
        if spec is None or spec.loader is None:
            continue
        module = importlib.util.module_from_spec(spec)
        sys.modules["wheel"] = module
        try:
            spec.loader.exec_module(module)
        except Exception:  # noqa: BLE001 - an unusable copy: setuptools then says what is missing
            del sys.modules["wheel"]
            continue
        return


_ensure_wheel()

from setuptools.build_meta import *  # noqa: E402,F401,F403
from setuptools.build_meta import __all__  # noqa: E402,F401
