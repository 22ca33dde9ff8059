"""Engine-rank status dicts and the store keys the drivers read them from (see core.py)."""

from __future__ import annotations

import json
from typing import Any, Dict, Optional

__all__ = ["report_key", "make_status", "post_status"]

# ---------------------------------------------------------------------------------------------
# Status dicts and the store
# ---------------------------------------------------------------------------------------------


def report_key(prefix: str, op: str, version: int, replica: Any, pp: Any, tp: Any) -> str:
    """Store key of one engine rank's report (the driver computes the same key per rank)."""
    return f"{prefix}hooks/{op}/{int(version)}/{replica}/{pp}/{tp}"


def make_status(op: str, version: int, coord: Dict[str, Any], ok: bool = True,
                error: Optional[BaseException] = None, **extra: Any) -> Dict[str, Any]:
    st: Dict[str, Any] = {"op": op, "version": int(version), "ok": bool(ok) and error is None}
    st.update({k: coord.get(k) for k in ("replica", "tp_rank", "pp_rank", "rank")})
    if error is not None:
        st["error"] = f"{type(error).__name__}: {error}"
        st["code"] = getattr(error, "code", type(error).__name__)
    else:
        st["error"], st["code"] = None, None
    st.update(extra)
    return st


def _jsonable(v: Any) -> Any:
    try:
        json.dumps(v)
        return v
    except (TypeError, ValueError):
        if isinstance(v, dict):
            return {str(k): _jsonable(x) for k, x in v.items()}
        if isinstance(v, (list, tuple)):
            return [_jsonable(x) for x in v]
        return repr(v)


def post_status(config: Optional[Dict[str, Any]], status: Dict[str, Any]) -> Optional[str]:
    """Posts `status` to the store named by `config`; returns an error string instead of raising
    (the driver then times out on this rank's key and names it)."""
    if not config or not config.get("store"):
        return "no store in the config"
    try:
        from ..store import StoreClient

        prefix = config.get("prefix", "ss/")
        key = report_key(prefix, status["op"], status.get("version") or 0, status.get("replica"),
                         status.get("pp_rank"), status.get("tp_rank"))
        c = StoreClient(config["store"], config.get("token", ""),
                        timeout=float(config.get("store_timeout", 30.0)))
        c.set(key, json.dumps(_jsonable(status)))
        return None
    except BaseException as e:  # noqa: BLE001 - never raise into the engine
        if isinstance(e, (KeyboardInterrupt, SystemExit)):
            raise
        return f"{type(e).__name__}: {e}"
