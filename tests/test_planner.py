"""Layout planner: process groups equal megatron-core's, memory formulas by hand and against a
measured CPU training step, and refusals that name the fix."""
import json
import os

import pytest

from dist_helper import run_distributed

from hybridrl.planner import memory as mem
from hybridrl.config import ActorConfig, Config, ConfigError, DataConfig, ModelConfig, RolloutConfig
from hybridrl.config.io import load_config
from hybridrl.config.layout import model_dims
from hybridrl.planner.plan import PlanError, estimate, plan, rank_groups

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIGS = os.path.join(ROOT, "configs")


# --- process groups -------------------------------------------------------------------------------

@pytest.mark.parametrize("world,tp,pp", [(8, 2, 2), (16, 2, 4), (64, 8, 4), (12, 3, 2), (8, 1, 8), (8, 8, 1)])
def test_rank_groups_equal_megatron_rank_generator(world, tp, pp):
    from megatron.core.parallel_state import RankGenerator

    gen = RankGenerator(tp=tp, ep=1, dp=world // (tp * pp), pp=pp, cp=1, order="tp-cp-ep-dp-pp")
    groups = rank_groups(world, tp, pp)
    for name in ("tp", "pp", "dp"):
        assert [list(g) for g in getattr(groups, name)] == gen.get_ranks(name), name


@pytest.mark.parametrize("world,tp,pp,cp,ep", [(8, 2, 1, 2, 1), (16, 2, 2, 2, 1), (8, 1, 2, 2, 2), (16, 2, 1, 4, 2)])
def test_rank_groups_with_context_parallel_equal_megatron_rank_generator(world, tp, pp, cp, ep):
    from megatron.core.parallel_state import RankGenerator

    dp = world // (tp * pp * cp)
    gen = RankGenerator(tp=tp, ep=1, dp=dp, pp=pp, cp=cp, order="tp-cp-ep-dp-pp")
    experts = RankGenerator(tp=tp, ep=ep, dp=dp * cp // ep, pp=pp, cp=1, order="tp-cp-ep-dp-pp")
    groups = rank_groups(world, tp, pp, ep=ep, cp=cp)
    for name in ("tp", "pp", "dp", "cp"):
        assert [list(g) for g in getattr(groups, name)] == gen.get_ranks(name), name
    assert [list(g) for g in groups.ep] == experts.get_ranks("ep")


def test_rank_groups_by_hand():
    g = rank_groups(8, 2, 2, rollout_tp=4)  # dp = 2: rank = tp_rank + 2 dp_rank + 4 pp_rank
    assert g.tp == ((0, 1), (2, 3), (4, 5), (6, 7))
    assert g.dp == ((0, 2), (1, 3), (4, 6), (5, 7))
    assert g.pp == ((0, 4), (1, 5), (2, 6), (3, 7))
    assert g.rollout_tp == ((0, 1, 2, 3), (4, 5, 6, 7))


def _megatron_groups(layouts):
    """The TP/PP/DP ranks of this process under megatron-core's parallel_state, per (tp, pp)."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    out = []
    for tp, pp in layouts:
        ps.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp)
        out.append({name: dist.get_process_group_ranks(group()) for name, group in (
            ("tp", ps.get_tensor_model_parallel_group), ("pp", ps.get_pipeline_model_parallel_group),
            ("dp", ps.get_data_parallel_group))})
        ps.destroy_model_parallel()
    return dist.get_rank(), out


def _check_against_processes(world, layouts, results):
    for rank, per_layout in results:
        for (tp, pp), got in zip(layouts, per_layout):
            groups = rank_groups(world, tp, pp)
            for name in ("tp", "pp", "dp"):
                mine = next(list(g) for g in getattr(groups, name) if rank in g)
                assert got[name] == mine, (world, tp, pp, name, rank)


@pytest.mark.distributed
def test_rank_groups_equal_parallel_state_world4():
    layouts = [(2, 2), (1, 2), (2, 1)]
    _check_against_processes(4, layouts, run_distributed(_megatron_groups, 4, layouts))


@pytest.mark.distributed
def test_rank_groups_equal_parallel_state_world8():
    layouts = [(2, 2)]
    _check_against_processes(8, layouts, run_distributed(_megatron_groups, 8, layouts))


# --- formulas by hand -----------------------------------------------------------------------------

ARCH = mem.Arch(num_layers=4, hidden_size=8, num_attention_heads=2, num_key_value_heads=1, head_dim=4,
                intermediate_size=16, vocab_size=200, tie_word_embeddings=False, qkv_bias=True)


def test_param_counts_by_hand():
    # qkv 8*(8+4+4) + bias 16, proj 8*8, mlp 3*8*16, two norms 2*8
    assert mem.layer_params(ARCH, 1) == 128 + 16 + 64 + 384 + 16
    assert mem.layer_params(ARCH, 2) == (128 + 16 + 64 + 384) // 2 + 16
    assert ARCH.padded_vocab(1) == 256 and ARCH.padded_vocab(2) == 256 and ARCH.padded_vocab(3) == 384
    layer = mem.layer_params(ARCH, 1)
    assert mem.stage_params(ARCH, 1, 1, 0) == 4 * layer + 256 * 8 + 8 + 256 * 8
    tied = mem.Arch(**{**ARCH.__dict__, "tie_word_embeddings": True})
    assert mem.stage_params(tied, 1, 1, 0) == 4 * layer + 256 * 8 + 8
    assert mem.stage_params(tied, 1, 2, 1) == 2 * layer + 8 + 256 * 8  # megatron's tied copy on the last stage
    assert mem.stage_params(ARCH, 1, 2, 1, critic=True) == 2 * layer + 8 + 9
    assert mem.total_params(tied) == 4 * layer + 200 * 8 + 8


def test_training_state_bytes_follow_megatron_table():
    per_param = lambda dtype, dp, dist: sum(mem.training_state_bytes(1, dtype, dp, dist).values())
    assert per_param("bfloat16", 4, False) == 18 and per_param("bfloat16", 4, True) == 6 + 12 / 4
    assert per_param("float32", 8, False) == 16 and per_param("float32", 8, True) == 8 + 8 / 8


def test_activation_bytes_by_hand():
    s, b, h, a, g, d, f = 10, 2, 8, 2, 1, 4, 16
    fp32 = mem.layer_activation_bytes(ARCH, s, b, 1, "float32")
    # SDPA attention: Q, context and K, V at their g heads, the fp32 log-sum-exp; no s x s scores
    assert fp32 == (6 * s * b * h + 2 * s * b * (a + g) * d + 5 * s * b * f) * 4 + 4 * s * b * a
    bf16_tp2 = mem.layer_activation_bytes(ARCH, s, b, 2, "bfloat16")
    assert bf16_tp2 == 6 * s * b * h * 2 + (2 * s * b * (a + g) * d + 5 * s * b * f) * 2 / 2 + 4 * s * b * a / 2
    mask = b * s * s * 4  # one additive mask per micro batch, shared by its layers
    full = mem.stage_activation_bytes(ARCH, s, b, 1, 2, 2, False, "float32")
    assert full == 2 * (2 * fp32 + mask)  # 2 layers per stage x 2 micro batches in flight
    recompute = mem.stage_activation_bytes(ARCH, s, b, 1, 2, 2, True, "float32")
    assert recompute == 2 * 2 * s * b * h * 4 + fp32 + mask
    assert mem.kv_bytes_per_token(ARCH, 2, 1, "bfloat16") == 2 * 4 * 1 * 4 * 2  # 1 KV head kept per rank


@pytest.mark.parametrize("grad,entropy,chunk", [(True, True, 1 << 23), (True, False, 1 << 23),
                                               (False, True, 1 << 23), (True, True, 2048), (False, True, 2048)])
def test_loss_side_bytes_are_the_measured_peak_of_the_log_prob_function(grad, entropy, chunk, monkeypatch):
    """The planner's loss side equals the peak of new storage while the real log-prob / entropy
    function runs forward (and backward) over a response slice of the logits, as the actor calls it,
    in one chunk or many. Before it worked in chunks it held 7 vocab-wide fp32 tensors at once."""
    import torch

    from hybridrl.models import logprobs
    from hybridrl.placement.reshard import LiveTensorMeter
    from hybridrl.workers.actor import response_positions

    monkeypatch.setattr(logprobs, "CHUNK_ELEMENTS", chunk)
    monkeypatch.setattr(mem, "CHUNK_ELEMENTS", chunk)
    b, s, r = 3, 20, 12
    vp = ARCH.padded_vocab(1)
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(b, s, vp, generator=g).requires_grad_(grad)
    labels = torch.randint(0, ARCH.vocab_size, (b, r), generator=g)
    with torch.set_grad_enabled(grad), LiveTensorMeter() as meter:
        lp, ent = logprobs.vocab_parallel_token_stats(response_positions(logits, r), labels, None, ARCH.vocab_size,
                                                      0.7, entropy)
        if grad:
            (lp.sum() + (ent.sum() if entropy else 0)).backward()
    planned = mem.loss_side_bytes(ARCH, s, r, b, 1, "float32", grad)  # with grad: logits.grad included
    assert meter.peak == pytest.approx(planned, rel=0.02, abs=4096)


@pytest.mark.parametrize("model_type, kv", [("qwen2", 32), ("mixtral", 8), ("llama", 4)])
def test_model_dims_take_transformers_default_kv_heads(tmp_path, model_type, kv):
    """A config.json without num_key_value_heads: the planner sizes the K/V heads transformers (and the model
    build, models/hf_config.py) would use, not the query head count."""
    import json

    (tmp_path / "config.json").write_text(json.dumps({"model_type": model_type, "num_attention_heads": 4,
                                                      "hidden_size": 64, "num_hidden_layers": 2, "vocab_size": 10}))
    assert model_dims(ModelConfig(path=str(tmp_path))).num_key_value_heads == kv


def test_model_dims_placeholder_path(tmp_path):
    model = ModelConfig(path="/path/to/Nowhere", hidden_size=32, num_layers=3, vocab_size=99)
    with pytest.raises(ConfigError, match="no config.json"):
        model_dims(model)
    assert model_dims(model, allow_missing_path=True).num_layers == 3
    hf = dict(model_type="llama", num_hidden_layers=5, hidden_size=64, num_attention_heads=4,
              num_key_value_heads=2, intermediate_size=96, vocab_size=300, tie_word_embeddings=True)
    (tmp_path / "config.json").write_text(json.dumps(hf))
    real = ModelConfig(path=str(tmp_path))
    assert model_dims(real, allow_missing_path=True).num_layers == 5  # an existing folder still wins
    arch = mem.arch_from_model_config(real)
    assert (arch.num_layers, arch.intermediate_size, arch.qkv_bias, arch.tie_word_embeddings) == (5, 96, False, True)


# --- estimate vs a measured CPU step --------------------------------------------------------------

TINY = dict(hidden_size=256, num_layers=4, num_attention_heads=8, num_key_value_heads=2, intermediate_size=688,
            vocab_size=1000)
SEQ, MICRO = 256, 4


def _measured_step_bytes():
    """Bytes of params, grads and AdamW states of one forward + backward + AdamW step of a megatron
    GPTModel, and its activations: the peak of new storage (LiveTensorMeter) while the forward, the
    actor's fused log-prob / entropy function over the response (`models.logprobs`, as the planner
    models it) and the backward run, the grads allocated before (as megatron's grad buffer is)."""
    import torch

    from hybridrl.models.gpt import GPTSpec, build_gpt
    from hybridrl.models.logprobs import vocab_parallel_token_stats
    from hybridrl.parallel.distributed import init_model_parallel
    from hybridrl.placement.reshard import LiveTensorMeter
    from hybridrl.workers.actor import response_positions

    init_model_parallel(1, 1)
    spec = GPTSpec(max_position_embeddings=SEQ, qkv_bias=True, tie_word_embeddings=False, **TINY)
    model = build_gpt(spec, tp=1, pp=1, pp_rank=0)
    params = list(model.parameters())
    for p in params:
        p.grad = torch.zeros_like(p)
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, spec.vocab_size, (MICRO, SEQ), generator=g)
    position_ids = torch.arange(SEQ).unsqueeze(0).expand(MICRO, SEQ)
    causal = torch.triu(torch.ones(1, 1, SEQ, SEQ, dtype=torch.bool), diagonal=1)
    response = SEQ // 2  # _tiny_config's max_response_length
    with LiveTensorMeter() as meter:
        logits = model(tokens, position_ids, causal)  # [B, S, V_padded]
        log_probs, entropy = vocab_parallel_token_stats(response_positions(logits, response), tokens[:, -response:],
                                                        None, spec.vocab_size, 1.0, True)
        loss = -log_probs.mean() - 0.01 * entropy.mean()
        loss.backward()
        del logits, log_probs, entropy, loss
    opt = torch.optim.AdamW(params, lr=1e-3)
    opt.step()
    nbytes = lambda ts: sum(t.numel() * t.element_size() for t in ts)
    states = [v for s in opt.state.values() for v in s.values() if torch.is_tensor(v)]
    return dict(weights=nbytes(params), grads=nbytes(p.grad for p in params), optimizer=nbytes(states),
                activations=meter.peak)


def _tiny_config(**model):
    return Config(data=DataConfig(max_prompt_length=SEQ // 2, max_response_length=SEQ // 2, train_batch_size=4),
                  model=ModelConfig(architecture="qwen2", tie_word_embeddings=False, params_dtype="float32",
                                    max_position_embeddings=SEQ, **{**TINY, **model}),
                  actor=ActorConfig(ppo_mini_batch_size=4, ppo_micro_batch_size_per_gpu=MICRO),
                  rollout=RolloutConfig(name="native", n=1))


@pytest.mark.distributed
def test_estimate_within_10_percent_of_measured_step():
    measured = run_distributed(_measured_step_bytes, 1)[0]
    phase = estimate(_tiny_config(), 1).phase("actor update")
    estimated = {k: phase.bytes(f"actor/{k}") for k in ("weights", "grads", "optimizer")}
    estimated["activations"] = phase.bytes("actor/activations") + phase.bytes("actor/logits")
    for k in ("weights", "grads"):
        assert estimated[k] == pytest.approx(measured[k], rel=0.03), k  # vocab padding only
    total_measured, total_estimated = sum(measured.values()), sum(estimated.values())
    print(f"\nmeasured {measured} = {total_measured / 2**20:.1f} MiB; "
          f"estimated {estimated} = {total_estimated / 2**20:.1f} MiB")
    assert estimated["activations"] == pytest.approx(measured["activations"], rel=0.1)
    assert total_estimated == pytest.approx(total_measured, rel=0.1)


def test_native_kv_cache_counts_the_engine_slots():
    """K and V of every layer for each of min(rollout.max_num_seqs, samples per step) sequences, by hand."""
    import dataclasses

    cfg = _tiny_config()  # 4 samples per step on one GPU
    per_seq = 2 * TINY["num_layers"] * TINY["num_key_value_heads"] * (256 // 8) * 4 * SEQ  # fp32, head_dim 32
    for slots, expect in ((256, 4), (2, 2)):
        c = dataclasses.replace(cfg, rollout=dataclasses.replace(cfg.rollout, max_num_seqs=slots))
        p = estimate(c, 1)
        assert p.phase("rollout").bytes("rollout/kv_cache") == per_seq * expect
        assert (p.kv_cache.bytes, p.kv_cache.sequences_needed) == (per_seq * expect, expect)


# --- planned states vs what a real trainer holds, phase by phase ----------------------------------

PHASE_CALLS = {"rollout": ("rollout", "generate"), "actor log-prob": ("actor", "compute_token_stats"),
               "ref log-prob": ("ref", "compute_log_prob"), "critic values": ("critic", "compute_values"),
               "critic update": ("critic", "update_critic"), "actor update": ("actor", "update_policy"),
               "weight sync": ("rollout", "share_shards")}
"""The call each planner phase is measured in: the trainer has entered the phase when it runs."""


def _held_per_phase(offload: bool) -> tuple:
    """Two GAE steps with a reference (KL in the reward) of the tiny config, every offload flag set to
    `offload`; at each phase's call, the bytes of each role's storages on the device (step 2)."""
    import tempfile

    from hybridrl.config.io import load_config
    from hybridrl.planner.plan import STATE_KINDS
    from hybridrl.rewards import RewardManager
    from hybridrl.trainer.roles import build_roles
    from hybridrl.trainer.ppo import PPOTrainer
    from hybridrl.trainer.loop import setup_run

    tmp, on = tempfile.mkdtemp(), str(offload).lower()
    cfg = load_config(os.path.join(CONFIGS, "tiny_cpu.yaml"), [
        f"data.train_files=[{tmp}/train.parquet]", f"data.val_files=[{tmp}/test.parquet]", "data.train_batch_size=4",
        "actor.ppo_mini_batch_size=4", "critic.ppo_mini_batch_size=4", "rollout.n=2", "algorithm.adv_estimator=gae",
        "algorithm.use_kl_in_reward=true", f"ref.offload_params={on}", "rollout.free_cache_engine=true",
        "critic.ppo_epochs=2"]  # two critic epochs: the values come from a pass of their own
        + [f"{role}.offload.{part}={on}" for role in ("actor", "critic") for part in ("params", "grads", "optimizer")])
    _, tokenizer, layout, groups, loader, _ = setup_run(cfg)
    roles = build_roles(cfg, groups, tokenizer, 2)
    trainer = PPOTrainer(cfg, layout, groups, tokenizer, roles, RewardManager(cfg.reward), writer=None)
    trainer.rollout.offload_weights_on_sleep = True  # as on a GPU: the sleeping engine leaves the device
    held = {}

    def now() -> dict:
        out = {f"{k.split('/')[0]}/{STATE_KINDS[k.split('/')[1]]}": n for k, n in trainer.hybrid.device_bytes().items()}
        out["rollout/engine_weights"] = trainer.rollout.own_weight_bytes()  # none: it reads the actor's
        return out

    def measure(phase, fn):
        def wrapped(*args, **kwargs):  # the most of each consumer before and after (a load wakes the engine)
            before = now()
            out = fn(*args, **kwargs)
            held[phase] = {k: max(n, before[k]) for k, n in now().items()}
            return out
        return wrapped

    for phase, (owner, method) in PHASE_CALLS.items():
        obj = trainer.rollout if owner == "rollout" else getattr(roles, owner)
        setattr(obj, method, measure(phase, getattr(obj, method)))
    trainer.sync_rollout_weights()
    batches = iter(loader)
    for step in (1, 2):  # Adam states exist from the first update on
        trainer.train_step(next(batches), step)
    return cfg, roles.spec.vocab_size, held


@pytest.mark.distributed
@pytest.mark.parametrize("offload", [True, False])
def test_planned_states_are_what_the_trainer_holds_in_each_phase(offload):
    """Per phase, the weights, grads and Adam states of every role and the engine's weights that the
    planner counts are the bytes the trainer keeps on the device (AdamW's step counters aside)."""
    cfg, vocab, held = run_distributed(_held_per_phase, 1, offload)[0]
    planned = estimate(cfg, 1, vocab)
    assert [p.name for p in planned.phases] == list(PHASE_CALLS)  # the trainer's phases, in its order
    for phase in planned.phases:
        for consumer, measured in held[phase.name].items():
            assert phase.bytes(consumer) == pytest.approx(measured, rel=0.01, abs=1024), (phase.name, consumer)
    if offload:  # grads and Adam states idle off the device outside the updates, the sync included
        assert held["weight sync"]["actor/grads"] == held["actor log-prob"]["actor/optimizer"] == 0
        assert held["weight sync"]["actor/weights"] > 0 and held["rollout"]["actor/weights"] > 0
    # TP 1 = rollout TP 1: the engine reads the actor's weights, kept on the device while it generates
    assert held["weight sync"]["rollout/engine_weights"] == held["rollout"]["rollout/engine_weights"] == 0


def test_no_values_phase_where_the_critic_update_gives_the_values():
    """One critic step per batch: the trainer takes the values from the critic update's forward, so
    the plan has no critic values phase; with two critic epochs it has one."""
    names = lambda *o: [p.name for p in estimate(_size_config("qwen2_7b.yaml", *o), 16).phases]  # noqa: E731
    one_step = names("critic.ppo_mini_batch_size=512")  # the whole batch of 512 prompts
    assert "critic values" not in one_step and "critic update" in one_step
    assert "critic values" in names() and "critic values" in names("critic.ppo_mini_batch_size=512",
                                                                   "critic.ppo_epochs=2")


# --- refusals and the command line ----------------------------------------------------------------

def _size_config(name, *overrides):
    return load_config(os.path.join(CONFIGS, name), list(overrides))


def test_72b_on_two_nodes_is_refused_with_the_fix():
    cfg = _size_config("qwen2_72b.yaml", "parallel.pipeline_model_parallel_size=2", "parallel.sequence_parallel=false")
    with pytest.raises(PlanError, match=r"(?s)biggest consumer actor/optimizer.*pipeline_model_parallel_size"):
        plan(cfg, 16)
    cfg = _size_config("qwen2_72b.yaml", "parallel.pipeline_model_parallel_size=1",
                       "parallel.use_distributed_optimizer=false")
    with pytest.raises(PlanError, match="set parallel.use_distributed_optimizer=true"):
        plan(cfg, 8)
    assert not estimate(cfg, 8).fits


def test_activation_heavy_layout_suggests_recompute_and_micro_batch():
    cfg = _size_config("qwen2_0.5b.yaml", "actor.ppo_micro_batch_size_per_gpu=40")
    with pytest.raises(PlanError, match=r"actor/activations.*recompute_activations=true.*ppo_micro_batch_size_per_gpu"):
        plan(cfg, 8)
    assert plan(_size_config("qwen2_0.5b.yaml", "actor.ppo_micro_batch_size_per_gpu=40",
                             "parallel.recompute_activations=true"), 8).fits


def test_rollout_pool_and_kv_cache_refusals():
    # the config offloads the idle actor state; kept resident, it no longer fits beside a 0.9 pool
    cfg = _size_config("llama3_8b.yaml", "rollout.gpu_memory_utilization=0.9", "actor.offload.params=false",
                       "actor.offload.grads=false", "actor.offload.optimizer=false")
    with pytest.raises(PlanError, match=r"phase 'rollout'.*rollout/vllm_pool.*lower rollout.gpu_memory_utilization"):
        plan(cfg, 8)
    cfg = _size_config("qwen2_72b.yaml", "rollout.gpu_memory_utilization=0.2")
    with pytest.raises(PlanError, match="KV cache.*raise rollout.gpu_memory_utilization"):
        plan(cfg, 32)


def test_offload_flags_move_states_out_of_the_rollout_phase():
    kept = estimate(_size_config("llama3_8b.yaml", "actor.offload.params=false", "actor.offload.grads=false",
                                 "actor.offload.optimizer=false"), 8)
    offloaded = estimate(_size_config("llama3_8b.yaml", "actor.offload.params=false"), 8)
    assert kept.phase("rollout").bytes("actor/optimizer") > 0
    assert offloaded.phase("rollout").bytes("actor/optimizer") == 0
    assert offloaded.phase("rollout").bytes("actor/weights") == kept.phase("rollout").bytes("actor/weights")
    assert offloaded.phase("actor update").total == kept.phase("actor update").total  # in use: on the GPU
    assert offloaded.peak.total == max(p.total for p in offloaded.phases)


def test_plan_layout_script(capsys):
    import runpy

    main = runpy.run_path(os.path.join(ROOT, "scripts", "plan_layout.py"))["main"]
    assert main(["--config", os.path.join(CONFIGS, "qwen2_7b.yaml"), "--nodes", "2"]) == 0
    out = capsys.readouterr().out
    assert "TP             4 x 4: [0,1,2,3] [4,5,6,7] [8,9,10,11] [12,13,14,15]" in out
    assert "DP             4 x 4: [0,4,8,12]" in out and "<- peak" in out and ": fits" in out
    assert main(["--config", os.path.join(CONFIGS, "qwen2_72b.yaml"), "--nodes", "2",
                 "parallel.pipeline_model_parallel_size=2", "parallel.sequence_parallel=false"]) == 2
    captured = capsys.readouterr()
    assert "DOES NOT FIT" in captured.out and "error: layout does not fit" in captured.err
    assert main(["--config", os.path.join(CONFIGS, "qwen2_72b.yaml"), "--nodes", "1"]) == 2  # tp*pp = 32 > 8
    assert "not divisible by tp (8) * cp (1) * pp (4)" in capsys.readouterr().err


def test_reward_model_phase_weights_and_offload(tmp_path):
    base = ("reward_model.enable=true", f"reward_model.path={tmp_path / 'rm'}", "reward_model.micro_batch_size_per_gpu=4")
    kept = estimate(_size_config("qwen2_7b.yaml", *base), 8)
    offloaded = estimate(_size_config("qwen2_7b.yaml", *base, "reward_model.offload_params=true"), 8)
    assert "reward model" not in [p.name for p in estimate(_size_config("qwen2_7b.yaml"), 8).phases]
    lay, cfg = kept.layout, _size_config("qwen2_7b.yaml", *base)
    arch = mem.arch_from_model_config(cfg.model)  # no config.json at the path yet: the actor's architecture
    weights = mem.stage_params(arch, lay.tp, lay.pp, 0, critic=True) * mem.BYTES_PER_ELEMENT[cfg.model.params_dtype]
    scoring = kept.phase("reward model")
    assert scoring.bytes("reward_model/weights") == weights
    seq = cfg.data.max_prompt_length + cfg.data.max_response_length
    assert scoring.bytes("reward_model/forward") == mem.forward_bytes(arch, seq, 4, lay.tp, cfg.model.params_dtype,
                                                                      last_stage=lay.pp == 1, scalar_head=True)
    assert kept.phase("rollout").bytes("reward_model/") == weights  # idle but resident
    assert offloaded.phase("rollout").bytes("reward_model/") == 0  # offload_params: on the host while idle
    assert offloaded.phase("reward model").total == scoring.total
    # a reward model of its own size is counted from its config.json
    (tmp_path / "rm").mkdir()
    small = dict(model_type="qwen2", num_hidden_layers=2, hidden_size=256, num_attention_heads=4, num_key_value_heads=2,
                 intermediate_size=512, vocab_size=1000)
    (tmp_path / "rm" / "config.json").write_text(json.dumps(small))
    own = estimate(_size_config("qwen2_7b.yaml", *base), 8).phase("reward model").bytes("reward_model/weights")
    rm_arch = mem.arch_from_model_config(ModelConfig(path=str(tmp_path / "rm")))
    assert own == mem.stage_params(rm_arch, lay.tp, lay.pp, 0, critic=True) * mem.BYTES_PER_ELEMENT[cfg.model.params_dtype]
    assert own < weights / 100


def test_token_budget_sizes_the_planned_micro_batches():
    """With use_dynamic_bsz a micro-batch computes at most *_max_token_len_per_gpu positions, so the
    planner sizes activations by the budget (budget / full width rows), not by the row counts."""
    seq = 512 + 1024  # qwen2_0.5b.yaml: max_prompt_length + max_response_length
    fixed = estimate(_size_config("qwen2_0.5b.yaml", "actor.ppo_micro_batch_size_per_gpu=2",
                                  "actor.log_prob_micro_batch_size_per_gpu=2"), 8)
    budget = estimate(_size_config("qwen2_0.5b.yaml", "actor.use_dynamic_bsz=true",
                                   f"actor.ppo_max_token_len_per_gpu={2 * seq}",
                                   f"actor.log_prob_max_token_len_per_gpu={2 * seq}",
                                   "actor.ppo_micro_batch_size_per_gpu=16"), 8)
    for phase, item in (("actor update", "actor/activations"), ("actor update", "actor/logits"),
                        ("actor log-prob", "actor/forward")):
        assert budget.phase(phase).bytes(item) == pytest.approx(fixed.phase(phase).bytes(item), rel=1e-12)
    doubled = estimate(_size_config("qwen2_0.5b.yaml", "actor.use_dynamic_bsz=true",
                                    f"actor.ppo_max_token_len_per_gpu={4 * seq}"), 8)
    assert doubled.phase("actor update").bytes("actor/logits") == pytest.approx(
        2 * fixed.phase("actor update").bytes("actor/logits"), rel=1e-12)


def test_sequence_and_context_parallel_activation_terms_by_hand():
    """SP divides the norms' 6·s·b·h·e by TP; CP divides every token-wise term by CP and adds the gathered
    K and V of the other ranks; packed rows keep no mask. Hand numbers for a small dense layer (fp32)."""
    arch = mem.Arch(num_layers=2, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                    intermediate_size=96, vocab_size=1000, head_dim=16, tie_word_embeddings=False, qkv_bias=False)
    s, b, tp, e = 128, 2, 2, 4
    replicated = 6 * s * b * 64 * e
    sharded = (2 * s * b * 6 * 16 + 5 * s * b * 96) * e / tp
    lse = 4 * s * b * 4 / tp
    assert mem.layer_activation_bytes(arch, s, b, tp, "float32") == replicated + sharded + lse
    sp = mem.SeqSplit(sp=tp)
    assert mem.layer_activation_bytes(arch, s, b, tp, "float32", split=sp) == replicated / tp + sharded + lse
    cp = mem.SeqSplit(cp=2, packed=True)
    gathered = 2 * (s * b / 2) * 1 * 2 * 16 * e / tp  # the other rank's K and V: 2 KV heads of 16
    assert mem.layer_activation_bytes(arch, s, b, tp, "float32", split=cp) == (replicated + sharded + lse) / 2 + gathered
    assert mem.mask_bytes(s, b, "float32") == b * s * s * e and mem.mask_bytes(s, b, "float32", cp) == 0


def _measured_packed_step(cp: int):
    """This rank's activation peak (LiveTensorMeter, grads preallocated) of one packed forward + backward of the
    actor's per-token function through `pipeline_forward`, at context parallel size `cp`."""
    import torch

    from hybridrl.models.forward import pipeline_forward
    from hybridrl.models.gpt import GPTSpec, build_gpt
    from hybridrl.models.logprobs import vocab_parallel_token_stats
    from hybridrl.parallel.distributed import init_model_parallel
    from hybridrl.placement.reshard import LiveTensorMeter

    init_model_parallel(1, 1, cp=cp)
    spec = GPTSpec(max_position_embeddings=SEQ, qkv_bias=True, tie_word_embeddings=False, **TINY)
    model = build_gpt(spec, tp=1, pp=1, pp_rank=0, remove_padding=True, context_parallel_size=cp)
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, spec.vocab_size, (MICRO, SEQ), generator=g)
    batch = {"input_ids": tokens, "attention_mask": torch.ones_like(tokens), "response_mask": torch.ones(MICRO, SEQ // 2)}

    def token_fn(logits, labels):
        lp, ent = vocab_parallel_token_stats(logits, labels, None, spec.vocab_size, 1.0, True)
        return {"log_probs": lp, "entropy": ent}

    def loss_fn(t, mb):
        return -t["log_probs"][:, SEQ // 2 - 1:-1].mean() - 0.01 * t["entropy"][:, SEQ // 2 - 1:-1].mean(), {}

    with LiveTensorMeter() as meter:
        pipeline_forward(model, [batch], loss_fn, forward_only=False, token_fn=token_fn)
    return meter.peak


@pytest.mark.distributed
def test_packed_and_context_parallel_estimates_against_measured_steps():
    """The planner's packed activations (no mask) and their CP 2 share per rank (token-wise terms halved, the
    other rank's K/V added) against measured steps through pipeline_forward, within 15% (measured here: planned
    0.89x of the measured peak at CP 1 and 0.91x at CP 2; the packing's own copies - packed ids and labels, the
    per-token results unpacked to [B, S] - are not modelled), and CP 2 below 0.6x of CP 1 on both sides."""
    import dataclasses

    cfg = _tiny_config()
    planned = {}
    for cp in (1, 2):
        c = dataclasses.replace(cfg, parallel=dataclasses.replace(cfg.parallel, context_parallel_size=cp))
        phase = estimate(c, cp).phase("actor update")
        planned[cp] = phase.bytes("actor/activations") + phase.bytes("actor/logits")
    measured = {1: run_distributed(_measured_packed_step, 1, 1)[0], 2: max(run_distributed(_measured_packed_step, 2, 2))}
    print(f"\nplanned {planned}, measured {measured}")
    assert planned[1] == pytest.approx(measured[1], rel=0.15)
    assert planned[2] == pytest.approx(measured[2], rel=0.15)
    assert planned[2] / planned[1] < 0.6 and measured[2] / measured[1] < 0.6


@pytest.mark.parametrize("tied", [False, True])
def test_engine_copies_only_the_other_stages_where_it_reads_its_own(tied):
    """Colocated native rollout at rollout TP = TP and PP 2: on each stage the engine's own weights are the whole
    model at rollout TP less that stage's layers (and, on stage 0, the embedding; with untied embeddings the head
    on the last stage), counted by hand from the config; generation keeps the actor's weights; an exact check
    (HF buckets) or share_weights=false keeps the whole copy."""
    from hybridrl.planner.plan import _context, _engine_weights

    common = ["parallel.tensor_model_parallel_size=4", "parallel.pipeline_model_parallel_size=2",
              "rollout.tensor_model_parallel_size=4", "rollout.name=native",
              f"model.tie_word_embeddings={str(tied).lower()}"]
    ctx = _context(_size_config("qwen2_7b.yaml", *common), 16, 0)
    a, e = ctx.arch, 2  # bf16
    h, f, d = a.hidden_size, a.intermediate_size, a.hidden_size // a.num_attention_heads
    qkv = (a.num_attention_heads + 2 * a.num_key_value_heads) * d
    layer = (qkv * h + qkv + h * h + 3 * h * f) // 4 + 2 * h  # TP 4 shards; the norms whole
    vocab = a.padded_vocab(4) * h // 4
    whole = a.num_layers * layer + vocab + h + (0 if tied else vocab)
    half = a.num_layers // 2 * layer
    assert _engine_weights(ctx, 0) == (whole - half - vocab) * e
    assert _engine_weights(ctx, 1) == (whole - half - h - (0 if tied else vocab)) * e
    p = estimate(_size_config("qwen2_7b.yaml", *common), 16)
    assert any("its own pipeline stage" in n for n in p.notes)
    assert p.phase("rollout").bytes("actor/weights") > 0
    for other in ("rollout.verify_weights=exact", "rollout.share_weights=false"):
        ctx = _context(_size_config("qwen2_7b.yaml", *common, other), 16, 0)
        assert _engine_weights(ctx, 0) == _engine_weights(ctx, 1) == whole * e
