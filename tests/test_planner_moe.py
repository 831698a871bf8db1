"""Layout planner for MoE models (Qwen3-MoE, Mixtral) and Qwen3's q/k norms: parameter counts and the
EP sharding of optimizer states by hand, expert groups equal megatron-core's, and the planned
activations against what autograd saves in a real megatron MoE step on CPU."""
import json
import os

import pytest

from dist_helper import run_distributed

from hybridrl.config import ActorConfig, Config, DataConfig, ModelConfig, ParallelConfig, RolloutConfig
from hybridrl.config.io import load_config
from hybridrl.planner import memory as mem
from hybridrl.planner.plan import PlanError, estimate, plan, rank_groups

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIGS = os.path.join(ROOT, "configs")

# h 8, 2 heads of d 6 (not h / a: Qwen3's explicit head_dim), 1 KV head, 4 experts of f_e 5, top 2
MOE = mem.Arch(num_layers=4, hidden_size=8, num_attention_heads=2, num_key_value_heads=1, head_dim=6,
               intermediate_size=16, vocab_size=200, tie_word_embeddings=False, qkv_bias=False, qk_norm=True,
               num_experts=4, moe_topk=2, moe_intermediate_size=5)


# --- by hand --------------------------------------------------------------------------------------

def test_moe_param_counts_by_hand():
    attention = 8 * (12 + 6 + 6) + 12 * 8  # qkv (q 2x6, k 6, v 6) and proj
    replicated = 2 * 8 + 2 * 6 + 4 * 8  # two RMSNorms, q and k norms, router E x h
    expert = 3 * 8 * 5  # fused gate/up 2 f_e x h and down h x f_e
    assert mem.layer_expert_params(MOE, 1) == 4 * expert and mem.layer_expert_params(MOE, 1, ep=2) == 2 * expert
    assert mem.layer_params(MOE, 1) == attention + replicated + 4 * expert
    assert mem.layer_params(MOE, 1, ep=2) == attention + replicated + 2 * expert  # 2 of 4 experts per EP rank
    assert mem.layer_params(MOE, 2, ep=2) == attention // 2 + replicated + 2 * (expert // 2)  # expert TP = TP
    embedding = 256 * 8
    assert mem.stage_params(MOE, 1, 1, 0, ep=2) == 4 * mem.layer_params(MOE, 1, ep=2) + 2 * embedding + 8
    assert mem.total_params(MOE) == 4 * (attention + replicated + 4 * expert) + 2 * 200 * 8 + 8
    assert mem.active_params(MOE) == mem.total_params(MOE) - 4 * 2 * expert  # 2 of 4 experts idle per token
    dense = mem.Arch(**{**MOE.__dict__, "num_experts": 0, "moe_topk": 0, "moe_intermediate_size": 0})
    assert mem.layer_params(dense, 1) == attention + 3 * 8 * 16 + 2 * 8 + 2 * 6  # dense MLP, q/k norms
    assert mem.active_params(dense) == mem.total_params(dense)
    assert mem.largest_tensor_params(MOE, 1) == 256 * 8  # the head; an expert's fc1 is 2 x 5 x 8


def test_expert_optimizer_states_shard_over_expert_data_parallel():
    """Distributed optimizer at dp 4, ep 2: dense states over 4 ranks, experts' over the 2 holding them."""
    # by hand (test_moe_param_counts_by_hand): 4 layers of attention 288 + replicated 60 + 2 of 4 experts of 120,
    # both embeddings at the vocabulary padded to 256, the final norm
    n, experts = 4 * (288 + 60 + 2 * 120) + 2 * 256 * 8 + 8, 4 * 2 * 120
    assert (n, experts) == (mem.stage_params(MOE, 1, 1, 0, ep=2), 4 * mem.layer_expert_params(MOE, 1, ep=2)) == (6456, 960)
    states = mem.stage_state_bytes(MOE, 1, 1, 0, dp=4, ep=2, dtype="bfloat16", distributed_optimizer=True)
    assert states == {"weights": 2 * n, "grads": 4 * n, "optimizer": 12 * (n - experts) / 4 + 12 * experts / 2}
    # ep = dp: no two ranks hold the same experts, their states do not shard; without it nothing does
    full = mem.stage_state_bytes(MOE, 1, 1, 0, dp=2, ep=2, dtype="float32", distributed_optimizer=True)
    assert full["optimizer"] == 8 * (n - experts) / 2 + 8 * experts
    plain = mem.stage_state_bytes(MOE, 1, 1, 0, dp=4, ep=2, dtype="float32", distributed_optimizer=False)
    assert plain == {"weights": 4 * n, "grads": 4 * n, "optimizer": 8 * n}


