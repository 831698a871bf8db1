"""LoRA on the megatron path (models/lora.py): two PPO optimizer steps of a rank-4 adapter on every linear at
world 1, TP 2 (sequence parallel) and PP 2 must give the same adapters, merged weights and log-probs; the
base stays bit-identical and only adapters get gradients and optimizer state; step 0 is the base exactly;
the exported PEFT adapter, loaded by peft onto transformers' base model, gives the trained policy's log-probs."""
import pytest
import torch

from dist_helper import run_distributed
from models_helper import padded_rl_rows

import os

B, P, R, VOCAB = 8, 6, 5, 97
TINY = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "configs", "tiny_cpu.yaml")
MINI, TEMPERATURE, LR, EPS = 4, 0.7, 2e-2, 1e-3
RANK, ALPHA = 4, 8.0


@pytest.fixture(scope="module")
def hf_folder(tmp_path_factory):
    from hybridrl.models.hf_checkpoint import random_hf_model_folder

    return random_hf_model_folder(str(tmp_path_factory.mktemp("hf") / "qwen2"), "qwen2", seed=0,
                                  num_hidden_layers=2, vocab_size=VOCAB)


def _batch():
    g = torch.Generator().manual_seed(7)
    batch = padded_rl_rows(VOCAB, [6, 4, 5, 6, 3, 6, 2, 5], [5, 3, 1, 5, 4, 2, 5, 3], (P, R), g)
    return {**batch, "advantages": torch.randn(B, R, generator=g) * batch["response_mask"]}


@pytest.fixture(scope="module")
def moe_folder(tmp_path_factory):
    from hybridrl.models.hf_checkpoint import random_hf_model_folder

    return random_hf_model_folder(str(tmp_path_factory.mktemp("moe") / "qwen3_moe"), "qwen3_moe", seed=1,
                                  num_hidden_layers=2, vocab_size=VOCAB)


def _lora_actor(folder, tp, pp, ep, lora, **overrides):
    from hybridrl.config import ActorConfig, Config, OptimConfig
    from hybridrl.models.hf_checkpoint import model_from_hf
    from hybridrl.models.lora import apply_lora
    from hybridrl.parallel.distributed import init_model_parallel
    from hybridrl.trainer.roles import wrap_trainable
    from hybridrl.workers.actor import ActorWorker
    from hybridrl.workers.engine import ModelEngine
    from hybridrl.workers.optim import build_optimizer

    groups = init_model_parallel(tp, pp, ep=ep)
    acfg = ActorConfig(optim=OptimConfig(lr=LR, eps=EPS), ppo_epochs=2, ppo_mini_batch_size=MINI,
                       ppo_micro_batch_size_per_gpu=2, lora=lora, **overrides)
    model, spec = model_from_hf(folder, groups, sequence_parallel=tp > 1)
    apply_lora(model, lora, spec, groups.pp, groups.pp_rank, seed=3)
    module = wrap_trainable(model, Config(actor=acfg))
    actor = ActorWorker(ModelEngine(module, groups), build_optimizer(module, acfg.optim, groups, 10), acfg,
                        spec.vocab_size, TEMPERATURE, R)
    return actor, spec, groups


def _train(folder, batch, tp, pp, ep=1):
    from hybridrl.config.batching import MicroBatching
    from hybridrl.config.lora import LoraConfig
    from hybridrl.models.hf_checkpoint import mcore_to_hf_stream, weight_state
    from hybridrl.models.lora import adapters_disabled, is_adapter_key, merged_weights
    from hybridrl.models.lora_export import full_adapters

    actor, spec, groups = _lora_actor(folder, tp, pp, ep, LoraConfig(rank=RANK, alpha=ALPHA), use_kl_loss=True,
                                      kl_loss_coef=0.5)
    module = actor.engine.module
    base = {k: v.detach().clone() for k, v in weight_state(module).items()}
    lp0, _ = actor.compute_log_prob(batch, MicroBatching(4))
    with adapters_disabled(module):
        lp_base, _ = actor.compute_log_prob(batch, MicroBatching(4))
    metrics = actor.update_policy({**batch, "old_log_probs": lp0, "ref_log_probs": lp_base}, MINI, MicroBatching(2))
    trainable = sorted(n for n, p in module.named_parameters() if p.requires_grad)
    with_grad = sorted(n for n, p in module.named_parameters() if getattr(p, "main_grad", None) is not None
                       and p.main_grad.abs().sum() > 0)
    lp1, _ = actor.compute_log_prob(batch, MicroBatching(4))
    with merged_weights(module):
        merged = {k: v.detach().clone() for k, v in mcore_to_hf_stream(module, spec, groups)}
    unmerged = {k: v.detach().clone() for k, v in mcore_to_hf_stream(module, spec, groups)}
    base_kept = all(torch.equal(v, base[k]) for k, v in weight_state(module).items())
    return dict(lp0=lp0, lp_base=lp_base, lp1=lp1, metrics=metrics, adapters=full_adapters(module, spec, groups),
                ref=_references(folder, actor, batch, tp), engine=_engine_handoff(module, spec, groups, merged, unmerged),
                merged=merged, unmerged=unmerged, base_kept=base_kept, trainable=trainable, with_grad=with_grad,
                all_adapters=all(is_adapter_key(n.removeprefix("module.")) for n in trainable),
                opt_states=len(actor.optimizer.optimizer.state), n_trainable=len(trainable),
                adapter_numel=sum(p.numel() for p in module.parameters() if p.requires_grad))


