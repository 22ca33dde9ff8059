"""Access to the native module, with a clear error when it (or one of its parts) is missing."""

from __future__ import annotations

from typing import Any

from .errors import UnimplementedError

try:
    from . import _C as _C  # type: ignore[attr-defined]

    NATIVE_IMPORT_ERROR: "BaseException | None" = None
except ImportError as e:  # pure-Python parts (errors, EngineGroup, hooks) work without it
    _C = None  # type: ignore[assignment]
    NATIVE_IMPORT_ERROR = e


def has_part(part: str) -> bool:
    """Whether the native module was built with `part` (layout, model, plan, store, session)."""
    return _C is not None and part in getattr(_C, "PARTS", ())


def native(part: "str | None" = None) -> Any:  # Any: the module shardsync._C (typed in _C.pyi)
    """The native module; UnimplementedError when it or `part` is not built."""
    if _C is None:
        raise UnimplementedError(
            f"shardsync native module not importable ({NATIVE_IMPORT_ERROR}); install the "
            "package with `pip install .` from the source tree (docs/python.md), or build it "
            "with `cmake --build build --target shardsync_python` and set PYTHONPATH=build/python"
        )
    if part is not None and part not in _C.PARTS:
        raise UnimplementedError(f"shardsync native module was built without the {part!r} part")
    return _C