def test_moe_activation_bytes_by_hand():
    s, b, h, a, g, d, k, E, f = 10, 2, 8, 2, 1, 6, 2, 4, 5
    sb = s * b
    attention = (6 * sb * h + 2 * sb * (a + g) * d + 3 * sb * d * (a + g)) * 4 + 4 * sb * a  # fp32, q/k norms
    routed = k * sb * (h + 6 * f) * 4 + sb * (24 * k + 5 * E)
    assert mem.layer_activation_bytes(MOE, s, b, 1, "float32") == attention + routed
    pre_softmax = mem.Arch(**{**MOE.__dict__, "norm_topk_prob": False})  # softmax over all E, not over the top k
    assert mem.routed_activation_bytes(pre_softmax, s, b, 1, "float32") == routed + 4 * sb * (E - k)
    assert mem.routed_activation_bytes(MOE, s, b, 1, "float32", aux_loss=True) == routed + sb * (4 * E + 8 * k)
    assert mem.routed_activation_bytes(MOE, s, b, 1, "bfloat16") == k * sb * (h + 6 * f) * 2 + sb * (24 * k + 5 * E)
    # the dispatch buffers grow with EP (the allgather dispatcher holds the EP group's tokens), saved ones do not
    assert mem.dispatch_bytes(MOE, s, b, 1, 4, "bfloat16") > mem.dispatch_bytes(MOE, s, b, 1, 1, "bfloat16") > 0
    assert mem.forward_bytes(MOE, s, b, 1, "bfloat16", ep=4) > mem.forward_bytes(MOE, s, b, 1, "bfloat16")


def _write_config(tmp_path, **fields):
    (tmp_path / "config.json").write_text(json.dumps(fields))
    return mem.arch_from_model_config(ModelConfig(path=str(tmp_path)))


def test_arch_from_qwen3_moe_and_mixtral_config_json(tmp_path):
    base = dict(num_hidden_layers=4, hidden_size=8, num_attention_heads=2, num_key_value_heads=1, vocab_size=200)
    qwen3_moe = _write_config(tmp_path, model_type="qwen3_moe", head_dim=6, intermediate_size=16, num_experts=4,
                              num_experts_per_tok=2, moe_intermediate_size=5, norm_topk_prob=True, **base)
    assert qwen3_moe == MOE
    mixtral = _write_config(tmp_path, model_type="mixtral", num_local_experts=4, num_experts_per_tok=2,
                            intermediate_size=5, **base)  # Mixtral's intermediate_size is one expert's
    assert (mixtral.num_experts, mixtral.moe_topk, mixtral.moe_intermediate_size, mixtral.norm_topk_prob,
            mixtral.qk_norm, mixtral.head_dim) == (4, 2, 5, True, False, 4)
    fields = ModelConfig(architecture="qwen3_moe", num_layers=4, hidden_size=8, num_attention_heads=2,
                         num_key_value_heads=1, head_dim=6, intermediate_size=16, vocab_size=200,
                         tie_word_embeddings=False, num_experts=4, moe_topk=2, moe_intermediate_size=5)
    assert mem.arch_from_model_config(fields) == MOE  # the random-init fields give the same architecture


# --- expert groups --------------------------------------------------------------------------------

