"""ShardsyncWeightSync (shardsync.integrations.unirl) built and driven exactly as UniRL's trainers
do (fakes_unirl.py mirrors their call sequence, citing UniRL's files): the colocated ARTrainer as
shipped, with the Hydra block of docs/python.md and nothing else, and AsyncARTrainer with
integrations/unirl-async.patch applied to its `_connect_separate`. SGLang tp=2 behind UniRL's
wrapper (fakes_sglang.py); real shardsync sessions over host memory; every engine element checked
in bf16 (the recipe's wire dtype); the engine's version stamped once per round."""

from __future__ import annotations

import ast
import importlib
import pathlib
import re
import sys

import pytest

torch = pytest.importorskip("torch")
yaml = pytest.importorskip("yaml")

import shardsync  # noqa: E402
import fakes_unirl as fu  # noqa: E402
from conftest import expected_param, reference_weights  # noqa: E402
from fakes_engines import FakeModel, installed  # noqa: E402
from fakes_sglang import FakeSGLangEngine, sglang_modules  # noqa: E402

HERE = pathlib.Path(__file__).resolve().parent
DOCS = HERE.parents[1] / "docs" / "python.md"
PATCH = HERE.parent / "shardsync" / "integrations" / "unirl-async.patch"


def _recipes():
    """The yaml blocks of docs/python.md's UniRL section: (colocated, separate slabs)."""
    text = DOCS.read_text()
    sec = text[text.index("### UniRL: `ShardsyncWeightSync`"):text.index("### Demo")]
    blocks = re.findall(r"```yaml\n(.*?)```", sec, re.S)
    assert len(blocks) == 2, blocks
    return [yaml.safe_load(b) for b in blocks]


@pytest.fixture
def unirl(need_session):
    mods = dict(sglang_modules("0.5.12"), **fu.unirl_modules())
    with installed(mods):
        sys.modules.pop("shardsync.integrations.unirl", None)
        yield importlib.import_module("shardsync.integrations.unirl")
        sys.modules.pop("shardsync.integrations.unirl", None)
        fu.ENGINES.clear()


def _engines(plan, devices, profile="0.5.12", **kw):
    """One FakeSGLangEngine per replica (the server its head boots), bf16 parameters, registered
    under the replica's devices; returns ({(replica, tp, pp): model}, [engines])."""
    sm = plan.shard_map()
    models, engines = {}, []
    for d in range(plan.dp):
        per = {}
        for pp in range(plan.pp):
            for tp in range(plan.tp):
                per[(tp, pp)] = models[(d, tp, pp)] = FakeModel(sm.rank(tp, pp).params,
                                                                dtype=torch.bfloat16)
        e = FakeSGLangEngine(per, plan.tp, plan.pp, profile=profile, **kw)
        fu.ENGINES[tuple(devices[d * plan.tp * plan.pp:(d * plan.pp + 1) * plan.tp])] = e
        engines.append(e)
    return models, engines


def _check_bf16(plan, full, models):
    """Every engine element equals its piece of `full` rounded to bf16 (bit for bit); returns
    the number of elements checked."""
    sm = plan.shard_map()
    n = 0
    for (_, tp, pp), model in models.items():
        params = dict(model.named_parameters())
        for p in sm.rank(tp, pp).params:
            want = torch.from_numpy(expected_param(p, full)).to(torch.bfloat16)
            got = params[p.name].detach()
            assert torch.equal(got.view(torch.int16), want.view(torch.int16)), (tp, pp, p.name)
            n += got.numel()
    return n


def _rollout_cfg(model, tp, extra):
    """The rollout block as a UniRL recipe has it (`_target_` the SGLang role, its `config` an
    SGLangEngineConfig), merged with the docs' `rollout:` lines."""
    cfg = {"_target_": "unirl.rollout.engine.sglang.config.SGLangEngineConfig",
           "pretrained_model_ckpt_path": model, "tp_size": tp, "backend": "native"}
    cfg.update((extra or {}).get("config", {}))
    return {"_target_": "unirl.rollout.engine.sglang.engine.SGLangRolloutEngine", "config": cfg}