def _references(folder, actor, batch, tp):
    """Log-probs of the LoRA run's reference (the actor, adapters off) and of a separately loaded base model."""
    from hybridrl.config.batching import MicroBatching
    from hybridrl.models.hf_checkpoint import model_from_hf
    from hybridrl.workers.actor import LogProbWorker
    from hybridrl.workers.engine import ModelEngine
    from hybridrl.workers.lora_reference import BaseReference

    engine = actor.engine
    lora_ref = BaseReference(engine, actor.vocab_size, TEMPERATURE).compute_log_prob(batch, MicroBatching(4))[0]
    separate, _ = model_from_hf(folder, engine.groups, sequence_parallel=tp > 1)
    ref = LogProbWorker(ModelEngine(separate.eval(), engine.groups), actor.vocab_size, TEMPERATURE)
    return lora_ref, ref.compute_log_prob(batch, MicroBatching(4))[0]


def _engine_handoff(module, spec, groups, merged, unmerged):
    """The merged weights into the native engine through the verified handoff (exact digests), and whether
    the engine's parameters are the merged export's shards bit for bit."""
    from hybridrl.models import hf_convert as hc
    from hybridrl.models.lora import merged_weights
    from hybridrl.placement.reshard import update_engine_weights
    from hybridrl.rollout.native import NativeEngine

    engine = NativeEngine(spec, groups.tp if groups.pp == 1 else 1)
    with merged_weights(module):
        report = update_engine_weights(engine, module, spec, groups, 0.01, verify="exact", share=False)
    reader, etp, rank = hc.DictReader(merged), engine.groups.tp, engine.groups.tp_rank
    exact = all(torch.equal(engine.params[g], hc.read_shard(g, reader, spec, etp, rank)) for g in engine.params)
    qkv = "decoder.layers.0.self_attention.linear_qkv.weight"
    base_qkv = hc.read_shard(qkv, hc.DictReader(unmerged), spec, etp, rank)
    return dict(verified=report.verified, direct=report.direct, buckets=report.num_buckets, exact=exact,
                merged=not torch.equal(engine.params[qkv], base_qkv))


@pytest.fixture(scope="module")
def runs(hf_folder, moe_folder):
    """Dense qwen2 at world 1, TP 2, PP 2; Qwen3-MoE (attention adapted, experts frozen) at world 1 and EP 2."""
    batch = _batch()
    out = {layout: run_distributed(_train, tp * pp, hf_folder, batch, tp, pp)[0]
           for layout, (tp, pp) in {"world1": (1, 1), "tp2": (2, 1), "pp2": (1, 2)}.items()}
    out["moe_world1"] = run_distributed(_train, 1, moe_folder, batch, 1, 1, 1)[0]
    out["ep2"] = run_distributed(_train, 2, moe_folder, batch, 1, 1, 2)[0]
    return out


def test_step0_is_the_base_and_only_adapters_train(runs):
    one = runs["world1"]
    assert torch.equal(one["lp0"], one["lp_base"])  # B = 0: the adapted model is the base, bit for bit
    assert one["all_adapters"] and one["n_trainable"] == 2 * 7 * 2  # A and B of 7 HF modules in 2 layers
    assert one["opt_states"] == one["n_trainable"]  # Adam state only for the adapters
    assert set(one["with_grad"]) == set(one["trainable"])  # the second step's gradient reached A and B
    assert one["base_kept"]  # the frozen base is bit-identical after two optimizer steps
    assert (one["lp1"] - one["lp0"]).abs().max() > 1e-3  # the adapters moved the policy
    assert torch.equal(one["unmerged"]["model.layers.0.self_attn.q_proj.weight"],
                       one["merged"]["model.layers.0.self_attn.q_proj.weight"]) is False


@pytest.mark.parametrize("layout", ["world1", "tp2", "pp2", "ep2"])
def test_reference_is_the_base_and_kl_equals_a_separate_reference(runs, layout):
    from hybridrl import algos

    run = runs[layout]
    lora_ref, separate = run["ref"]
    assert torch.equal(lora_ref, separate)  # adapters off = the base model loaded on its own
    assert (run["lp1"] - lora_ref).abs().max() > 1e-3  # ... while the policy has moved away from it
    for kind in ("low_var_kl", "kl"):
        assert torch.equal(algos.kl_penalty(run["lp1"], lora_ref, kind), algos.kl_penalty(run["lp1"], separate, kind))
    assert run["metrics"]["actor/kl_loss"] > 0  # the second optimizer step saw the KL to the base


