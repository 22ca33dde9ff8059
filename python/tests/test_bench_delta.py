"""bench/delta/sync_adamw_gpu.py (issue 35's AdamW benchmark through device sessions) runs its
whole flow here with `--dry` (CPU tensors, host sessions, one rank process each): the trainer
trains, every sync verifies, the engine checks every element against the masters it maps, and
the session's changed count equals the one taken from the masters. The GPU runs are on the device
machine (docs/benchmarks.md); this keeps the script from rotting between them. density.py's
`delta_bytes` (its copy of the codec's size rule) is checked against the C++ test's figures."""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

SOURCE = Path(os.environ.get("SHARDSYNC_SOURCE_DIR") or Path(__file__).resolve().parents[2])
SCRIPT = SOURCE / "bench" / "delta" / "sync_adamw_gpu.py"
DENSITY = SOURCE / "bench" / "delta" / "density.py"


def _delta_bytes():
    """density.py's delta_bytes and its constants, without importing the script (it needs torch)."""
    tree = ast.parse(DENSITY.read_text())
    keep = [n for n in tree.body if (isinstance(n, ast.FunctionDef) and n.name == "delta_bytes")
            or (isinstance(n, ast.Assign) and n.targets[0].id.isupper())]
    scope: dict = {}
    exec(compile(ast.Module(body=keep, type_ignores=[]), str(DENSITY), "exec"), scope)
    return scope["delta_bytes"]


def test_density_delta_bytes_is_the_codecs_size_rule():
    if not DENSITY.is_file():
        pytest.skip("bench/ not beside the tests")
    delta_bytes = _delta_bytes()
    # tests/common/delta_test.cc KindFollowsTheSizeRule: 64000 bf16 elements, 8 tiles.
    assert delta_bytes(64000, 2, 0) == ("index", 48 + 32)
    assert delta_bytes(64000, 2, 2001, 2001) == ("index", 48 + 4036 + 2001 * 2)
    assert delta_bytes(64000, 2, 3984, 3984) == ("index", 48 + 8000 + 3984 * 2)
    assert delta_bytes(64000, 2, 2000) == ("packed", 48 + 64 + 500 + 4000)
    assert delta_bytes(64000, 2, 2001) == ("packed", 48 + 64 + 500 + 4002)
    assert delta_bytes(64000, 2, 2001, 3) == ("packed", 48 + 64 + 500 + 4002 + 6)
    assert delta_bytes(64000, 2, 200)[0] == "index"
    assert delta_bytes(64000, 2, 300)[0] == "packed"
    assert delta_bytes(64000, 1, 2000, 2000)[0] == "packed"
    assert delta_bytes(64000, 4, 2000)[0] == "index"
    assert delta_bytes(64000, 2, 3985) == ("bitmap", 48 + 8000 + 3985 * 2)
    assert delta_bytes(64000, 2, 59975)[0] == "bitmap"
    assert delta_bytes(64000, 2, 59976) == ("full", 128000)
    assert delta_bytes(4, 4, 0) == ("full", 16)
    # SizeRuleBreaksEvenNearOneSixteenth: 2^20 elements, the last count the index form wins
    # with every change escaped (packed for a byte image).
    n = 1 << 20
    for e in (1, 2, 4):
        tiles = n // (16384 // e)
        last = (n // 8 - 4 * tiles) // 2
        if e == 1:
            assert delta_bytes(n, e, last, last) == ("packed", 48 + 4 * tiles + n // 128 + 2 * last)
        else:
            assert delta_bytes(n, e, last, last) == ("index", 48 + 4 * tiles + (2 + e) * last)
        assert delta_bytes(n, e, last + 1) == ("bitmap", 48 + n // 8 + e * (last + 1))


def test_sync_adamw_gpu_dry_run_verifies_every_sync(need_session, tmp_path):
    if not SCRIPT.is_file():
        pytest.skip("bench/ not beside the tests")
    pytest.importorskip("torch")
    env = dict(os.environ)
    env.pop("SHARDSYNC_JOB_ID", None)  # the script makes its own launch identity
    env.pop("SHARDSYNC_JOB_SECRET", None)
    out = tmp_path / "r.json"
    r = subprocess.run([sys.executable, str(SCRIPT), "--dry", "--transport", "shm", "--layers", "1",
                        "--vocab", "1024", "--steps", "2", "--lrs", "1e-5", "--bucket-mb", "4",
                        "--json", str(out)], cwd=tmp_path, env=env, capture_output=True, text=True,
                       timeout=240)
    assert r.returncode == 0, r.stdout + r.stderr
    rows = json.loads(out.read_text())["results"]
    assert [row["step"] for row in rows] == [0, 1, 2]
    for row in rows:
        assert row["verified"] and row["element_mismatches"] == 0, row
        assert row["elements_checked"] > 0, row
    first, later = rows[0]["delta"], rows[1:]
    assert first["buckets_delta"] == 0 and first["fallbacks"]["no_kept_image"] > 0
    for row in later:  # real AdamW steps: deltas, counted alike by the session and the masters
        d = row["delta"]
        assert d["buckets_delta"] > 0 and 0 < d["changed"] < d["elements"], d
        assert row["own_changed"] == d["changed"], row
        assert d["wire_bytes"] < d["full_bytes"], d
