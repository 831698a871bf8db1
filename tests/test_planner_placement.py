"""Automatic role placement: split vs colocated by hand-built phase costs, predicted step times by hand,
profile costs scaled by devices, and `plan_layout.py --placement auto` on a size config."""
import json
import os
import subprocess
import sys

import pytest

from hybridrl.config.io import load_config
from hybridrl.planner.placement import Efficiency, PhaseCosts, load_profile, place, render

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _best_split(cands):
    return next(c for c in cands if c.mode == "split")


@pytest.mark.parametrize("world,gpus,staleness", [(8, 8, 0), (8, 8, 1), (32, 8, 1)])
def test_costly_generation_gets_more_devices_than_the_actor(world, gpus, staleness):
    costs = PhaseCosts(gen=30.0, old_log_prob=2.0, ref=2.0, update_actor=6.0)  # generation 3x training
    cands = place(costs, world, gpus, staleness)
    split = _best_split(cands)
    assert split.group("rollout").devices > split.group("actor").devices
    assert any(c.mode == "colocated" for c in cands)
    if world > gpus:
        assert split.group("rollout").devices % gpus == 0  # whole nodes


@pytest.mark.parametrize("world,gpus,staleness", [(8, 8, 0), (8, 8, 1), (32, 8, 1)])
def test_tiny_rollout_keeps_colocated(world, gpus, staleness):
    costs = PhaseCosts(gen=0.1, old_log_prob=2.0, ref=2.0, update_actor=6.0)  # generation 1% of training
    assert place(costs, world, gpus, staleness)[0].mode == "colocated"


def test_predicted_step_times_by_hand():
    costs = PhaseCosts(gen=8.0, reward=0.5, old_log_prob=1.0, ref=1.0, values=1.0, update_critic=2.0,
                       update_actor=4.0, update_weights=0.25, gen_floor_s=0.5, switch=1.0)
    eff = Efficiency(tp_overhead=0.1, micro_batches=4)  # tp2: 0.9; pp2: 4/5

    def fits(role, n, tp, pp):  # actor-side groups need two devices per model replica; the critic one
        return role in ("critic", "rollout") or tp * pp >= 2

    sync = [place(costs, 4, 4, 0, fits, efficiency=eff), place(costs, 4, 4, 1, fits, efficiency=eff)]
    for cands in sync:
        assert [c.mode for c in cands] == ["colocated", "split", "split"]
        colocated = cands[0]
        assert (colocated.group("colocated").tp, colocated.group("colocated").pp) == (2, 1)
        # (training 9.5 + switch 1) on 4 x 0.9, generation 8 / 4 (above the 0.5 floor), sync 0.25
        assert colocated.step_s == pytest.approx(10.5 / 3.6 + 2 + 0.25)
    k2, k1 = sync[0][1], sync[0][2]
    assert (k2.group("rollout").devices, k2.group("actor").devices, k2.group("critic")) == (2, 2, None)
    # actor group (tp2, 1.8 devices' worth) runs reward + old log-prob + ref + values, then both updates
    train = (0.5 + 1 + 1 + 1) / 1.8 + (4 + 2) / 1.8
    assert k2.step_s == pytest.approx(8 / 2 + train + 0.25)
    assert k2.utilisation["rollout"] == pytest.approx((4 + 0.25) / k2.step_s)
    assert k2.utilisation["actor"] == pytest.approx((train + 0.25) / k2.step_s)
    assert (k1.group("rollout").devices, k1.group("actor").devices, k1.group("critic").devices) == (1, 2, 1)
    assert (k1.group("critic").first_rank, k1.group("rollout").first_rank) == (2, 3)
    # actor (2.5 / 1.8) beside critic values (1 / 1), then actor update (4 / 1.8) beside critic update (2 / 1)
    train1 = max(2.5 / 1.8, 1.0) + max(4 / 1.8, 2.0)
    assert k1.step_s == pytest.approx(8 + train1 + 0.25)
    assert k1.utilisation["critic"] == pytest.approx(3 / k1.step_s)
    one_off = {c.group("rollout").devices: c.step_s for c in sync[1] if c.mode == "split"}
    assert one_off == pytest.approx({2: max(4, train) + 0.25, 1: max(8, train1) + 0.25})
    table = render(sync[1])
    rows = table.splitlines()[1:]
    assert [r.split()[1] for r in rows] == ["colocated", "split", "split"] and "actor 47% critic 36%" in rows[2]