@pytest.mark.parametrize("layout", ["world1", "tp2", "pp2", "ep2"])
def test_engine_receives_the_merged_weights_through_the_verified_handoff(runs, layout):
    engine = runs[layout]["engine"]
    assert engine["verified"] and engine["exact"] and engine["merged"], engine
    assert engine["direct"] == (layout in ("world1", "tp2"))  # shards straight in, else HF buckets
    assert engine["direct"] or engine["buckets"] > 1


def test_moe_adapts_the_attention_and_freezes_the_experts(runs):
    for layout in ("moe_world1", "ep2"):
        run = runs[layout]
        assert run["all_adapters"] and run["n_trainable"] == 2 * 4 * 2  # q, k, v, o in 2 layers; no expert
        assert set(run["with_grad"]) == set(run["trainable"]) and run["base_kept"]
        assert torch.equal(run["lp0"], run["lp_base"])
    assert all(".self_attn." in k for k in runs["ep2"]["adapters"])


def test_merged_weights_are_base_plus_scaled_BA(runs, hf_folder):
    from safetensors.torch import load_file

    one, scale = runs["world1"], ALPHA / RANK
    hf = load_file(f"{hf_folder}/model.safetensors")
    for key, a in one["adapters"].items():
        if not key.endswith("lora_A.weight"):
            continue
        module = key.removeprefix("base_model.model.").removesuffix(".lora_A.weight")
        b = one["adapters"][key.replace("lora_A", "lora_B")]
        assert b.abs().max() > 0, module
        torch.testing.assert_close(one["merged"][f"{module}.weight"], hf[f"{module}.weight"] + scale * b @ a,
                                   atol=1e-6, rtol=0, msg=module)
        assert torch.equal(one["unmerged"][f"{module}.weight"], hf[f"{module}.weight"])


@pytest.mark.parametrize("layout", ["tp2", "pp2", "ep2"])
def test_parallel_layouts_equal_world_1(runs, layout):
    one, other = runs["moe_world1" if layout == "ep2" else "world1"], runs[layout]
    assert torch.equal(other["lp0"], other["lp_base"]) and other["base_kept"]
    assert other["all_adapters"] and other["opt_states"] == other["n_trainable"]
    assert set(other["adapters"]) == set(one["adapters"])
    for key, value in one["adapters"].items():  # A at init is identical; all else moved by two Adam steps
        torch.testing.assert_close(other["adapters"][key], value, atol=2e-5, rtol=0, msg=key)
    for key, value in one["merged"].items():
        torch.testing.assert_close(other["merged"][key], value, atol=2e-5, rtol=0, msg=key)
    torch.testing.assert_close(other["lp1"], one["lp1"], atol=2e-5, rtol=0)
    for key in ("actor/pg_loss", "actor/grad_norm"):
        assert abs(other["metrics"][key] - one["metrics"][key]) < 1e-5, key


def test_peft_adapter_export_gives_the_trained_log_probs(runs, hf_folder, tmp_path):
    import peft
    import transformers

    from hybridrl.config.lora import LoraConfig
    from hybridrl.models.lora_export import save_peft_adapter

    one = runs["world1"]
    save_peft_adapter(str(tmp_path / "adapter"), one["adapters"], LoraConfig(rank=RANK, alpha=ALPHA), hf_folder)
    base = transformers.AutoModelForCausalLM.from_pretrained(hf_folder, dtype=torch.float32,
                                                             attn_implementation="eager")
    model = peft.PeftModel.from_pretrained(base, str(tmp_path / "adapter")).eval()
    batch = _batch()
    mask = batch["attention_mask"].long()
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        logits = model(input_ids=batch["input_ids"], attention_mask=mask, position_ids=pos).logits
    logp = torch.log_softmax(logits[:, P - 1:-1] / TEMPERATURE, -1)
    lp = logp.gather(-1, batch["responses"][..., None]).squeeze(-1) * batch["response_mask"]
    torch.testing.assert_close(one["lp1"] * batch["response_mask"], lp, atol=2e-5, rtol=0)


