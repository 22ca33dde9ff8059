"""Rendezvous store: a token-authenticated TCP key-value store (store.h). Timeouts in seconds."""

from __future__ import annotations

from typing import Any, List

from ._native import native

__all__ = ["StoreServer", "StoreClient"]


class StoreServer:
    """Serves the store in this process (rank 0, or a driver) until stop() or `with` exit."""

    def __init__(self, host: str = "127.0.0.1", port: int = 0, token: str = "") -> None:
        self._s = native("store").StoreServer.start(host, port, token)

    @property
    def port(self) -> int:
        return self._s.port

    @property
    def address(self) -> str:
        """"host:port", what every rank passes as `store`."""
        return self._s.address

    def stop(self) -> None:
        self._s.stop()

    def __enter__(self) -> "StoreServer":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop()


class StoreClient:
    """One client per thread. PermissionDeniedError when the server refuses the token."""

    def __init__(self, address: str, token: str = "", timeout: float = 30.0) -> None:
        self._c = native("store").StoreClient.connect(address, token, timeout)

    def set(self, key: str, value: "bytes | str") -> None:
        self._c.set(key, value.encode() if isinstance(value, str) else value)

    def get(self, key: str, timeout: float = 30.0) -> bytes:
        return self._c.get(key, timeout)

    def add(self, key: str, delta: int = 1) -> int:
        return self._c.add(key, delta)

    def wait(self, keys: List[str], timeout: float = 30.0) -> None:
        self._c.wait(list(keys), timeout)

    def barrier(self, name: str, world: int, timeout: float = 30.0) -> None:
        self._c.barrier(name, world, timeout)
