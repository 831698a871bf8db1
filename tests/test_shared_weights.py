"""Shared weights: at equal TP, PP 1 and the parameters' dtype the native engine reads the actor's own tensors.

One 2-process gloo launch: an actor in megatron DDP with megatron's optimizer (bf16 with fp32 main params and
the distributed optimizer at TP 2; fp32 at TP 1, DP 2). Checked: the engine's parameters are the actor's storages
(no byte copied, the engine's own copy freed), greedy generation after an optimizer step, after an offload /
onload cycle and after a checkpoint resume equals an engine loaded by the verified copy, a replaced parameter fails
the identity check, and the layouts that cannot share (rollout TP != TP, another engine dtype, PP 2) still copy.
"""
import dataclasses
import gc
import types
import weakref

import pytest
import torch

from copy_spy import CopySpy
from dist_helper import run_distributed
from megatron_roles import SPEC, backward, megatron_on_cpu

PROMPTS = [[5, 6, 7], [1, 2, 3, 4, 5, 6, 7], [9], [40, 41]]
VICTIM = "decoder.layers.1.mlp.linear_fc2.weight"


def _actor(tp: int, pp_rank: int, dtype: str, distributed: bool, pp: int = 1):
    from hybridrl.config import Config, OptimConfig
    from hybridrl.models.gpt import DTYPES, GPTSpec, build_gpt
    from hybridrl.trainer.roles import wrap_trainable
    from hybridrl.workers.optim import MegatronOptimizer

    cfg = Config()
    cfg = dataclasses.replace(cfg, parallel=dataclasses.replace(cfg.parallel, use_distributed_optimizer=distributed))
    torch.manual_seed(0)
    module = wrap_trainable(build_gpt(GPTSpec(**SPEC), tp, pp, pp_rank, dtype), cfg)
    with megatron_on_cpu():
        opt = MegatronOptimizer(module, OptimConfig(lr=1e-2, weight_decay=0.1), distributed, 10, DTYPES[dtype])
    return module, opt


def _step(module, opt, seed: int) -> None:
    backward(module, opt, seed)
    with megatron_on_cpu():
        assert opt.step()[0]


def _greedy(engine):
    from hybridrl.rollout.base import SamplingParams

    return engine.generate(PROMPTS, SamplingParams(temperature=0, max_new_tokens=6)).responses


def _copied_greedy(module, spec, groups, tp: int, dtype: str):
    """Greedy responses of a fresh engine loaded by the verified copy path."""
    from hybridrl.placement.reshard import update_engine_weights
    from hybridrl.rollout.native import NativeEngine

    engine = NativeEngine(spec, tp, dtype=dtype)
    report = update_engine_weights(engine, module, spec, groups, 1, share=False)
    assert report.verified and not report.shared and report.verify == "fingerprint"
    return _greedy(engine)


def _shared_handoff(engine, module, spec, groups) -> dict:
    """The handoff with every Python copy counted and new storages metered."""
    from hybridrl.placement.reshard import update_engine_weights

    with CopySpy() as spy:
        report = update_engine_weights(engine, module, spec, groups, 1, measure_memory=True)
    return {"report": report, "copied_bytes": spy.nbytes}


def _same_storages(engine, module) -> bool:
    from hybridrl.placement.reshard import weight_state

    local = weight_state(module)
    return all(engine.params[g].untyped_storage() is local[g].untyped_storage()
               and engine.params[g].data_ptr() == local[g].data_ptr() for g in engine.params)


