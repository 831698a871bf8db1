"""The CUDA-only paths, on one CUDA device (skipped without one).

`benchmarks/gpu_check.sh` runs `pytest -m cuda` on the first GPU machine; on a CPU-only machine
every test here is skipped (the CPU stand-ins for these paths are test_device_placement.py,
test_optim_fp16.py and the pure name-map tests of test_hf_convert.py). Covered here: one trainer
step with megatron's bf16 optimizer, the distributed optimizer and offload, every batch tensor on
the GPU and the per-stage memory metrics; fp16 learning through megatron's dynamic loss scaler,
overflow steps skipped; the native engine's log-probs against a transformers forward on the GPU;
the local spec's SDPA attention against megatron's unfused attention on the GPU's kernels;
with Transformer Engine installed, the TE layer spec against the local spec on the same weights.
"""
import importlib.util
import os

import pytest
import torch

from dist_helper import run_distributed

pytestmark = [pytest.mark.cuda,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = os.path.join(ROOT, "configs", "tiny_cpu.yaml")


@pytest.fixture
def exact_fp32(monkeypatch):
    """fp32 GEMMs in fp32: NVIDIA_TF32_OVERRIDE=0 stops cuBLAS, cuBLASLt (Transformer Engine asks it for TF32
    on fp32 inputs) and cuDNN from using TF32 whatever they are asked, and the NGC containers' override that
    turns torch's TF32 on is dropped; the spawned ranks inherit both. Comparisons then hold the CPU tests'
    1e-4, which a TF32 (~1e-3) or bf16 (~1e-2) leak exceeds."""
    monkeypatch.setenv("NVIDIA_TF32_OVERRIDE", "0")
    monkeypatch.delenv("TORCH_ALLOW_TF32_CUBLAS_OVERRIDE", raising=False)


def _no_tf32():
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    torch.set_float32_matmul_precision("highest")


# ---- one trainer step -------------------------------------------------------------------------------

def _trainer_step(overrides):
    from hybridrl.config.io import load_config
    from hybridrl.rewards import RewardManager
    from hybridrl.trainer.roles import build_roles
    from hybridrl.trainer.ppo import PPOTrainer
    from hybridrl.trainer.loop import setup_run

    cfg = load_config(TINY, overrides)
    _, tokenizer, layout, groups, train_loader, _ = setup_run(cfg)
    roles = build_roles(cfg, groups, tokenizer, total_steps=2)
    trainer = PPOTrainer(cfg, layout, groups, tokenizer, roles, RewardManager(cfg.reward), writer=None)
    trainer.sync_rollout_weights()
    prompts = next(iter(train_loader))
    batch = trainer.generate(prompts, trainer.train_sampling(), step=1)
    metrics = trainer.train_step(prompts, step=1)
    return {"devices": {k: str(v.device) for k, v in batch.items()}, "metrics": metrics,
            "optimizer": type(roles.actor.optimizer).__name__}


def test_one_trainer_step_on_the_gpu(tmp_path):
    overrides = [f"data.train_files=[{tmp_path}/data/train.parquet]", f"data.val_files=[{tmp_path}/data/test.parquet]",
                 f"trainer.default_local_dir={tmp_path}/ckpt", f"trainer.log_dir={tmp_path}/tb",
                 "data.train_batch_size=4", "rollout.n=2", "actor.ppo_mini_batch_size=4", "model.params_dtype=bfloat16",
                 "parallel.use_distributed_optimizer=true", "actor.use_kl_loss=true", "ref.offload_params=true",
                 "actor.offload.params=true", "actor.offload.grads=true", "actor.offload.optimizer=true"]
    res = run_distributed(_trainer_step, 1, overrides)[0]
    assert res["optimizer"] == "MegatronOptimizer"
    assert set(res["devices"].values()) == {"cuda:0"}, res["devices"]
    m = res["metrics"]
    assert all(torch.isfinite(torch.tensor(m[k])) for k in ("actor/pg_loss", "actor/grad_norm", "actor/kl_loss"))
    for stage in ("gen", "generate_sequences", "old_log_prob", "ref", "update_actor"):
        assert m[f"perf/max_memory_allocated_gb/{stage}"] > 0, stage
    # the engine's window nests in gen; with the actor offloaded around it, it holds less than gen
    assert m["perf/max_memory_allocated_gb/generate_sequences"] < m["perf/max_memory_allocated_gb/gen"]
    assert m["perf/max_memory_reserved_gb"] >= m["perf/max_memory_allocated_gb"] > 0


# ---- fp16 through megatron's loss scaler ------------------------------------------------------------

def _fp16_steps():
    from hybridrl.config import Config, OptimConfig
    from hybridrl.models.forward import pipeline_forward
    from hybridrl.models.gpt import GPTSpec, build_gpt
    from hybridrl.models.logprobs import vocab_parallel_log_probs
    from hybridrl.parallel.distributed import init_model_parallel
    from hybridrl.trainer.roles import wrap_trainable
    from hybridrl.workers.optim import MegatronOptimizer

    init_model_parallel(1, 1)
    spec = GPTSpec(num_layers=2, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                   intermediate_size=128, vocab_size=128)
    module = wrap_trainable(build_gpt(spec, 1, 1, 0, "float16"), Config())
    opt = MegatronOptimizer(module, OptimConfig(lr=3e-3, clip_grad=1.0), False, 100, torch.float16)
    ids = torch.randint(0, spec.vocab_size, (4, 16), device="cuda", generator=torch.Generator(device="cuda").manual_seed(0))

    def step(blow_up: float = 1.0):
        module.zero_grad_buffer()
        opt.zero_grad()

        def loss_fn(output, mb):
            nll = -vocab_parallel_log_probs(output[:, :-1], mb["input_ids"][:, 1:], None, spec.vocab_size).mean()
            return nll * blow_up, {"nll": nll.detach().float()}

        stats = pipeline_forward(module, [{"input_ids": ids}], loss_fn, forward_only=False)
        updated, _, _ = opt.step()
        return float(stats[0]["nll"]), updated, opt.loss_scale

    first_scale = opt.loss_scale
    trained = [step() for _ in range(10)]
    before = [p.detach().clone() for p in module.parameters()]
    overflows = [step(blow_up=1e6) for _ in range(2)]  # fp16 gradients overflow: inf
    unchanged = all(torch.equal(a, p) for a, p in zip(before, module.parameters()))
    return first_scale, trained, overflows, unchanged, step()


def test_fp16_learns_and_overflow_steps_are_skipped():
    from hybridrl.workers.optim import INITIAL_LOSS_SCALE

    first_scale, trained, overflows, unchanged, after = run_distributed(_fp16_steps, 1)[0]
    assert first_scale == INITIAL_LOSS_SCALE
    assert all(updated for _, updated, _ in trained)
    assert trained[-1][0] < 0.9 * trained[0][0], [nll for nll, _, _ in trained]  # it learns the fixed batch
    assert [updated for _, updated, _ in overflows] == [False, False] and unchanged
    # megatron's dynamic scaler: hysteresis 2, so the second consecutive overflow halves the scale
    assert overflows[-1][2] == INITIAL_LOSS_SCALE / 2
    assert after[1] and after[2] == INITIAL_LOSS_SCALE / 2


# ---- native engine on the GPU -----------------------------------------------------------------------

def _native_vs_transformers(folder):
    import dataclasses

    import transformers

    from hybridrl.models.hf_checkpoint import SafetensorsReader, model_from_hf
    from hybridrl.parallel.distributed import init_model_parallel
    from hybridrl.rollout.base import SamplingParams
    from hybridrl.rollout.native import NativeEngine

    _no_tf32()
    groups = init_model_parallel(1, 1)
    _, spec = model_from_hf(folder, groups)
    engine = NativeEngine(dataclasses.replace(spec, layer_spec="local"), 1)  # as roles.build_rollout builds it
    reader = SafetensorsReader(folder)
    engine.load_weights((n, reader.read(n).cuda()) for n in reader.names())
    prompts = [[5, 6, 7], [1, 2, 3, 4, 5, 6, 7, 8, 9], [9]]
    out = engine.generate(prompts, SamplingParams(temperature=0, max_new_tokens=8))
    hf = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).cuda().eval()
    worst_lp, worst_margin = 0.0, 0.0
    for row, prompt in enumerate(prompts):
        n = int(out.response_mask[row].sum())
        response = out.responses[row, :n].tolist()
        with torch.no_grad():
            logits = hf(torch.tensor([prompt + response], device="cuda")).logits[0, len(prompt) - 1:-1].float()
        logp = torch.log_softmax(logits, -1)
        chosen = torch.tensor(response, device="cuda")
        ref = logp.gather(-1, chosen[:, None])[:, 0]
        worst_lp = max(worst_lp, (out.log_probs[row, :n].to(ref.device) - ref).abs().max().item())
        worst_margin = max(worst_margin, (logp.max(-1).values - ref).max().item())  # 0: greedy picked HF's argmax
    return worst_lp, worst_margin, str(engine.device)


