"""DAPO dynamic sampling (`algorithm.filter_groups`): which groups are kept, how many generation batches
it takes, and the same global batch at DP 1 and 2.

The generation batches are built by hand: global prompt p has rollout.n responses whose accuracy is
1 for response j < ACC_ONES[p % 4] (so prompts with p % 4 in (0, 3) have mixed groups and are kept,
the others all-equal and dropped); prompt widths grow with each generation batch, so the kept rows
must be re-padded to one width. The expected batch is written down from that rule, not computed by
the code under test.
"""
import os

import pytest
import torch

from dist_helper import run_distributed

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = os.path.join(ROOT, "configs", "tiny_cpu.yaml")
T, N, R, PAD = 4, 3, 2, 0     # train_batch_size, rollout.n, response width, pad id
ACC_ONES = (0, 1, 2, 3)       # responses with acc 1 of prompt p, by p % 4: 0 and 3 are all-equal groups


def _cfg(extra=()):
    from hybridrl.config.io import load_config

    return load_config(TINY, [f"data.train_batch_size={T}", f"rollout.n={N}", "algorithm.filter_groups.enable=true",
                              *extra])


def _generation_batch(prompt_ids, width):
    """The rows of this rank's prompts: prompt columns of `width` (one real token, value p), responses 10p+j."""
    rows = len(prompt_ids) * N
    p = torch.tensor(prompt_ids).repeat_interleave(N)
    j = torch.arange(N).repeat(len(prompt_ids))
    prompt = torch.full((rows, width), PAD)
    prompt[:, -1] = p
    pmask = torch.zeros(rows, width)
    pmask[:, -1] = 1
    responses = (10 * p + j).unsqueeze(1).repeat(1, R)
    batch = {"input_ids": torch.cat([prompt, responses], 1), "attention_mask": torch.cat([pmask, torch.ones(rows, R)], 1),
             "prompt_mask": pmask, "responses": responses, "response_mask": torch.ones(rows, R)}
    acc = (j < torch.tensor([ACC_ONES[int(x) % 4] for x in p])).float()
    return batch, acc


def _sample(extra, gen_batches, all_wrong=False):
    """sample_filtered on this rank's share of the hand-built generation batches; returns global results."""
    from hybridrl.trainer.dynamic_sampling import sample_filtered
    from hybridrl.parallel.distributed import init_model_parallel
    from hybridrl.trainer.step_batch import gather_dp

    groups = init_model_parallel(1, 1)
    per_rank = T // groups.dp
    batches = iter([list(range(k * T + groups.dp_rank * per_rank, k * T + (groups.dp_rank + 1) * per_rank))
                    for k in range(gen_batches)])
    calls = []

    def generate_and_score(prompt_ids):
        calls.append(prompt_ids)
        batch, acc = _generation_batch(prompt_ids, width=2 + len(calls))
        acc = torch.zeros_like(acc) if all_wrong else acc
        scores = 0.1 + acc  # what the advantages see; "score" is the same before shaping here
        return batch, scores, scores.clone(), {"acc": acc.tolist(), "pred": ["x"] * len(acc)}

    batch, scores, metrics = sample_filtered(generate_and_score, next(batches), lambda: next(batches), _cfg(extra),
                                             groups, PAD, step=1)
    full = {k: gather_dp(v, groups) for k, v in batch.items()}
    return full, gather_dp(scores, groups), metrics, len(calls)


def _expected_prompts():
    kept = [p for p in range(4 * T) if ACC_ONES[p % 4] not in (0, N)]
    return kept[:T]


@pytest.mark.parametrize("dp", [1, 2])
def test_keeps_mixed_groups_in_global_order_at_any_dp(dp):
    out = run_distributed(_sample, dp, [], 4)
    for full, scores, metrics, calls in out:
        # prompts 1, 2, 5, 6 are mixed: two generation batches of 4 prompts fill the batch of 4 groups
        want = _expected_prompts()
        assert want == [1, 2, 5, 6] and calls == 2
        assert full["input_ids"][:, -R - 1].tolist() == [p for p in want for _ in range(N)]
        assert full["responses"][:, 0].tolist() == [10 * p + j for p in want for j in range(N)]
        assert full["prompt_mask"].shape[1] == 4  # re-padded to the wider (second) batch's prompt width
        assert full["prompt_mask"].sum(1).tolist() == [1.0] * T * N
        acc = [float(j < ACC_ONES[p % 4]) for p in want for j in range(N)]
        assert scores.tolist() == pytest.approx([0.1 + a for a in acc])
        assert metrics == {"train/num_gen_batches": 2.0, "train/filter_groups/kept_ratio": 0.5}


def test_too_few_mixed_groups_stop_with_the_fix_named():
    from hybridrl.trainer.dynamic_sampling import FilterGroupsError

    with pytest.raises(Exception) as err:
        run_distributed(_sample, 1, ["algorithm.filter_groups.max_num_gen_batches=2"], 4, True)
    assert FilterGroupsError.__name__ in str(err.value)
    assert "2 generation batches kept 0 of 4 groups" in str(err.value) and "max_num_gen_batches" in str(err.value)