def _tp2(folder: str) -> dict:
    from hybridrl.checkpoint.sharded import load_role, save_role
    from hybridrl.config import OffloadConfig
    from hybridrl.models.gpt import GPTSpec
    from hybridrl.models.hf_checkpoint import unwrap_model
    from hybridrl.placement import reshard
    from hybridrl.placement.offload import Offloader, PhaseOffload
    from hybridrl.rollout.native import NativeEngine
    from models_helper import reinit_parallel

    groups, spec, res = reinit_parallel(2, 1), GPTSpec(**SPEC), {}
    module, opt = _actor(2, 0, "bfloat16", True)
    engine = NativeEngine(spec, 2, dtype="bfloat16", offload_weights_on_sleep=True)
    own = [weakref.ref(p.untyped_storage()) for p in engine.params.values()]
    res["first"] = _shared_handoff(engine, module, spec, groups)
    gc.collect()
    res["own_freed"] = all(ref() is None for ref in own)
    res["own_bytes"] = engine.own_weight_bytes()
    res["same_storage"] = _same_storages(engine, module)
    _step(module, opt, 1)
    res["after_step"] = _shared_handoff(engine, module, spec, groups)
    res["greedy_step"] = (_greedy(engine), _copied_greedy(module, spec, groups, 2, "bfloat16"))
    engine.sleep()  # shared weights are the actor's: sleep leaves them
    engine.wake_up()
    # offload / onload: the storages are resized, not replaced; generation keeps the actor's params
    hybrid = PhaseOffload({"actor": Offloader(module, opt, OffloadConfig(params=True, grads=True, optimizer=True))})
    hybrid.enter("gen")
    try:
        _greedy(engine)
        res["offloaded_error"] = None
    except RuntimeError as e:
        res["offloaded_error"] = str(e)
    hybrid.engine_reads = {"actor"}
    hybrid.enter("gen")
    res["gen_keeps"] = hybrid.device_bytes()["actor/params"]
    res["greedy_gen_phase"] = _greedy(engine)
    hybrid.enter("update_actor")
    _step(module, opt, 2)
    hybrid.enter("update_weights")
    res["after_onload"] = _shared_handoff(engine, module, spec, groups)
    res["greedy_onload"] = (_greedy(engine), _copied_greedy(module, spec, groups, 2, "bfloat16"))
    # resume: a checkpoint loaded into the live actor (in place) while the engine reads it
    worker = types.SimpleNamespace(engine=types.SimpleNamespace(module=module), optimizer=opt)
    hybrid.enter("checkpoint")
    with megatron_on_cpu():
        save_role(worker, folder, False)
        _step(module, opt, 3)
        load_role(worker, folder, "actor")
    hybrid.enter("update_weights")
    res["after_resume"] = _shared_handoff(engine, module, spec, groups)
    res["greedy_resume"] = (_greedy(engine), _copied_greedy(module, spec, groups, 2, "bfloat16"))
    # a replaced parameter: the engine's alias is stale, and the handoff says so
    param = unwrap_model(module).decoder.layers[1].mlp.linear_fc2.weight
    param.data = param.data.clone()
    try:
        reshard.update_engine_weights(engine, module, spec, groups, 1)
        res["replaced_error"] = None
    except reshard.HandoffError as e:
        res["replaced_error"] = str(e)
    engine.release_shared()
    res["reshared"] = _shared_handoff(engine, module, spec, groups)
    res["greedy_reshared"] = (_greedy(engine), _copied_greedy(module, spec, groups, 2, "bfloat16"))
    # layouts that cannot share: rollout TP 1 at training TP 2, an fp32 engine for bf16 parameters
    for key, tp, dtype in (("rollout_tp1", 1, "bfloat16"), ("fp32_engine", 2, "float32")):
        other = NativeEngine(spec, tp, dtype=dtype)
        res[key] = (reshard.update_engine_weights(other, module, spec, groups, 1), other.own_weight_bytes(),
                    _same_storages(other, module) if tp == 2 else False)
    return res