def test_native_engine_log_probs_and_greedy_tokens_match_transformers(tmp_path, exact_fp32):
    from hybridrl.models.hf_checkpoint import random_hf_model_folder

    folder = random_hf_model_folder(str(tmp_path / "qwen2"), "qwen2", seed=3)
    worst_lp, worst_margin, device = run_distributed(_native_vs_transformers, 1, folder)[0]
    assert device.startswith("cuda")
    assert worst_lp < 1e-4 and worst_margin < 1e-4, (worst_lp, worst_margin)


# ---- the local spec's SDPA attention on the GPU's kernels -------------------------------------------

@pytest.mark.parametrize("dtype,padded,atol", [("float32", True, 1e-4), ("float32", False, 1e-4),
                                               ("bfloat16", True, 5e-2)])
def test_sdpa_attention_equals_the_unfused_attention(dtype, padded, atol, exact_fp32):
    """Padded rows take a masked kernel (memory-efficient; fully masked pad rows must stay finite),
    causal ones flash where the dtype allows (test_sdpa_attention.py: the same on CPU, at 1e-5)."""
    from test_sdpa_attention import SPEC, _compare

    assert run_distributed(_compare, 1, 1, SPEC, padded, dtype, atol)[0]


# ---- Transformer Engine layer spec ------------------------------------------------------------------

