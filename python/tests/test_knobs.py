"""Environment knobs through the registry (docs/environment.md): Python parses them as C++ does, a
malformed value raises InvalidArgumentError naming the knob and the value, never a default."""
from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

import shardsync
from shardsync._native import native

SOURCE = Path(os.environ.get("SHARDSYNC_SOURCE_DIR") or Path(__file__).resolve().parents[2])
TOKEN = "test-token-0123456789"


def test_read_knob_parses_strictly(monkeypatch):
    c = native()
    monkeypatch.delenv("SHARDSYNC_REPLICA", raising=False)
    assert c.read_knob("SHARDSYNC_REPLICA") is None
    monkeypatch.setenv("SHARDSYNC_REPLICA", "3")
    assert c.read_knob("SHARDSYNC_REPLICA") == "3"
    for bad in ("abc", "-1", "1e3"):
        monkeypatch.setenv("SHARDSYNC_REPLICA", bad)
        with pytest.raises(shardsync.InvalidArgumentError, match=re.escape(f"SHARDSYNC_REPLICA='{bad}'")):
            c.read_knob("SHARDSYNC_REPLICA")
    monkeypatch.setenv("SHARDSYNC_FP8_OVERLAP", "maybe")
    with pytest.raises(shardsync.InvalidArgumentError, match="SHARDSYNC_FP8_OVERLAP='maybe'"):
        c.check_knobs()
    with pytest.raises(shardsync.NotFoundError, match="SHARDSYNC_NOT_A_KNOB"):
        c.read_knob("SHARDSYNC_NOT_A_KNOB")


def test_every_python_read_knob_is_registered_and_documented():
    names = {k["name"] for k in native().knobs()}
    doc = (SOURCE / "docs" / "environment.md").read_text()
    for k in names:
        assert f"| `{k}` |" in doc, k
    # Variables the Python package reads from os.environ / an env mapping.
    read = set()
    for p in (SOURCE / "python" / "shardsync").rglob("*.py"):
        text = p.read_text()
        read |= set(re.findall(r"environ(?:\.get)?[\[(]\"([A-Z0-9_]+)\"", text))
        read |= set(re.findall(r"env\.get\(\"([A-Z0-9_]+)\"", text))
        read |= set(re.findall(r"read_knob\(\"([A-Z0-9_]+)\"", text))
    assert "SHARDSYNC_REPLICA" in read and "SGLANG_PP_LAYER_PARTITION" in read, read
    assert read <= names, read - names


def test_session_refuses_a_malformed_knob(need_session, tiny_model, monkeypatch):
    spec = dict(model=tiny_model, trainer="fsdp=2", rollout="dp=1,tp=2,pp=1", engine="sglang",
                wire_dtype="f32", trainer_dtype="f32", bucket_bytes=64 << 10)
    plan = shardsync.Plan.from_spec(spec)
    monkeypatch.setenv("SHARDSYNC_CHUNK_KIB", "-5")
    with shardsync.StoreServer(token=TOKEN) as srv:
        with pytest.raises(shardsync.InvalidArgumentError, match="SHARDSYNC_CHUNK_KIB='-5'"):
            shardsync.Session(plan, 0, srv.address, token=TOKEN, transport="loopback",
                              connect_timeout=1)
