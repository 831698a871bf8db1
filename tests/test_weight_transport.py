"""Split placement's weight transport (`placement/transport.py`) at training DP 2 into one engine at rollout
TP 2: two trainer ranks, two rollout ranks, one torchrun job of two GRPO steps."""
import os

import pytest

from test_trainer import _torchrun, read_scalars


@pytest.mark.slow
@pytest.mark.distributed
def test_weight_sync_bytes_is_every_hf_tensor_once_at_dp2_rollout_tp2(tmp_path):
    """perf/weight_sync_bytes, logged every step, is the formula: each HF tensor of the model once
    (sum of numel x 4 bytes, fp32), counted here from the run's own initial checkpoint files; the bucket
    plan went once and every sync after it sent bytes only (`bucket_plan`, checked against each bucket)."""
    from safetensors.torch import load_file

    _torchrun(tmp_path, 4, ["trainer.total_training_steps=2", "placement.mode=split", "placement.rollout_world_size=2",
                            "rollout.tensor_model_parallel_size=2"])
    folder = tmp_path / "ckpt" / "init_hf"
    numel = sum(t.numel() for name in os.listdir(folder) if name.endswith(".safetensors")
                for t in load_file(str(folder / name)).values())
    logged = read_scalars(tmp_path)["perf/weight_sync_bytes"]
    assert sorted(logged) == [1, 2], logged
    assert all(v == pytest.approx(4 * numel, rel=1e-6) for v in logged.values()), (logged, 4 * numel)
