"""The engine-hook demo (python/tools/engine_hooks_demo.py) end to end on CPU: SGLang's and
vLLM's call sequences, both paths each, every engine element compared."""

from __future__ import annotations

import json
import os
import sys

import pytest

pytest.importorskip("torch")

TOOLS = os.path.join(os.path.dirname(__file__), "..", "tools")


def test_engine_hooks_demo(need_session, capsys):
    sys.path.insert(0, TOOLS)
    try:
        import engine_hooks_demo as demo
    finally:
        sys.path.remove(TOOLS)
    rc = demo.main(["--rollout", "dp=2,tp=2,pp=2", "--versions", "2", "--timeout", "30"])
    lines = [json.loads(x) for x in capsys.readouterr().out.splitlines() if x.startswith("{")]
    assert [(r["engine"], r["path"]) for r in lines] == [
        ("sglang", "receiver"), ("sglang", "loader"), ("vllm", "native"), ("vllm", "extension")]
    for r in lines:
        assert r["ok"], r
        assert [v["version"] for v in r["versions"]] == [1, 2]
        assert all(v["mismatches"] == 0 and v["elements"] > 0 for v in r["versions"])
    assert rc == 0
