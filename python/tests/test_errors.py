"""Every C++ StatusCode surfaces as its own shardsync.Error subclass, with the C++ message (CLI
flags reworded as the Python arguments they correspond to)."""

from __future__ import annotations

import pytest

import shardsync
from shardsync import errors

CODES = {
    1: shardsync.InvalidArgumentError,
    2: shardsync.FailedPreconditionError,
    3: shardsync.NotFoundError,
    4: shardsync.DataLossError,
    5: shardsync.DeadlineExceededError,
    6: shardsync.UnavailableError,
    7: shardsync.InternalError,
    8: shardsync.UnimplementedError,
    9: shardsync.PermissionDeniedError,
    10: shardsync.AbortedError,
    11: shardsync.OutOfRangeError,
}


def test_hierarchy_is_one_base_with_distinct_subclasses():
    classes = set(CODES.values())
    assert len(classes) == 11
    for cls in classes:
        assert issubclass(cls, shardsync.Error)
    assert errors.error_for_code(99) is shardsync.Error


@pytest.mark.parametrize("code,cls", sorted(CODES.items()))
def test_native_status_maps_to_subclass(code, cls):
    C = shardsync.native()
    msg = f"rank 3: field x{code}: went wrong"
    with pytest.raises(cls) as info:
        C._raise_status(code, msg)
    assert type(info.value) is cls
    assert str(info.value) == msg
    assert info.value.code == C.status_code_name(code)
    # Only the exact class matches among siblings.
    for other in set(CODES.values()) - {cls}:
        assert not isinstance(info.value, other)


def test_python_builtin_bases_kept():
    assert issubclass(shardsync.InvalidArgumentError, ValueError)
    assert issubclass(shardsync.DeadlineExceededError, TimeoutError)
    assert issubclass(shardsync.NotFoundError, LookupError)
    assert issubclass(shardsync.PermissionDeniedError, PermissionError)


def test_real_errors_carry_cpp_messages(need_plan):
    with pytest.raises(shardsync.InvalidArgumentError, match="^rollout tp: must be in"):
        shardsync.Plan("qwen2.5-0.5b", "fsdp=4", "dp=1,tp=0,pp=1")
    with pytest.raises(shardsync.Error):
        shardsync.load_model("no-such-model-anywhere")
    # Python argument names, not the CLI's flags (--tp), which the CLI keeps.
    with pytest.raises(shardsync.InvalidArgumentError, match="^tp: must be positive, got 0"):
        shardsync.compute_layout(1, 0, 1)
    plan = shardsync.Plan("qwen2.5-0.5b", "fsdp=2", "dp=1,tp=2,pp=1")
    with pytest.raises(shardsync.OutOfRangeError):
        plan.engine_rank(1, 0, 0)
    with pytest.raises(shardsync.InvalidArgumentError, match="num_attention_heads"):
        shardsync.shard_map("qwen2.5-0.5b", "sglang", tp=3)


def test_store_errors(need_plan):
    if not shardsync.has_part("store"):
        pytest.skip("store part not built")
    with shardsync.StoreServer(token="right-token-0123456789") as srv:
        with pytest.raises(shardsync.PermissionDeniedError):
            shardsync.StoreClient(srv.address, token="wrong-token-0123456789", timeout=5.0)
        c = shardsync.StoreClient(srv.address, token="right-token-0123456789")
        c.set("k", b"v")
        assert c.get("k") == b"v"
        assert c.add("n", 2) == 2
        with pytest.raises(shardsync.DeadlineExceededError):
            c.get("never-set", timeout=0.2)
    with pytest.raises(shardsync.InvalidArgumentError):
        shardsync.StoreClient("no-port-here", token="test-token-0123456789", timeout=1.0)


def test_store_tokens_and_ephemeral_keys(need_plan):
    """Issue 26: short tokens refused, a generated one when none is given; keys bound to a client
    die with it and fail their waiters at once."""
    if not shardsync.has_part("store"):
        pytest.skip("store part not built")
    with pytest.raises(shardsync.InvalidArgumentError, match="at least 16"):
        shardsync.StoreServer(token="short")
    with shardsync.StoreServer() as srv:
        assert len(srv.token) == 32
        with pytest.raises(shardsync.InvalidArgumentError, match="at least 16"):
            shardsync.StoreClient(srv.address, token="t")
        owner = shardsync.StoreClient(srv.address, token=srv.token)
        c = shardsync.StoreClient(srv.address, token=srv.token)
        owner.set_ephemeral("job/alive/0", "rank 0")
        assert c.set_if_absent("job/claim", "a", ephemeral=True) == b"a"
        assert owner.set_if_absent("job/claim", "b") == b"a"
        del owner  # its connection closes
        # Waiting on it (beside a key nobody sets) fails as soon as the store saw the close.
        with pytest.raises(shardsync.UnavailableError, match="job/alive/0"):
            c.wait(["job/never", "job/alive/0"], timeout=5.0)
        c.set("job/v1/x", b"1")
        assert c.delete_prefix("job/v1/") == 1
        c.mark_dead("job/alive/1", "rank 1 exited")
        with pytest.raises(shardsync.UnavailableError, match="rank 1 exited"):
            c.wait(["job/alive/1"], timeout=5.0)


def test_max_sync_version_is_documented(need_session):
    """Issue 26: the largest accepted version is a public constant (the check is phase 2's)."""
    assert shardsync.native().MAX_SYNC_VERSION == 2**63 - 1


@pytest.mark.parametrize("cpp,python", [
    ("--tp 3: num_attention_heads 32 is not divisible by tp",
     "tp=3: num_attention_heads 32 is not divisible by tp"),
    ("--wire-dtype: I8 is not a supported floating type", "wire_dtype: I8 is not a supported "
     "floating type"),
    ("--bucket-mb: bucket cap 100 bytes", "bucket_bytes: bucket cap 100 bytes"),
    ("--gpus-per-node-list[2]: must be positive", "node_gpus[2]: must be positive"),
    ("--dp x --tp x --pp: 16 workers", "dp x tp x pp: 16 workers"),
    ("--ep 2: vLLM needs ep == tp (--enable-expert-parallel)",
     "ep=2: vLLM needs ep == tp (enable_expert_parallel)"),
    ("rank 3: a-- b --x y --1 --", "rank 3: a-- b x y --1 --"),  # only flags are touched
    ("plain message", "plain message"),
])
def test_cli_flags_become_argument_names(cpp, python):
    with pytest.raises(shardsync.InvalidArgumentError) as info:
        shardsync.native()._raise_status(1, cpp)
    assert str(info.value) == python
