"""examples/: the host-memory job runs as its header says and verifies every engine element; a
layout the engine would refuse fails before any rank starts, naming the field."""

from __future__ import annotations

import os
import py_compile
import subprocess
import sys
from pathlib import Path

import pytest

SOURCE = Path(os.environ.get("SHARDSYNC_SOURCE_DIR") or Path(__file__).resolve().parents[2])
EXAMPLES = SOURCE / "examples"


def _env():
    """This environment with PYTHONPATH made absolute: the examples run from another directory."""
    env = dict(os.environ)
    # As a user runs them: conftest gives this process a launch identity, a user's shell has none
    # (without this pop the examples' own identity went untested and a fresh clone failed).
    env.pop("SHARDSYNC_JOB_ID", None)
    env.pop("SHARDSYNC_JOB_SECRET", None)
    paths = [os.path.abspath(p) for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    if paths:
        env["PYTHONPATH"] = os.pathsep.join(paths)
    return env


@pytest.fixture
def need_examples(need_session):
    if not (EXAMPLES / "host_sync.py").is_file():
        pytest.skip("examples/ not beside the tests")
    pytest.importorskip("torch")


def test_host_sync_example_verifies(need_examples, tmp_path):
    # The header's command, from another directory: the installed package, 6 rank processes.
    r = subprocess.run([sys.executable, str(EXAMPLES / "host_sync.py"), "--timeout", "120"],
                       cwd=tmp_path, env=_env(), capture_output=True, text=True, timeout=240)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "VERIFIED: 3 syncs" in r.stdout, r.stdout
    assert r.stdout.count("checksums") == 3 and "8/8 checksums" in r.stdout


def test_host_sync_example_refuses_a_bad_layout(need_examples, tmp_path):
    r = subprocess.run([sys.executable, str(EXAMPLES / "host_sync.py"), "--rollout",
                        "dp=1,tp=3,pp=1"], cwd=tmp_path, env=_env(), capture_output=True, text=True,
                       timeout=120)
    assert r.returncode != 0
    assert "rollout tp=3: num_attention_heads 4 is not divisible by tp" in r.stderr, r.stderr
    assert "rank 0" not in r.stdout  # no rank was started


def test_other_examples_compile(tmp_path):
    if not EXAMPLES.is_dir():
        pytest.skip("examples/ not beside the tests")
    scripts = sorted(EXAMPLES.rglob("*.py"))
    assert len(scripts) >= 3
    for script in scripts:
        py_compile.compile(str(script), cfile=str(tmp_path / (script.stem + ".pyc")), doraise=True)