def test_filter_values_by_metric():
    from hybridrl.trainer.dynamic_sampling import FilterGroupsError, filter_values, kept_groups

    raw, shaped = torch.tensor([1.0, 1.0, 0.3, 0.3]), torch.tensor([1.0, 0.5, 0.3, 0.3])
    assert kept_groups(filter_values("score", raw, shaped, {}), 2).tolist() == [False, False]
    assert kept_groups(filter_values("seq_reward", raw, shaped, {}), 2).tolist() == [True, False]
    assert kept_groups(filter_values("reward", raw, shaped, {}), 2).tolist() == [True, False]  # verl 0.9.1's name
    from hybridrl.config import Config
    assert Config().algorithm.filter_groups.metric == "reward"  # verl 0.9.1's default
    assert kept_groups(filter_values("acc", raw, shaped, {"acc": [1, 0, 0, 0]}), 2).tolist() == [True, False]
    assert kept_groups(filter_values("acc", raw, shaped, {}), 2).tolist() == [False, False]  # acc falls back to score
    assert kept_groups(filter_values("acc", raw, shaped, {}), 1).tolist() == [True] * 4  # singletons are kept
    with pytest.raises(FilterGroupsError, match="metric='pred' is not a numeric value"):
        filter_values("pred", raw, shaped, {"pred": ["1", "2", "3", "4"]})


def _arith_loader(tmp_path):
    from hybridrl.config import DataConfig
    from hybridrl.data.prompts import PromptLoader, make_train_loader
    from hybridrl.data.synthetic import write_synthetic_arith
    from hybridrl.tokenizer import load_tokenizer

    train, _ = write_synthetic_arith(str(tmp_path), n_train=20, n_test=1, seed=0)
    loader = make_train_loader(DataConfig(train_files=[train], train_batch_size=4), load_tokenizer("builtin:tiny"))
    assert isinstance(loader, PromptLoader) and len(loader) == 5
    return loader


def test_resume_after_dynamic_sampling_continues_after_every_batch_the_step_drew(tmp_path):
    """Steps of 3, 3 and 2 generation batches (the second crosses into epoch 1): a loader resumed after any of
    them serves the batch the uninterrupted run serves next, never one a step already used."""
    from hybridrl.trainer.loop import PromptFeed

    plain = iter(_endless_batches(_arith_loader(tmp_path)))
    uninterrupted = [next(plain) for _ in range(9)]
    feed = PromptFeed(_arith_loader(tmp_path), ahead=False)
    drawn = 0
    for gen_batches in (3, 3, 2):
        prompts = [feed.step_prompts(prefetch=False)] + [feed.more() for _ in range(gen_batches - 1)]
        assert [p.index for p in prompts] == uninterrupted[drawn:drawn + gen_batches]
        drawn += gen_batches
        resumed = _arith_loader(tmp_path)
        resumed.load_state_dict(feed.resume_state())
        assert PromptFeed(resumed, ahead=False).step_prompts(prefetch=False).index == uninterrupted[drawn]


def test_resume_with_staleness_one_starts_at_the_prefetched_prompts(tmp_path):
    from hybridrl.trainer.loop import PromptFeed

    plain = iter(_endless_batches(_arith_loader(tmp_path)))
    uninterrupted = [next(plain) for _ in range(3)]
    feed = PromptFeed(_arith_loader(tmp_path), ahead=True)
    assert feed.step_prompts(prefetch=True).index == uninterrupted[0] and feed.upcoming.index == uninterrupted[1]
    resumed = _arith_loader(tmp_path)
    resumed.load_state_dict(feed.resume_state())  # the upcoming prompts are generated again (or restored in flight)
    assert PromptFeed(resumed, ahead=True).step_prompts(prefetch=False).index == uninterrupted[1]


def _endless_batches(loader):
    """Each global batch's row indices, epoch after epoch, by iterating the loader as is."""
    while True:
        for batch in loader:
            yield batch.index


def test_the_epoch_of_each_step_as_verls_loop_counts_it(tmp_path):
    """verl logs training/epoch, the pass over the data its step's batch belongs to (from 0): 5 batches an epoch,
    so steps 1-5 are epoch 0 and 6-10 epoch 1, with staleness 1's prefetched batch counted where it was drawn
    and a resumed feed picking up the epoch of the batch it serves."""
    from hybridrl.trainer.loop import PromptFeed

    for ahead in (False, True):
        feed = PromptFeed(_arith_loader(tmp_path), ahead=ahead)
        epochs = []
        for _ in range(11):
            feed.step_prompts(prefetch=ahead)
            epochs.append(feed.epoch)
        assert epochs == [0] * 5 + [1] * 5 + [2], ahead
    feed = PromptFeed(_arith_loader(tmp_path), ahead=False)
    for _ in range(5):
        feed.step_prompts(prefetch=False)
    resumed = _arith_loader(tmp_path)
    resumed.load_state_dict(feed.resume_state())
    again = PromptFeed(resumed, ahead=False)
    again.step_prompts(prefetch=False)
    assert again.epoch == 1