def _te_vs_local(folder):
    import dataclasses

    from models_helper import mcore_logits, ragged_batch

    from hybridrl.models.gpt import build_gpt
    from hybridrl.models.hf_checkpoint import load_hf_into_mcore, mcore_to_hf_stream, model_from_hf
    from hybridrl.parallel.distributed import init_model_parallel

    _no_tf32()
    groups = init_model_parallel(1, 1)
    te_model, te_spec = model_from_hf(folder, groups)
    local_spec = dataclasses.replace(te_spec, layer_spec="local")
    local_model = build_gpt(local_spec, 1, 1, 0)
    load_hf_into_mcore(local_model, folder, local_spec, groups)
    batch = {k: v.cuda() for k, v in ragged_batch(te_spec.vocab_size).items()}
    te_logits = mcore_logits(te_model, te_spec, groups, batch)
    local_logits = mcore_logits(local_model, local_spec, groups, batch)
    export = {n: t.clone() for n, t in mcore_to_hf_stream(te_model, te_spec, groups)}
    return te_spec.layer_spec, te_logits, local_logits, batch["attention_mask"].bool(), export


@pytest.mark.skipif(importlib.util.find_spec("transformer_engine") is None, reason="needs Transformer Engine")
def test_te_layer_spec_equals_the_local_spec(tmp_path, exact_fp32):
    from hybridrl.models.hf_checkpoint import SafetensorsReader, random_hf_model_folder

    folder = random_hf_model_folder(str(tmp_path / "qwen2"), "qwen2", seed=4, num_hidden_layers=2)
    kind, te_logits, local_logits, real, export = run_distributed(_te_vs_local, 1, folder)[0]
    assert kind == "te"
    torch.testing.assert_close(te_logits[real], local_logits[real], rtol=1e-4, atol=1e-4)
    reader = SafetensorsReader(folder)
    assert set(export) == set(reader.names())
    assert all(torch.equal(t.cpu(), reader.read(n)) for n, t in export.items())