def test_unirl_ar_trainer_as_shipped(unirl, tiny_model, monkeypatch):
    """ARTrainer (ar.py) with the docs' block and nothing else: `remote_hydra(sync_cfg,
    backend=..., rollout=...)` in one colocated scope over 4 GPUs (SGLang tp=2: two replicas),
    then train_step's wake_up / sync / generate / sleep, three rounds. Set up on the first
    sync(), store shared through torch.distributed, every element verified, and the engine's
    version (what each sample carries) is the round number: stamped once per round, though
    UniRL's wrapper counted two updates per round. Before: the constructor raised TypeError on
    `rollout=`, and sync() "before connect()"."""
    # No launcher identity in the environment (UniRL starts workers through Ray): the handler
    # draws the job's own on rank 0 and shares it with the store token.
    monkeypatch.delenv("SHARDSYNC_JOB_ID", raising=False)
    monkeypatch.delenv("SHARDSYNC_JOB_SECRET", raising=False)
    colocated, _ = _recipes()
    plan = shardsync.Plan(tiny_model, "fsdp=4", "dp=2,tp=2,pp=1", engine="sglang",
                          wire_dtype="bf16", trainer_dtype="f32")
    models, engines = _engines(plan, devices=[0, 1, 2, 3])
    full = {v: reference_weights(plan, seed=v) for v in range(4)}
    with fu.job(4) as pool:
        # ARTrainer.__init__: one colocated scope (placement fraction=1.0, shared_workers)
        with fu.placement(pool, fraction=1.0, shared_workers=True):
            backend = fu.remote(fu.FakeFSDPBackend, full=full[0])
            rollout = fu.remote(**fu.parse_hydra_cfg(
                _rollout_cfg(tiny_model, 2, colocated["rollout"])))
            weight_sync = fu.remote_hydra(colocated["sync"], backend=backend, rollout=rollout)
        handlers = [weight_sync.local(i) for i in range(4)]
        try:
            total = sum(p.numel() for m in models.values() for p in m.parameters())
            for step in (1, 2, 3):
                backend.load_full(full[step])  # the optimizer step
                # ARTrainer.train_step
                rollout.wake_up()
                weight_sync.sync()
                out = rollout.generate(None)
                rollout.sleep()
                assert _check_bf16(plan, full[step], models) == total
                assert [o["output_version"] for o in out if o is not None] == [step, step]
                assert [h.weight_version for h in handlers] == [step] * 4
            heads = [rollout.local(i) for i in rollout.engine_replicas]
            assert rollout.engine_replicas == [0, 2]
            assert [h.updates for h in heads] == [2 + 2 * 3] * 2  # init + 2 per round
            # The store went through UniRL's collective once, from rank 0. Over Worker.call
            # only what the trainer itself calls: each head drives its own engine in process.
            assert sorted(r for c, r in fu.PROCESS_GROUPS.calls
                          if c == "broadcast_object_list") == [0, 1, 2, 3]
            called = {(role, m) for w in pool.workers for role, m in w.calls}
            assert {m for role, m in called if role == rollout.role_name} == {
                "wake_up", "generate", "sleep"}
            assert {m for role, m in called if role == weight_sync.role_name} == {"sync"}
            assert not any(e.dead for e in engines)
        finally:
            weight_sync.cleanup()
            for e in engines:
                e.shutdown()


def test_unirl_colocated_refusals_reach_every_rank(unirl, tiny_model):
    """Refused on the first sync(), on every rank, naming why, before a byte moves: a rollout
    without the loader listed; --weight-cache-mode; a draft model (speculative decoding)."""
    colocated, _ = _recipes()
    plan = shardsync.Plan(tiny_model, "fsdp=2", "dp=1,tp=2,pp=1", engine="sglang",
                          wire_dtype="bf16", trainer_dtype="f32")
    full = reference_weights(plan, seed=0)
    cases = (({}, "custom-weight-loader"),
             ({"config": {"engine_kwargs": dict(colocated["rollout"]["config"]["engine_kwargs"],
                                                weight_cache_mode="client")}},
              r"--weight-cache-mode client"),
             ({"config": {"engine_kwargs": dict(colocated["rollout"]["config"]["engine_kwargs"],
                                                speculative_algorithm="EAGLE")}},
              r"speculative decoding \(EAGLE\)"))
    for extra, match in cases:
        models, engines = _engines(plan, devices=[0, 1])
        with fu.job(2) as pool:
            with fu.placement(pool, fraction=1.0, shared_workers=True):
                backend = fu.remote(fu.FakeFSDPBackend, full=full)
                rollout = fu.remote(**fu.parse_hydra_cfg(_rollout_cfg(tiny_model, 2, extra)))
                ws = fu.remote_hydra(colocated["sync"], backend=backend, rollout=rollout)
            try:
                with pytest.raises(shardsync.FailedPreconditionError, match=match) as info:
                    ws.sync()
                assert "failed on rank" in str(info.value)
                assert engines[0].calls == [] and not engines[0].dead
                assert all(float(t.abs().sum()) == 0.0 for m in models.values()
                           for t in m.parameters())
            finally:
                ws.cleanup()
                engines[0].shutdown()
    with pytest.raises(shardsync.UnimplementedError, match="lora_merged=True"):
        unirl.ShardsyncWeightSync(backend=fu.FakeFSDPBackend({}), lora_merged=True)


