"""The native engine's log-probs equal the trainer's old_log_probs (fp32) on the demo config.

Both sides use log_softmax(logits / T) over the full vocabulary (verl's convention): top-k / top-p
only restrict which token the engine draws, never the log-prob it reports, so the agreement holds
with them on too.
"""
import pytest

from dist_helper import run_distributed
from test_trainer import TINY, _overrides, _train, read_scalars


@pytest.mark.slow
@pytest.mark.parametrize("sampling", [[], ["rollout.temperature=0.7", "rollout.top_k=20", "rollout.top_p=0.9"]],
                         ids=["demo", "top_k_top_p"])
def test_rollout_log_probs_match_old_log_probs(tmp_path, sampling):
    run_distributed(_train, 1, TINY, _overrides(tmp_path, ["trainer.total_training_steps=2"] + sampling))
    scalars = read_scalars(tmp_path)
    diff_mean, diff_max = scalars["rollout/logprob_diff_mean"], scalars["rollout/logprob_diff_max"]
    assert set(diff_mean) == {1, 2}
    for step in (1, 2):
        assert diff_mean[step] <= 1e-5, (step, diff_mean[step])
        assert diff_max[step] <= 1e-4, (step, diff_max[step])