def _tp1_and_pp2() -> dict:
    from hybridrl.models.gpt import GPTSpec
    from hybridrl.parallel.distributed import current_groups
    from hybridrl.placement import reshard
    from hybridrl.rollout.native import NativeEngine
    from models_helper import reinit_parallel

    groups, spec, res = reinit_parallel(1, 1), GPTSpec(**SPEC), {}
    module, opt = _actor(1, 0, "float32", False)  # DP 2
    engine = NativeEngine(spec, 1)
    res["tp1"] = _shared_handoff(engine, module, spec, groups)
    res["tp1_same_storage"] = _same_storages(engine, module)
    _step(module, opt, 1)
    reshard.update_engine_weights(engine, module, spec, groups, 1)
    res["tp1_greedy"] = (_greedy(engine), _copied_greedy(module, spec, groups, 1, "float32"))
    reinit_parallel(1, 2)
    groups = current_groups()
    stage, opt = _actor(1, groups.pp_rank, "float32", False, pp=2)
    other = NativeEngine(spec, 1)
    res["pp2"] = (reshard.update_engine_weights(other, stage, spec, groups, 1, share=False), other.own_weight_bytes())
    res.update(_pp2_stage_shared(stage, opt, spec, groups))
    res["pp2_bf16"] = _pp2_bf16(spec, groups)
    res["pp2_te_norms"] = _pp2_bf16(spec, groups, te_norms=True)
    return res


def _as_te_holds_norms(stage):
    """The stage's norms in the model's dtype, as a Transformer Engine trainer holds them (TE is not installed
    here: the local model's norms are cast, and `held_dtype` says what TE's would), until the context ends."""
    import contextlib

    from hybridrl.models import hf_convert as hc

    @contextlib.contextmanager
    def held():
        for name, p in stage.named_parameters():
            if name.endswith("layernorm.weight"):
                p.data = p.data.to(torch.bfloat16)
        real, hc.held_dtype = hc.held_dtype, lambda name, spec, dtype: dtype
        try:
            yield
        finally:
            hc.held_dtype = real
    return held()


def _pp2_bf16(spec, groups, te_norms: bool = False) -> dict:
    """PP 2 in bf16 (the local spec's norms keep fp32 weights; stage 1 starts with one; `te_norms`: bf16 norms,
    as a Transformer Engine trainer holds them): every handoff path is the same on both stages, and each engine's
    tensors equal the export (real vocabulary rows), in the engine's dtypes."""
    import contextlib

    stage, _ = _actor(1, groups.pp_rank, "bfloat16", False, pp=2)
    held = _as_te_holds_norms(stage) if te_norms else contextlib.nullcontext()
    with held:
        return _bf16_handoffs(stage, spec, groups)


def _bf16_handoffs(stage, spec, groups) -> dict:
    from hybridrl.models.hf_checkpoint import mcore_to_hf_stream
    from hybridrl.models import hf_convert as hc
    from hybridrl.placement import reshard
    from hybridrl.rollout.native import NativeEngine

    export = dict(mcore_to_hf_stream(stage, spec, groups))
    reader = hc.DictReader(export)
    out = {}
    for key, tp, share, verify in (("stage_read", 1, True, "fingerprint"), ("copied", 1, False, "fingerprint"),
                                   ("rollout_tp2", 2, True, "fingerprint"), ("hf_buckets", 1, False, "exact")):
        engine = NativeEngine(spec, tp, dtype="bfloat16")
        report = reshard.update_engine_weights(engine, stage, spec, groups, 1, verify=verify, share=share)
        rows = lambda g, t: t[:spec.vocab_size] if hc.is_vocab_tensor(g) and tp == 1 else t  # noqa: E731 (the
        # stage-read engine holds the actor's own padding rows: never decoded)
        exact = [g for g in engine.params if not torch.equal(rows(g, engine.params[g]), rows(g, hc.read_shard(
            g, reader, spec, tp, engine.groups.tp_rank).to(engine.params[g].dtype)))]
        out[key] = (report.verified, report.stage_shared, report.engine_layout,
                    {str(t.dtype) for t in engine.params.values()}, exact)
    return out