def _patched_accepts(path="unirl/trainer/async_ar.py"):
    """The `_target_` suffixes `_connect_separate` accepts before and after unirl-async.patch,
    read from the patch's own lines for `path`."""
    text = PATCH.read_text()
    part = text[text.index(f"diff --git a/{path}"):]
    part = part[:part.index("\ndiff --git", 1)] if "\ndiff --git" in part[1:] else part

    def suffixes(sign):
        line = next(ln for ln in part.splitlines()
                    if ln.startswith(sign + " ") and "endswith" in ln)
        arg = ast.literal_eval(re.search(r"endswith\((.*)\):", line).group(1))
        return arg if isinstance(arg, tuple) else (arg,)

    return suffixes("-"), suffixes("+")


def test_unirl_async_trainer_with_the_patch(unirl, tiny_model, monkeypatch):
    """AsyncARTrainer: train slab (2 GPUs, fsdp=2) and rollout slab (2 GPUs, SGLang tp=2) built
    as async_ar.py does, the handler from the docs' separate-slabs block with `backend=` only.
    As shipped, `_connect_separate` refuses it; with the patch's line, the trainer's own
    pick_master / set_rollout_targets(tp_zero_workers) / connect drive it, and each
    AsyncBatchControl.sync_rollout round (sync(), then rollout.set_version(train_version))
    lands every element."""
    # No launcher identity in the environment (UniRL starts workers through Ray): the handler
    # draws the job's own on rank 0 and shares it with the store token.
    monkeypatch.delenv("SHARDSYNC_JOB_ID", raising=False)
    monkeypatch.delenv("SHARDSYNC_JOB_SECRET", raising=False)
    _, separate = _recipes()
    sync_cfg = dict(separate["sync"], model=tiny_model)
    before, after = _patched_accepts()
    assert before == ("NCCLWeightSync",) and "ShardsyncWeightSync" in after
    assert _patched_accepts("unirl/trainer/agentic_async.py") == (before, after)
    plan = shardsync.Plan(tiny_model, "fsdp=2", "dp=1,tp=2,pp=1", engine="sglang",
                          wire_dtype="bf16", trainer_dtype="f32")
    models, engines = _engines(plan, devices=[2, 3])
    full = {v: reference_weights(plan, seed=v) for v in range(3)}
    colocated, _ = _recipes()
    with fu.job(4) as pool:
        trainer = type("AsyncARTrainer", (), {})()
        with fu.placement(pool, fraction=0.5, shared_workers=True):  # the train slab
            trainer.backend = fu.remote(fu.FakeFSDPBackend, full=full[0])
            trainer.weight_sync = fu.remote_hydra(sync_cfg, backend=trainer.backend)
        with fu.placement(pool, fraction=0.5, shared_workers=True):  # the rollout slab
            trainer.rollout = fu.remote(**fu.parse_hydra_cfg(
                _rollout_cfg(tiny_model, 2, colocated["rollout"])))
        try:
            with pytest.raises(ValueError, match="requires a cross-slab weight sync"):
                fu.async_connect_separate(trainer, sync_cfg, accepts=before)
            fu.async_connect_separate(trainer, sync_cfg, accepts=after)
            head = trainer.rollout.local(0)
            total = sum(p.numel() for m in models.values() for p in m.parameters())
            for step, train_version in ((1, 4), (2, 8)):
                trainer.backend.load_full(full[step])
                trainer.weight_sync.sync()  # AsyncBatchControl.sync_rollout
                assert head._version == step  # the handler's one stamp per round
                trainer.rollout.set_version(train_version)
                out = trainer.rollout.generate(None)
                assert [o["output_version"] for o in out if o is not None] == [train_version]
                assert _check_bf16(plan, full[step], models) == total
            assert head.updates == 2 + 2 * 2
            assert not engines[0].dead
        finally:
            trainer.weight_sync.cleanup()
            engines[0].shutdown()


def test_docs_table_lists_every_sglang_and_unirl_path():
    """docs/python.md's version x path table holds SUPPORT's SGLang and UniRL rows as they are
    (the refusals and supports the tests here and in test_hooks_engine_versions.py show)."""
    from shardsync.hooks.engines import support_rows

    text = DOCS.read_text()
    rows = support_rows("sglang", "unirl")
    assert len(rows) == 11
    missing = [r for r in rows if r not in text]
    assert not missing, missing
