"""Rendezvous store: a token-authenticated TCP key-value store (store.h). Timeouts in seconds.

One process serves it (`StoreServer`, or `shardsync store --bind ADDR:PORT`); every rank of a job
names it ("host:port") and shares its token. Sessions use it to exchange plan hashes, transport
addresses and per-sync verdicts; `StoreClient` is there for launchers and tests.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, List

from ._native import native

if TYPE_CHECKING:
    from . import _C

__all__ = ["StoreServer", "StoreClient", "new_launch"]


def new_launch() -> "dict[str, str]":
    """A fresh launch identity, {"job_id": ..., "job_secret": ...}, for ranks that no launcher
    started (`multiprocessing`, a hand-rolled spawn): make it once in the parent and pass it to
    every rank's `Session(..., **launch)`. A job of several ranks whose ranks have no launch
    identity refuses to connect (two such jobs on one store and prefix could not be told apart);
    the secret is what keeps any other process, even one that knows the id, out of the job's
    slots (docs/security.md "Job identity"). Keep it out of logs and command lines."""
    C = native("store")
    return {"job_id": "launch-" + C.generate_job_secret()[:16],
            "job_secret": C.generate_job_secret()}


class StoreServer:
    """Serves the store in this process (rank 0, or a driver) until stop() or `with` exit.

    token: at least 16 characters; "" generates a random one (read it back as `.token` and hand
    it to the ranks as SHARDSYNC_TOKEN)."""

    def __init__(self, host: str = "127.0.0.1", port: int = 0, token: str = "") -> None:
        C = native("store")
        self.token = token or C.generate_store_token()
        self._s: "_C.StoreServer" = C.StoreServer.start(host, port, self.token)

    @property
    def port(self) -> int:
        """The bound TCP port."""
        return self._s.port

    @property
    def address(self) -> str:
        """"host:port", what every rank passes as `store` (or SHARDSYNC_STORE)."""
        return self._s.address

    def stop(self) -> None:
        """Stops serving; connected clients see their next call fail (idempotent)."""
        self._s.stop()

    def __enter__(self) -> "StoreServer":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop()


class StoreClient:
    """A connection to the store, for one thread at a time. PermissionDeniedError when the
    server refuses the token; DeadlineExceededError when a wait runs out."""

    def __init__(self, address: str, token: str = "", timeout: float = 30.0) -> None:
        self._c: "_C.StoreClient" = native("store").StoreClient.connect(address, token, timeout)

    def set(self, key: str, value: "bytes | str") -> None:
        """Sets `key` (str values are stored UTF-8 encoded)."""
        self._c.set(key, value.encode() if isinstance(value, str) else value)

    def get(self, key: str, timeout: float = 30.0) -> bytes:
        """The value of `key`, waiting up to `timeout` seconds for it to be set."""
        return self._c.get(key, timeout)

    def add(self, key: str, delta: int = 1) -> int:
        """Atomically adds `delta` to the integer at `key` (0 if unset) and returns the sum."""
        return self._c.add(key, delta)

    def wait(self, keys: List[str], timeout: float = 30.0) -> None:
        """Returns once every key is set; DeadlineExceededError after `timeout` seconds."""
        self._c.wait(list(keys), timeout)

    def barrier(self, name: str, world: int, timeout: float = 30.0) -> None:
        """Returns once `world` clients entered barrier `name`."""
        self._c.barrier(name, world, timeout)

    def delete_prefix(self, prefix: str) -> int:
        """Deletes every key starting with `prefix`; returns how many went."""
        return self._c.delete_prefix(prefix)

    def set_ephemeral(self, key: str, value: "bytes | str") -> None:
        """Sets `key` bound to this client's connection: when it closes, the key dies, and every
        get / wait naming it fails at once with UnavailableError (store.h)."""
        self._c.set_ephemeral(key, value.encode() if isinstance(value, str) else value)

    def set_if_absent(self, key: str, value: "bytes | str", ephemeral: bool = False) -> bytes:
        """Sets `key` unless it exists; returns the value it holds afterwards."""
        return self._c.set_if_absent(key, value.encode() if isinstance(value, str) else value,
                                     ephemeral)

    def mark_dead(self, key: str, reason: str) -> None:
        """Removes `key` and records it dead with `reason` (waiters on it fail at once)."""
        self._c.mark_dead(key, reason)