def _pp2_stage_shared(stage, opt, spec, groups) -> dict:
    """PP 2: the engine reads this stage's own tensors and takes the other stage's, verified."""
    from hybridrl.models import hf_convert as hc
    from hybridrl.placement import reshard
    from hybridrl.rollout.native import NativeEngine

    engine, res = NativeEngine(spec, 1, offload_weights_on_sleep=True), {}
    local = reshard.global_weight_state(stage, spec, groups)
    names = list(hc.hf_to_mcore_name_map(spec))  # the trainer's global names; the engine's may differ
    mine = {g for g in names if hc.owner_stage(g, spec, groups.pp) == groups.pp_rank}
    full = engine.own_weight_bytes()
    res["pp2_shared"] = _shared_handoff(engine, stage, spec, groups)
    param = lambda g: engine.params[engine._own_name(g)]  # noqa: E731
    res["pp2_aliases"] = {g: g in local and param(g).untyped_storage() is local[g].untyped_storage() for g in names}
    res["pp2_mine"], res["pp2_bytes"] = mine, (full, engine.own_weight_bytes(),
                                               sum(local[g].nbytes for g in mine))
    engine.sleep()  # stashes the engine's own half only
    _step(stage, opt, 1)
    res["pp2_after_step"] = _shared_handoff(engine, stage, spec, groups)
    res["pp2_greedy"] = (_greedy(engine), _copied_greedy(stage, spec, groups, 1, "float32"))
    # a received tensor stored wrong is caught: the other stage's layers are still verified
    theirs = next(g for g in names if g not in mine and g.endswith("linear_fc2.weight"))
    real = engine.layout_digests

    def corrupt_then_read(sent, into):
        sent = list(sent)
        if theirs in sent:
            param(theirs).view(-1)[3] += 1.0
        real(sent, into)

    engine.layout_digests = corrupt_then_read
    try:
        reshard.update_engine_weights(engine, stage, spec, groups, 1)
        res["pp2_corrupt_error"] = None
    except reshard.HandoffError as e:
        res["pp2_corrupt_error"] = (theirs, str(e))
    return res


@pytest.mark.distributed
def test_pp2_bf16_stages_take_the_same_path(runs):
    """With fp32 norms in a bf16 model (the local spec's) both stages choose the same handoff (the second stage
    chose HF buckets from its first parameter, a norm, while the first read its stage: they waited in different
    collectives), and a stage receives the other's norms as fp32 (the HF export, the buckets, the layout path's
    scratch all received them into bf16 buffers: the export broke on it)."""
    for res in runs:
        paths = res["pp2_bf16"]
        assert paths["stage_read"][:3] == (True, True, True) and paths["copied"][:3] == (True, False, True), paths
        assert paths["rollout_tp2"][:3] == (True, False, True), paths  # an fp32 norm through the bf16 scratch
        assert paths["hf_buckets"][:3] == (True, False, False), paths  # an fp32 norm beside the bf16 bucket
        for key, (_, _, _, dtypes, exact) in paths.items():
            assert dtypes == {"torch.bfloat16", "torch.float32"} and not exact, (key, dtypes, exact)


@pytest.mark.distributed
def test_pp2_a_te_trainers_bf16_norms_go_into_the_engines_fp32_ones(runs):
    """A Transformer Engine trainer holds its norms in bf16, the local-spec engine in fp32: each tensor moves in the
    trainer's dtype and is stored in the engine's (the layout path gathered or broadcast bf16 norms into fp32
    parameters, and digested the bf16 source against the fp32 read-back), on every path PP 2 takes; the stage that
    reads its own tensors holds its own norms as the trainer does."""
    for res in runs:
        paths = res["pp2_te_norms"]
        assert paths["stage_read"][:3] == (True, True, True) and paths["copied"][:3] == (True, False, True), paths
        assert paths["rollout_tp2"][:3] == (True, False, True) and paths["hf_buckets"][:3] == (True, False, False)
        for key, (_, _, _, dtypes, exact) in paths.items():
            assert dtypes == {"torch.bfloat16", "torch.float32"} and not exact, (key, dtypes, exact)


