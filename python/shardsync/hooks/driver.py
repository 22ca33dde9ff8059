"""Driver side of the engine hooks: play each engine's call sequence, read every rank's report.

The engines answer a weight-update request from one rank only (SGLang: pp0/tp0; vLLM's
collective_rpc returns every worker's value but the native update API returns None), and the
hooks never raise, so the truth is in the store: every engine rank posts its status under
`<prefix>hooks/<op>/<version>/<replica>/<pp>/<tp>` and `collect_reports` reads all of them, with
one deadline for the lot, naming each rank that failed or never answered (driver_base.py).

Before a driver contacts an engine it probes every head (`engines.probe`: the engine's version,
entry points, request shapes, expert naming) and refuses a path the engine version lacks, naming
the version and the missing capability. Drivers: `SGLangDriver` (driver_sglang.py) and
`VLLMDriver` (driver_vllm.py); handles: `SGLangEngineAdapter`, `HTTPEngine` (clients.py).

Drivers run on the driver, not inside an engine, so they raise (`HookError`) when any rank
failed. Trainer ranks sync concurrently with `Session.sync(version)`.
"""

from __future__ import annotations

from .clients import HTTPEngine, SGLangEngineAdapter, SGLangHTTP, VLLMHTTP
from .driver_base import HookError, check_reports, collect_reports
from .driver_sglang import SGLangDriver
from .driver_vllm import VLLMDriver

__all__ = [
    "HookError",
    "collect_reports",
    "check_reports",
    "SGLangDriver",
    "VLLMDriver",
    "SGLangEngineAdapter",
    "HTTPEngine",
    "SGLangHTTP",
    "VLLMHTTP",
]