def test_profile_costs_scale_by_devices(tmp_path):
    steps = [{"timing_s/gen": 12.0, "timing_s/generate_sequences": 10.0, "timing_s/update_actor": 4.0,
              "timing_s/update_weights": 1.0, "actor/pg_loss": 0.1},
             {"timing_s/gen": 14.0, "timing_s/generate_sequences": 12.0, "timing_s/update_actor": 6.0,
              "timing_s/update_weights": 1.0}]
    path = tmp_path / "metrics.jsonl"
    path.write_text("\n".join(json.dumps(s) for s in steps))
    metrics = load_profile(str(path))
    assert metrics["timing_s/gen"] == 13.0 and "actor/pg_loss" not in metrics
    costs = PhaseCosts.from_profile(metrics, world=8, train_efficiency=0.5, gen_efficiency=0.9)
    assert costs.gen == pytest.approx(11 * 8 * 0.9) and costs.switch == pytest.approx(2 * 8)
    assert costs.update_actor == pytest.approx(5 * 8 * 0.5) and costs.update_weights == 1.0
    # colocated on the profile's own 8 devices at those efficiencies predicts the measured step
    cands = place(costs, 8, 8, 0, efficiency=Efficiency(tp_overhead=0.0))
    colocated = next(c for c in cands if c.mode == "colocated")
    assert colocated.step_s == pytest.approx((5 * 8 * 0.5 + 16) / 8 + 11 * 0.9 + 1.0)


def test_flop_model_of_a_size_config():
    cfg = load_config(os.path.join(ROOT, "configs", "qwen2_7b.yaml"), [])
    costs = PhaseCosts.from_config(cfg, 16)
    assert costs.update_actor == pytest.approx(3 * costs.ref) and costs.update_critic == costs.update_actor
    assert costs.old_log_prob == costs.ref == costs.values > 0  # KL in the reward: old log-probs need a pass
    assert costs.gen > costs.gen_floor_s > 0 and costs.update_weights > 0 and costs.reward == 0


def test_plan_layout_auto_placement_script():
    out = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "plan_layout.py"), "--config",
                          os.path.join(ROOT, "configs", "qwen2_7b.yaml"), "--nodes", "4", "--gpus-per-node", "8",
                          "--placement", "auto"], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert any(line.split()[1:2] == ["colocated"] for line in lines if line.strip()[:1].isdigit())
    assert any(line.split()[1:2] == ["split"] for line in lines if line.strip()[:1].isdigit())
    assert "placement.mode=split placement.rollout_world_size=" in out.stdout


def test_a_rollout_group_counts_the_buffers_its_weights_arrive_in():
    """Each rollout rank holds two receive buffers per weight stream (one stream per training pipeline stage),
    each as large as the stream's largest bucket: for Qwen2-7B the embedding (152064 padded rows x 3584, bf16)
    is larger than the 64 MiB bucket. A device with room for the engine, its KV cache and the buffers of one
    stream takes the rollout at PP 1 and refuses it at PP 2 (four buffers); shard to shard the buffers hold
    shards (half an embedding at TP 2)."""
    import dataclasses

    from hybridrl.planner import memory as mem
    from hybridrl.planner.placement import RUNTIME_OVERHEAD_GIB, config_memory_fits

    cfg = load_config(os.path.join(ROOT, "configs", "qwen2_7b.yaml"))
    arch = mem.arch_from_model_config(cfg.model, 0)
    seq = cfg.data.max_prompt_length + cfg.data.max_response_length
    kv = mem.kv_bytes_per_token(arch, 1, 1, "bfloat16") * seq
    engine = mem.total_params(arch) * 2 + RUNTIME_OVERHEAD_GIB * 2 ** 30 + kv
    embedding = 152064 * 3584 * 2
    assert mem.largest_tensor_params(arch, 1) * 2 == embedding
    assert cfg.rollout.update_weights_bucket_mb * 2 ** 20 < embedding

    def rollout_fits(pp, gib, tp=1, rollout_tp=1, engine_name="vllm"):
        parallel = dataclasses.replace(cfg.parallel, pipeline_model_parallel_size=pp, gpu_memory_gb=gib,
                                       tensor_model_parallel_size=tp)
        sized = dataclasses.replace(cfg, parallel=parallel, rollout=dataclasses.replace(cfg.rollout, name=engine_name))
        return config_memory_fits(sized)("rollout", 1, rollout_tp, 1)

    room = (engine + 3 * embedding) / 2 ** 30  # two buffers fit, four do not
    assert rollout_fits(1, room) and not rollout_fits(2, room)
    assert not rollout_fits(1, (engine + embedding) / 2 ** 30)  # the engine alone fits, its two buffers do not
    # shard to shard (trainers at TP 2, native engines at TP 2): a rollout rank receives its own shards, half the
    # size; vLLM (or trainers at TP 1) get whole tensors
    kv2 = mem.kv_bytes_per_token(arch, 2, 1, "bfloat16") * seq
    engine2 = mem.total_params(arch) + RUNTIME_OVERHEAD_GIB * 2 ** 30 + kv2  # half the weights, in bf16
    room2 = (engine2 + 3 * embedding / 2) / 2 ** 30
    assert rollout_fits(1, room2, 2, 2, "native") and not rollout_fits(2, room2, 2, 2, "native")
    assert not rollout_fits(1, room2, 1, 2, "native") and not rollout_fits(1, room2, 2, 2, "vllm")