def _run(folder):
    return {**_tp2(folder), **_tp1_and_pp2()}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    return run_distributed(_run, 2, str(tmp_path_factory.mktemp("ckpt")))


@pytest.mark.distributed
def test_engine_reads_the_actors_storages_and_copies_nothing(runs):
    for res in runs:
        for key in ("first", "tp1"):
            report = res[key]["report"]
            assert report.shared and report.verified and report.verify == "identity", key
            assert res[key]["copied_bytes"] == 0 and report.total_bytes == 0, key
            assert report.peak_extra_bytes < 4096, "no bucket, no digest: nothing but a few scalars"
        assert res["same_storage"] and res["tp1_same_storage"]
        assert res["own_freed"] and res["own_bytes"] == 0, "the engine's own copy must be gone"


@pytest.mark.distributed
@pytest.mark.parametrize("when", ["step", "onload", "resume", "reshared"])
def test_greedy_on_shared_weights_equals_a_copied_engine(runs, when):
    for res in runs:
        shared, copied = res[f"greedy_{when}"]
        assert torch.equal(shared, copied)
        if when != "step":
            key = {"onload": "after_onload", "resume": "after_resume", "reshared": "reshared"}[when]
            assert res[key]["report"].shared and res[key]["copied_bytes"] == 0
    shared, copied = runs[0]["tp1_greedy"]
    assert torch.equal(shared, copied)


@pytest.mark.distributed
def test_generation_keeps_the_shared_params_on_the_device(runs):
    for res in runs:
        assert res["offloaded_error"] is not None and "offloaded" in res["offloaded_error"]
        assert res["gen_keeps"] > 0
        assert torch.equal(res["greedy_gen_phase"], res["greedy_step"][1])  # the same weights as after step 1


@pytest.mark.distributed
def test_a_replaced_parameter_fails_the_identity_check(runs):
    for res in runs:
        error = res["replaced_error"]
        assert error is not None and VICTIM in error and "release_shared" in error


@pytest.mark.distributed
def test_pp2_engine_reads_its_stage_and_verifies_the_other(runs):
    """PP 2, rollout TP 1: each rank's engine aliases the layers of its own stage (no copy of them, none kept) and
    copies the other stage's, whose read-back is still checked; greedy decoding equals a fully copied engine."""
    for res in runs:
        mine, aliases = res["pp2_mine"], res["pp2_aliases"]
        assert mine and len(mine) < len(aliases)
        assert all(aliases[g] == (g in mine) for g in aliases), aliases
        for key in ("pp2_shared", "pp2_after_step"):
            report = res[key]["report"]
            assert report.stage_shared and not report.shared and report.verified and report.verify == "fingerprint"
            assert res[key]["copied_bytes"] == 0, "the broadcast writes the other stage's layers in place"
        full, own, stage_bytes = res["pp2_bytes"]
        assert own == full - stage_bytes and 0 < own < full
        assert res["pp2_shared"]["report"].total_bytes == own
        shared, copied = res["pp2_greedy"]
        assert torch.equal(shared, copied)
        name, error = res["pp2_corrupt_error"]
        assert name not in mine and name in error and "differs from what was sent" in error
    assert torch.equal(runs[0]["pp2_greedy"][0], runs[1]["pp2_greedy"][0])


@pytest.mark.distributed
@pytest.mark.parametrize("key", ["rollout_tp1", "fp32_engine", "pp2"])
def test_layouts_that_cannot_share_take_the_verified_copy(runs, key):
    for res in runs:
        report, own_bytes = res[key][:2]
        assert not report.shared and report.verified and report.verify == "fingerprint"
        assert report.total_bytes > 0 and own_bytes > 0
        if len(res[key]) == 3:
            assert not res[key][2]
