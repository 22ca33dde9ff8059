"""Every public member of the core API (plan, session, store, layout, errors, types) and of the
native classes it returns has a docstring, and the typed members are not `Any` where `_C.pyi`
defines the type."""

from __future__ import annotations

import inspect
import typing

import pytest

import shardsync
from shardsync import layout, plan, session, store, types

# The engine-hook side (EngineGroup, adapters, hooks) is documented with its own modules.
CORE_MODULES = (plan, session, store, layout, shardsync.errors, types)


def _public_members(cls):
    for name, value in vars(cls).items():
        if name.startswith("_"):
            continue
        if isinstance(value, (staticmethod, classmethod)):
            value = value.__func__
        yield name, value


def _core_objects():
    for name in shardsync.__all__:
        obj = getattr(shardsync, name)
        if getattr(obj, "__module__", None) in {m.__name__ for m in CORE_MODULES}:
            yield name, obj


def test_core_api_is_documented():
    missing = []
    for name, obj in _core_objects():
        if not (obj.__doc__ or "").strip():
            missing.append(name)
        if inspect.isclass(obj):
            for member, value in _public_members(obj):
                if not (getattr(value, "__doc__", None) or "").strip():
                    missing.append(f"{name}.{member}")
    for module in CORE_MODULES:
        if not (module.__doc__ or "").strip():
            missing.append(module.__name__)
    assert not missing, f"public members without a docstring: {missing}"


def test_native_classes_are_documented(need_plan):
    C = shardsync.native()
    undocumented = [n for n, v in vars(C).items()
                    if not n.startswith("_") and (inspect.isclass(v) or callable(v))
                    and not (v.__doc__ or "").strip()]
    assert not undocumented, undocumented


def test_no_any_where_the_stub_has_the_type():
    for cls, attrs in ((shardsync.Plan, ["model", "rank_plan", "held_region", "shard_map",
                                         "summary", "describe_rank", "cost_model"]),
                       (shardsync.Session, ["rank_plan", "expected_params", "sync"])):
        for attr in attrs:
            member = inspect.getattr_static(cls, attr)
            fn = member.fget if isinstance(member, property) else member
            ret = inspect.signature(fn).return_annotation
            assert ret not in (inspect.Signature.empty, "Any", typing.Any), f"{cls.__name__}.{attr}"