@pytest.mark.parametrize("overrides, message", [
    (["actor.lora.rank=8", "actor.lora.target_modules=[qkv]"], "lora.target_modules has ['qkv']"),
    (["actor.lora.rank=8", "rollout.name=vllm"], "rollout.name=vllm is not supported"),
    (["actor.lora.rank=8", "model.architecture=qwen3_moe", "actor.lora.target_modules=[linear_qkv,down_proj]"],
     "MLPs are its experts"),
    (["critic.lora.rank=8"], "LoRA is not supported for the critic"),
    (["actor.lora.rank=8", "actor.use_kl_loss=true", "actor.offload.params=true"], "set actor.offload.params=false"),
])
def test_impossible_lora_configs_are_refused_with_the_fix(overrides, message):
    from hybridrl.config import ConfigError
    from hybridrl.config.io import load_config
    from hybridrl.config.layout import derive_layout

    with pytest.raises(ConfigError, match=message.replace("[", r"\[").replace("]", r"\]")):
        derive_layout(load_config(TINY, overrides), 1, vocab_size=VOCAB)


def test_lora_target_names():
    from hybridrl.config.lora import LoraConfig

    assert LoraConfig(rank=2, target_modules=["linear_qkv", "down_proj"]).hf_targets() == ("q_proj", "k_proj",
                                                                                           "v_proj", "down_proj")
    assert len(LoraConfig(rank=2).hf_targets()) == 7 and LoraConfig(rank=2, alpha=8).scaling == 4.0


@pytest.mark.parametrize("layout, tp", [("world1", 1), ("tp2", 2)])
def test_planner_counts_grads_and_adam_states_of_the_adapters_only(runs, layout, tp):
    from hybridrl.config.io import load_config
    from hybridrl.planner.plan import estimate

    model = ["model.hidden_size=64", "model.intermediate_size=96", "model.num_layers=2", "model.num_attention_heads=4",
             "model.num_key_value_heads=2", "model.vocab_size=97", "actor.use_kl_loss=true",
             f"parallel.tensor_model_parallel_size={tp}", "rollout.tensor_model_parallel_size=1"]
    lora = ["actor.lora.rank=4", "actor.lora.alpha=8"]
    full, adapted = (estimate(load_config(TINY, model + extra), tp, VOCAB) for extra in ([], lora))
    states = lambda p: dict(p.phase("actor update").items)  # noqa: E731
    numel = runs[layout]["adapter_numel"]  # what the real LoRA model trains on one rank
    assert states(adapted)["actor/grads"] == 4 * numel and states(adapted)["actor/optimizer"] == 8 * numel
    assert states(adapted)["actor/weights"] == states(full)["actor/weights"] + 4 * numel
    assert states(full)["actor/grads"] > 5 * states(adapted)["actor/grads"]  # rank 4 on a 64-wide model
    assert any(p.name == "ref log-prob" for p in full.phases)
    assert not any(p.name == "ref log-prob" for p in adapted.phases)  # the reference is the actor, adapters off


def test_the_adapter_config_of_an_moe_model_names_only_its_attention():
    """all-linear adapts only the attention of an MoE model (its MLPs are experts): the exported PEFT config must
    not name gate/up/down_proj, which PEFT would wrap with adapters the run never trained."""
    from hybridrl.config.lora import LoraConfig
    from hybridrl.models.lora_export import adapter_config

    cfg = LoraConfig(rank=4, alpha=8.0, target_modules=["all-linear"])
    assert adapter_config(cfg, "base", moe=True)["target_modules"] == ["q_proj", "k_proj", "v_proj", "o_proj"]
    assert adapter_config(cfg, "base")["target_modules"] == ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
                                                             "up_proj", "down_proj"]


def _dropout_masks():
    """TP 2: the adapter dropout masks (p = 0.5, 64 x 16 ones) of a row-parallel and a column-parallel LoRA linear
    on this rank, drawn as the forward draws them."""
    import torch.distributed as dist

    from hybridrl.models.lora import Adapter, LoraLinear
    from hybridrl.parallel.distributed import init_model_parallel

    groups = init_model_parallel(2, 1)
    adapter = Adapter(torch.zeros(RANK, 16), 8, 0.5).train()
    masks = {}
    for kind, column in (("row", False), ("column", True)):
        linear = LoraLinear.__new__(LoraLinear)
        linear.lora_column, linear.tp_group, linear.explicit_expert_comm = column, groups.tp_group, False
        masks[kind] = linear._dropped(adapter, torch.ones(64, 16)) != 0
    gathered = [None, None]
    dist.all_gather_object(gathered, masks)
    return gathered


def test_row_parallel_adapter_dropout_differs_over_tp_ranks():
    """A row-parallel input is split over TP: each slice gets its own mask (megatron's model-parallel stream), not
    one mask repeated on every slice; a column-parallel input is whole on both ranks and gets the same mask."""
    rank0, rank1 = run_distributed(_dropout_masks, 2)[0]
    for masks in (rank0, rank1):
        assert 0.3 < masks["row"].float().mean() < 0.7  # dropout ran (p = 0.5)
    assert not torch.equal(rank0["row"], rank1["row"])
    assert torch.equal(rank0["column"], rank1["column"])
