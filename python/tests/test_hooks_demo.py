"""The engine-hook demo (python/tools/engine_hooks_demo.py) end to end on CPU: every supported
engine version range's call sequence through the versioned stand-in engines, every engine
element compared; every unsupported range refused at init naming its version and capability."""

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
    rc = demo.main(["--rollout", "dp=2,tp=2,pp=2", "--versions", "1", "--timeout", "30"])
    out = [json.loads(x) for x in capsys.readouterr().out.splitlines() if x.startswith("{")]
    lines = [r for r in out if "quant" not in r]
    fp8 = [r for r in out if "quant" in r]
    assert [(r["engine"], r["profile"], r["head"]) for r in lines] == [
        (e, p, h) for e, p, _, h, _ in demo.SCENARIOS]
    supported = [r for r in lines if r["expect"] == "ok"]
    refused = [r for r in lines if r["expect"] != "ok"]
    assert len(supported) == 18 and len(refused) == 5
    # Both engines' block-FP8 paths: every e4m3 byte and scale against the quantizer.
    assert [(r["engine"], r["profile"], r["head"], r["fp8_backend"]) for r in fp8] == [
        (e, p, h, b) for e, p, _, h, _, b in demo.FP8_SCENARIOS]
    assert {r["engine"] for r in fp8 if r["expect"] == "ok"} == {"sglang", "vllm"}
    for r in fp8:
        assert r["ok"], r
        if r["expect"] == "ok":
            assert all(v["mismatches"] == 0 and v["elements"] > 0 for v in r["versions"])
        else:
            assert r["expect"] in r["error"], r
    for r in supported:
        assert r["ok"], r
        assert [v["version"] for v in r["versions"]] == [1]
        assert all(v["mismatches"] == 0 and v["elements"] > 0 for v in r["versions"])
    for r in refused:
        assert r["ok"] and "refused" in r["error"] and r["expect"] in r["error"], r
    assert {r["expert_naming"] for r in supported
            if r["profile"] in ("0.24", "0.25")} == {"routed_experts"}
    assert rc == 0