@pytest.mark.parametrize("world,tp,pp,ep", [(8, 1, 1, 8), (16, 1, 2, 8), (8, 1, 1, 2), (16, 2, 2, 2), (8, 1, 2, 2)])
def test_expert_groups_equal_megatron_rank_generator(world, tp, pp, ep):
    from megatron.core.parallel_state import RankGenerator

    dp = world // (tp * pp)
    experts = RankGenerator(tp=tp, ep=ep, dp=dp // ep, pp=pp, cp=1, order="tp-cp-ep-dp-pp")  # expert TP = TP
    groups = rank_groups(world, tp, pp, ep=ep)
    assert [list(g) for g in groups.ep] == experts.get_ranks("ep")
    assert [list(g) for g in groups.expert_dp] == experts.get_ranks("dp")
    assert [list(g) for g in groups.dp] == RankGenerator(tp=tp, ep=1, dp=dp, pp=pp, cp=1,
                                                         order="tp-cp-ep-dp-pp").get_ranks("dp")


# --- estimate vs a measured CPU step --------------------------------------------------------------

SEQ, MICRO = 128, 4
TINY_MOE = dict(hidden_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=48,
                intermediate_size=256, vocab_size=500, max_position_embeddings=SEQ, num_experts=8,
                num_experts_per_tok=2, moe_intermediate_size=96, norm_topk_prob=True, tie_word_embeddings=False)


def _measured_moe_step_bytes(folder, ep):
    """This rank's params, grads, AdamW states and the activations the transformer layers save for
    backward (deduplicated by storage, parameters excluded; from the first layer's start to the final
    norm's) in one forward + backward + AdamW step of the project's MoE model; first, the peak of new
    storage while one MoE block runs forward without grad (megatron's global gather buffer included)."""
    import torch

    from hybridrl.models.hf_checkpoint import model_from_hf
    from hybridrl.parallel.distributed import init_model_parallel
    from hybridrl.placement.reshard import LiveTensorMeter

    model, spec = model_from_hf(folder, init_model_parallel(1, 1, ep=ep))
    normed = torch.randn(SEQ, MICRO, spec.hidden_size, generator=torch.Generator().manual_seed(ep))
    with torch.no_grad(), LiveTensorMeter() as meter:
        model.decoder.layers[0].mlp(normed)
    params = list(model.parameters())
    param_storages = {p.untyped_storage().data_ptr() for p in params}
    saved, in_layers = {}, [False]
    model.decoder.layers[0].register_forward_pre_hook(lambda *_: in_layers.__setitem__(0, True))
    model.decoder.final_layernorm.register_forward_pre_hook(lambda *_: in_layers.__setitem__(0, False))

    def pack(t):
        storage = t.untyped_storage()
        if in_layers[0] and storage.data_ptr() not in param_storages:
            saved[storage.data_ptr()] = storage.nbytes()
        return t

    g = torch.Generator().manual_seed(torch.distributed.get_rank())  # each EP rank routes its own tokens
    tokens = torch.randint(0, spec.vocab_size, (MICRO, SEQ), generator=g)
    position_ids = torch.arange(SEQ).unsqueeze(0).expand(MICRO, SEQ)
    causal = torch.triu(torch.ones(1, 1, SEQ, SEQ, dtype=torch.bool), diagonal=1)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        logits = model(tokens, position_ids, causal)  # [B, S, V_padded]
        log_probs = torch.log_softmax(logits.float(), dim=-1)[..., :spec.vocab_size]
        loss = -log_probs[:, :-1].gather(-1, tokens[:, 1:, None]).mean()
    loss.backward()
    opt = torch.optim.AdamW(params, lr=1e-3)
    opt.step()
    nbytes = lambda ts: sum(t.numel() * t.element_size() for t in ts)
    states = [v for s in opt.state.values() for v in s.values() if torch.is_tensor(v) and v.dim()]  # no step counters
    return dict(weights=nbytes(params), grads=nbytes(p.grad for p in params), optimizer=nbytes(states),
                activations=sum(saved.values()), moe_forward=meter.peak)


@pytest.mark.distributed
@pytest.mark.parametrize("ep", [1, 2])
def test_moe_estimate_matches_measured_step(tmp_path, ep):
    """Weights, grads and Adam states per rank within 1% (the vocabulary's padding); the layers' saved
    activations within 2% (left out: RoPE's cos/sin tables, RMSNorm statistics, the mask, all free of
    the hidden size). At EP 1 every token's k copies are on the rank; at EP 2 the copies routed to a
    rank's experts vary with the routing, but their mean over the EP group is exactly k per token, so
    the planned figure is compared with the mean over ranks. Likewise the working set of an MoE block's
    forward without grad: the permuted token copies and the dispatch buffers, within 3%."""
    from hybridrl.models.hf_checkpoint import random_hf_model_folder

    folder = random_hf_model_folder(str(tmp_path / "moe"), "qwen3_moe", **TINY_MOE)
    ranks = run_distributed(_measured_moe_step_bytes, ep, folder, ep)
    measured = {k: sum(r[k] for r in ranks) / ep for k in ranks[0]}
    cfg = Config(data=DataConfig(max_prompt_length=SEQ // 2, max_response_length=SEQ // 2, train_batch_size=ep),
                 model=ModelConfig(path=folder, params_dtype="float32"),
                 parallel=ParallelConfig(expert_model_parallel_size=ep),
                 actor=ActorConfig(ppo_mini_batch_size=ep, ppo_micro_batch_size_per_gpu=MICRO),
                 rollout=RolloutConfig(name="native", n=MICRO))
    phase = estimate(cfg, ep).phase("actor update")
    estimated = {k: phase.bytes(f"actor/{k}") for k in ("weights", "grads", "optimizer")}
    estimated["activations"] = phase.bytes("actor/activations")
    print(f"\nEP {ep}: measured {measured}; estimated {estimated}")  # pytest -s shows them
    for k in ("weights", "grads", "optimizer"):
        assert estimated[k] == pytest.approx(measured[k], rel=0.01), k
    assert estimated["activations"] == pytest.approx(measured["activations"], rel=0.02)
    arch = mem.arch_from_model_config(cfg.model)
    moe_forward = arch.moe_topk * SEQ * MICRO * arch.hidden_size * 4 + mem.dispatch_bytes(arch, SEQ, MICRO, 1, ep,
                                                                                         "float32")
    assert moe_forward == pytest.approx(measured["moe_forward"], rel=0.03)
    if ep == 2:  # the routing does differ between the ranks, so the mean is what matches
        assert ranks[0]["activations"] != ranks[1]["activations"]


# --- plans of MoE configs -------------------------------------------------------------------------

def test_moe_plan_text_names_ep_and_active_parameters():
    cfg = load_config(os.path.join(CONFIGS, "qwen3_30b_a3b.yaml"))
    text = plan(cfg, 16).render()
    assert "tp=1 pp=2 dp=8 ep=8" in text and "30.53B params in total, 3.35B active per token (8 of 128 experts)" in text
    assert "EP             2 x 8: [0,1,2,3,4,5,6,7] [8,9,10,11,12,13,14,15]" in text
    assert "expert DP     16 x 1" in text and "actor/dispatch" in text and ": fits" in text
    assert "active" not in plan(load_config(os.path.join(CONFIGS, "qwen3_8b.yaml")), 8).render()


def test_30b_a3b_on_one_node_is_refused_with_the_fix():
    """EP over all 8 GPUs leaves one rank per set of experts: their Adam states cannot shard."""
    cfg = load_config(os.path.join(CONFIGS, "qwen3_30b_a3b.yaml"), ["parallel.pipeline_model_parallel_size=1"])
    with pytest.raises(PlanError, match=r"actor/optimizer.*raise parallel.expert_model_parallel_size or parallel"
                                        r".pipeline_model_parallel_size; or use more nodes"):
        plan(cfg, 8)
    p = estimate(cfg, 8)
    states = {k: p.phase("actor update").bytes(f"actor/{k}") for k in ("weights", "grads", "optimizer")}
    # by hand, per rank: 48 layers of attention 18,874,368 + norms 4,352 + router 262,144 + 16 of the 128 experts of
    # 3 x 2048 x 768 each; two embeddings of 151,936 x 2048 (a multiple of 128: no padding) and the final norm
    experts = 48 * 16 * 3 * 2048 * 768
    n = 48 * (18_874_368 + 4_352 + 262_144) + experts + 2 * 151_936 * 2048 + 2048
    # bf16 weights, fp32 grads; Adam (fp32 master + 2 moments, 12 B) of the dense part over DP 8, of the experts
    # over expert DP 8 / 8 = 1, i.e. not sharded
    assert states == {"weights": 2 * n, "grads": 4 * n, "optimizer": 12 * (n - experts) / 8 + 12 * experts}
    # 71.5 GiB of an 80 GB GPU's 74.5 GiB before any activation: what makes one node too small for it
    assert 71 * 2 ** 30 < sum(states.values()) < 80e9


def test_engine_holds_every_expert_at_rollout_tp():
    """The native engine's copy is the whole model at rollout TP whatever the training EP."""
    cfg = load_config(os.path.join(CONFIGS, "qwen3_30b_a3b.yaml"))
    p = estimate(cfg, 16)
    engine = p.phase("rollout").bytes("rollout/engine_weights")
    # by hand, bf16 at TP 4: attention (q 2048 x 4096, k and v 2048 x 512 each, o 4096 x 2048) and every one of the
    # 128 experts split 4 ways, norms and router whole, in 48 layers; both embeddings at the vocabulary padded to
    # a multiple of 128 x 4 (152,064), split 4 ways; the final norm
    layer = (2 * 2048 * 4096 + 2 * 2048 * 512) // 4 + (2 * 2048 + 2 * 128) + 128 * 2048 + 128 * 3 * 2048 * 768 // 4
    assert engine == 2 * (48 * layer + 2 * 152_064 * 2048 // 4 + 2048) == 15_285_514_240
    # each engine of rollout TP 4 over TP 1 ranks decodes their 4 DP shards of 256 x 5 / 8 = 160 rows as one batch:
    # 640 sequences, capped by rollout.max_num_seqs (256)
    assert p.kv_cache.sequences_needed == 256
    wide = load_config(os.path.join(CONFIGS, "qwen3_30b_a3b.yaml"), ["rollout.max_num_seqs=1024"])
    assert estimate(wide, 16).kv_cache.sequences_needed == 640


@pytest.mark.slow
def test_dry_run_of_the_moe_demo_prints_the_expert_layout(tmp_path):
    """The trainer's --dry-run at EP 2 (two processes) ends with the plan: EP in the layout line, the EP
    and expert-DP groups, total and active parameters, the dispatch buffers."""
    import subprocess
    import sys

    tmp = str(tmp_path)
    out = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
         os.path.join(ROOT, "scripts", "train_ppo.py"), "--config", os.path.join(CONFIGS, "tiny_cpu_moe.yaml"),
         "--dry-run", f"data.train_files=[{tmp}/data/train.parquet]", f"data.val_files=[{tmp}/data/test.parquet]",
         f"trainer.default_local_dir={tmp}/ckpt", f"trainer.log_dir={tmp}/tb"],
        env=dict(os.environ, OMP_NUM_THREADS="1"), capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-3000:]
    for fragment in ("world=2 tp=1 pp=1 dp=2 ep=2", "active per token (2 of 8 experts)", "EP             1 x 2: [0,1]",
                     "expert DP      2 x 1: [0] [1]", "actor/dispatch", "Ready for real training"):
        assert fragment in out.stdout, fragment


def test_moe_phase_costs_count_active_flops_and_total_bytes():
    """--placement auto: a token's FLOPs go through the active parameters (8 of 128 experts), the weight
    sync moves all of them."""
    from hybridrl.planner.placement import PhaseCosts

    cfg = load_config(os.path.join(CONFIGS, "qwen3_30b_a3b.yaml"))
    costs = PhaseCosts.from_config(cfg, 16)
    tokens = 256 * 5 * (512 + 1024)
    # by hand: per layer attention 18,874,368, norms 4,352, router 262,144 and 128 experts of 4,718,592, of which a
    # token uses 8; two embeddings of 151,936 x 2048 and the final norm (the published 30.5B / 3.3B)
    total = 48 * (18_874_368 + 4_352 + 262_144 + 128 * 4_718_592) + 2 * 151_936 * 2048 + 2048
    active = total - 48 * 120 * 4_718_592
    assert (total, active) == (30_532_122_624, 3_353_032_704)
    # the planner's assumed speeds: 400 TFLOP/s per GPU for 6 FLOPs per active parameter and token, 25 GB/s
    assert costs.update_actor == pytest.approx(3 * 2 * active * tokens / 400e12)
    assert costs.update_weights == pytest.approx(total * 2 / 25e9)
