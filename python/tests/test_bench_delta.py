"""bench/delta/sync_adamw_gpu.py (issue 35's AdamW benchmark through device sessions) runs its
whole flow here with `--dry` (CPU tensors, host sessions, one rank process each): the trainer
trains, every sync verifies, the engine checks every element against the masters it maps, and
the session's changed count equals the one taken from the masters. The GPU runs are on the device
machine (docs/benchmarks.md); this keeps the script from rotting between them."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

SOURCE = Path(os.environ.get("SHARDSYNC_SOURCE_DIR") or Path(__file__).resolve().parents[2])
SCRIPT = SOURCE / "bench" / "delta" / "sync_adamw_gpu.py"


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
