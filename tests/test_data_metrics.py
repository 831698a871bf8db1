"""verl's data metrics of a step (metric_utils.compute_data_metrics in verl 0.9.1), by hand."""
import numpy as np
import pytest
import torch

from hybridrl.algos import token_rewards_from_scores
from hybridrl.metrics import batch_metrics


def _metrics(rejected_mask, values=None):
    scores = torch.tensor([1.0, 1.0])
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]])  # as generated
    token_rewards = token_rewards_from_scores(scores, mask)
    returns = torch.tensor([[1.0, 0.5, 0.0], [2.0, 1.0, 0.5]])
    return batch_metrics(scores, token_rewards, returns, returns, rejected_mask, 3, values=values)


def test_rewards_keep_a_row_that_rejection_sampling_left_out():
    """verl sums token_level_rewards without a mask: row 1 rejected (its mask zeroed) still has reward 1 (it had 0)."""
    out = _metrics(torch.tensor([[1.0, 1.0, 0.0], [0.0, 0.0, 0.0]]))
    assert (out["critic/rewards/mean"], out["critic/rewards/min"]) == (1.0, 1.0)
    assert out["critic/score/mean"] == 1.0


def test_explained_variance_of_the_values_over_response_tokens():
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]])
    values = torch.tensor([[0.8, 0.7, 9.0], [1.5, 1.2, 0.1]])
    out = _metrics(mask, values)
    r, v = np.array([1.0, 0.5, 2.0, 1.0, 0.5]), np.array([0.8, 0.7, 1.5, 1.2, 0.1])  # the masked 9.0 left out
    assert out["critic/vf_explained_var"] == pytest.approx(1 - np.var(r - v, ddof=1) / (np.var(r, ddof=1) + 1e-5))
    assert "critic/vf_explained_var" not in _metrics(mask)  # no critic, no values


@pytest.mark.parametrize("mode,want", [("token-mean", 1.0), ("seq-mean-token-sum-norm", (2 + 4) / 2 / 8)])
def test_actor_entropy_is_the_old_policys_reduced_as_the_loss(mode, want):
    """verl's actor/entropy: the old-log-prob pass's entropy, agg_loss'd with actor.loss_agg_mode over the batch
    (Dr. GRPO: per-row sums over rows, / the response length 8), not a token mean whatever the mode."""
    from types import SimpleNamespace

    from hybridrl.trainer.ppo import PPOTrainer

    cfg = SimpleNamespace(actor=SimpleNamespace(loss_agg_mode=mode, loss_scale_factor=None),
                          data=SimpleNamespace(max_response_length=8))
    trainer = SimpleNamespace(cfg=cfg, groups=SimpleNamespace(dp=1, device=torch.device("cpu")))
    mask = torch.zeros(2, 8)
    mask[0, :2], mask[1, :4] = 1, 1
    assert PPOTrainer._old_entropy(trainer, torch.ones(2, 8), mask) == pytest.approx(want)


def test_prompt_clip_ratio_is_the_share_of_prompts_at_the_limit():
    scores, mask = torch.tensor([1.0, 0.0, 1.0]), torch.ones(3, 2)
    prompts = torch.tensor([[0, 1, 1, 1], [1, 1, 1, 1], [1, 1, 1, 1]])  # left-padded: lengths 3, 4, 4
    out = batch_metrics(scores, token_rewards_from_scores(scores, mask), mask, mask, mask, 2, prompts,
                        max_prompt_length=4)
    assert out["prompt_length/clip_ratio"] == pytest.approx(2 / 3) and out["prompt_length/max"] == 4


def test_an_empty_response_is_aborted_as_verl_counts_it():
    """verl 0.9.1 compute_data_metrics: rows of response length 0 leave score and reward statistics, are the
    aborted ratio, and response_length_non_aborted/* describe the others (hand values)."""
    scores = torch.tensor([1.0, -1.0, 0.5, 7.0])
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 0.0, 0.0], [1.0, 1.0, 0.0], [0.0, 0.0, 0.0]])  # row 3 empty
    token_rewards = token_rewards_from_scores(scores, mask)
    out = batch_metrics(scores, token_rewards, mask, mask, mask, 3)
    assert (out["critic/score/mean"], out["critic/score/max"], out["critic/score/min"]) == pytest.approx((0.5 / 3, 1.0, -1.0))
    assert out["critic/rewards/max"] == 1.0  # the empty row's 7.0 is not a reward anyone earned
    assert out["response/aborted_ratio"] == 0.25
    assert (out["response_length_non_aborted/mean"], out["response_length_non_aborted/min"]) == (2.0, 1.0)
    assert out["response_length_non_aborted/clip_ratio"] == pytest.approx(1 / 3)
    assert (out["response_length/mean"], out["response_length/min"]) == (1.5, 0.0)  # every row, as verl
    none = batch_metrics(scores[3:], token_rewards[3:], mask[3:], mask[3:], mask[3:], 3)
    assert np.isnan(none["critic/score/mean"]) and none["response/aborted_ratio"] == 1.0
