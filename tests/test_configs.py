"""Every config in configs/ loads, validates at the world size it is meant for, and fits the GPU it
declares; the size configs carry the published architectures and realistic GSM8k settings."""
import glob
import os
import re

import pytest

from hybridrl.planner import memory as mem
from hybridrl.config.io import load_config
from hybridrl.config.layout import derive_layout
from hybridrl.planner.plan import plan, two_copy_peak

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ALL_CONFIGS = sorted(glob.glob(os.path.join(ROOT, "configs", "*.yaml"))
                     + glob.glob(os.path.join(ROOT, "configs", "recipes", "*.yaml")))  # recipes: tiny CPU configs

# Published HF config.json values: hidden, layers, heads, kv heads, intermediate, vocab, rope_theta,
# rms_norm_eps, tied embeddings, family; and the parameter count on the model card.
PUBLISHED = {
    "qwen2_0.5b.yaml": (896, 24, 14, 2, 4864, 151936, 1e6, 1e-6, True, "qwen2", 0.494e9),
    "qwen2_1.5b.yaml": (1536, 28, 12, 2, 8960, 151936, 1e6, 1e-6, True, "qwen2", 1.54e9),
    "qwen2_7b.yaml": (3584, 28, 28, 4, 18944, 152064, 1e6, 1e-6, False, "qwen2", 7.62e9),
    "qwen2_72b.yaml": (8192, 80, 64, 8, 29568, 152064, 1e6, 1e-6, False, "qwen2", 72.7e9),
    "llama3_8b.yaml": (4096, 32, 32, 8, 14336, 128256, 5e5, 1e-5, False, "llama", 8.03e9),
    "qwen3_8b.yaml": (4096, 36, 32, 8, 12288, 151936, 1e6, 1e-6, False, "qwen3", 8.19e9),
    "qwen3_30b_a3b.yaml": (2048, 48, 32, 4, 6144, 151936, 1e6, 1e-6, False, "qwen3_moe", 30.5e9),
}
# Qwen3's explicit head_dim; experts, top k, expert size, norm_topk_prob; active parameters on the card.
PUBLISHED_QWEN3 = {
    "qwen3_8b.yaml": (128, None),
    "qwen3_30b_a3b.yaml": (128, (128, 8, 768, True, 3.3e9)),
}
HYBRID_RATIO = {"qwen2_0.5b.yaml": 0.73, "qwen2_1.5b.yaml": 0.63, "qwen3_8b.yaml": 0.61, "llama3_8b.yaml": 0.58,
                "qwen2_7b.yaml": 0.57}
"""Exceptions to 0.55: where the rollout's KV pool (which both layouts hold) dominates - the small models, and,
since sequence parallelism (on at TP > 1) shrinks the training activations, the 7-8B configs at TP 4 (planned
0.602 / 0.571 / 0.561). Each still protects a hybrid engine that saves at least 39% over two resident copies."""
"""Planned hybrid peak / two-copy peak where it is above 0.55. Since SDPA attention (issue 29) training saves no
s x s attention scores, so the training phase shrank; for these smaller models the rollout's KV-cache pool, which
both layouts hold, now dominates, and one set of GPUs saves less (planned 0.72, 0.62, 0.58; was <= 0.55 while the
planner counted the scores)."""


def launch_nodes(path: str) -> int:
    """The `# launch: nodes=N` line of a size config; 0 when absent (a single-process CPU config)."""
    with open(path) as f:
        m = re.search(r"^# launch: nodes=(\d+)$", f.read(), re.M)
    return int(m.group(1)) if m else 0


def intended_world(path: str, cfg) -> int:
    """Nodes x GPUs of a size config; a CPU config runs in one process unless its header launches it
    with `torchrun --nproc_per_node=N` (the MoE demo at EP 2)."""
    nodes = launch_nodes(path)
    if nodes:
        return nodes * cfg.parallel.gpus_per_node
    with open(path) as f:
        m = re.search(r"^#.*torchrun --nproc_per_node=(\d+)", f.read(), re.M)
    return int(m.group(1)) if m else 1


def test_every_size_config_is_checked():
    assert set(PUBLISHED) <= {os.path.basename(p) for p in ALL_CONFIGS}


@pytest.mark.parametrize("path", ALL_CONFIGS, ids=os.path.basename)
def test_config_validates_and_fits_at_its_world_size(path):
    cfg = load_config(path)
    world = intended_world(path, cfg)
    layout = derive_layout(cfg, world, vocab_size=64, allow_missing_path=True)
    assert layout.tp * layout.cp * layout.pp * layout.dp == world
    p = plan(cfg, world, vocab_size=64)  # raises PlanError when it does not fit
    assert p.fits and p.peak.total <= cfg.parallel.gpu_memory_gb * 2 ** 30
    assert all(tp_group == tuple(range(tp_group[0], tp_group[0] + layout.tp)) for tp_group in p.groups.tp)
    assert layout.tp <= cfg.parallel.gpus_per_node, "TP should stay inside a node"


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_size_config_architecture_is_the_published_one(name):
    h, layers, heads, kv, ffn, vocab, theta, eps, tied, family, n_params = PUBLISHED[name]
    m = load_config(os.path.join(ROOT, "configs", name)).model
    assert (m.hidden_size, m.num_layers, m.num_attention_heads, m.num_key_value_heads, m.intermediate_size,
            m.vocab_size, m.rope_theta, m.rms_norm_eps, m.tie_word_embeddings, m.architecture) == \
        (h, layers, heads, kv, ffn, vocab, theta, eps, tied, family)
    assert m.params_dtype == "bfloat16" and m.path.startswith("/path/to/")
    assert mem.total_params(mem.arch_from_model_config(m)) == pytest.approx(n_params, rel=0.01)


@pytest.mark.parametrize("name", sorted(PUBLISHED_QWEN3))
def test_qwen3_size_config_head_dim_and_experts(name):
    head_dim, moe = PUBLISHED_QWEN3[name]
    m = load_config(os.path.join(ROOT, "configs", name)).model
    arch = mem.arch_from_model_config(m)
    assert m.head_dim == arch.head_dim == head_dim and arch.qk_norm
    if moe is None:
        assert not m.is_moe and not arch.is_moe
        return
    *fields, active = moe
    assert (m.num_experts, m.moe_topk, m.moe_intermediate_size, m.norm_topk_prob) == tuple(fields)
    assert mem.active_params(arch) == pytest.approx(active, rel=0.02)


@pytest.mark.parametrize("path", ALL_CONFIGS, ids=os.path.basename)
def test_only_the_demo_configs_generate_data(path):
    """The CPU demos' data (data/tiny_*) is generated on the first run; since a missing file is an error by default,
    each demo config asks for its synthetic task, standalone (recipes run on their own); real data never is."""
    d = load_config(path).data
    demo = {"data/tiny_arith": "arith", "data/tiny_arith_tools": "arith_tools"}.get(os.path.dirname(d.train_files[0]), "")
    assert d.synthetic_task == demo


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_size_config_gsm8k_settings(name):
    path = os.path.join(ROOT, "configs", name)
    cfg = load_config(path)
    d = cfg.data
    assert d.train_files == ["data/gsm8k/train.parquet"] and d.val_files == ["data/gsm8k/test.parquet"]
    assert (d.max_prompt_length, d.max_response_length) == (512, 1024) and 256 <= d.train_batch_size <= 1024
    assert d.synthetic_task == ""
    # routing replay needs the routes only the native engine records
    assert cfg.rollout.name == ("native" if cfg.actor.router_replay == "rollout" else "vllm")
    assert cfg.rollout.n == (1 if cfg.algorithm.uses_critic else 5)
    assert cfg.actor.optim.lr == 1e-6 and cfg.critic.optim.lr == 1e-5
    assert (cfg.parallel.gpus_per_node, cfg.parallel.gpu_memory_gb) == (8, 80)
    assert launch_nodes(path) >= 1


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_hybrid_engine_peak_is_at_most_055_of_two_copies(name):
    """The hybrid engine's reason to exist: one set of GPUs for training and rollout at <= 0.55x the
    memory of keeping both resident (planned, at the config's launch size; HYBRID_RATIO's exceptions)."""
    path = os.path.join(ROOT, "configs", name)
    cfg = load_config(path)
    world = intended_world(path, cfg)
    assert plan(cfg, world).peak.total <= HYBRID_RATIO.get(name, 0.55) * two_copy_peak(cfg, world)
