"""trainer.balance_batch: whole prompt groups move between DP ranks so that each rank holds about the same
number of tokens. The partition against a hand count, and at DP 2 (gloo) the moved rows against the rows
gathered from every rank, picked by the partition (an independent path), with verl's global_seqlen metrics."""
import pytest
import torch

from dist_helper import run_distributed

N = 2  # rollout.n: rows per prompt group


def test_groups_by_falling_size_go_to_the_lightest_part_with_room():
    # sorted: 10 (0), 10 (3), 5 (4), 5 (5), 1 (1), 1 (2): parts take 0 / 3, then 4 / 5, then 1 / 2
    from hybridrl.trainer.balance import balanced_parts

    assert balanced_parts([10, 1, 1, 10, 5, 5], 2) == [[0, 1, 4], [2, 3, 5]]
    # as generated, rank 0 holds 10 + 9 + 8 and rank 1 1 + 2 + 3 tokens; balanced 10 + 3 + 2 vs 9 + 8 + 1
    assert balanced_parts([10, 9, 8, 1, 2, 3], 2) == [[0, 4, 5], [1, 2, 3]]
    assert balanced_parts([4, 4, 4, 4], 4) == [[0], [1], [2], [3]]
    with pytest.raises(ValueError, match="equal parts"):
        balanced_parts([1, 2, 3], 2)


def _batch(rank: int, groups: int, width: int):
    """Rank 0's groups long, rank 1's short: row r of group g has 2 * width - ... real tokens."""
    rows = groups * N
    lengths = torch.tensor([(width - 1 - (g % 3)) if rank == 0 else (1 + g % 2) for g in range(groups)
                            for _ in range(N)])
    mask = (torch.arange(width)[None, :] < lengths[:, None]).long()
    ids = torch.arange(rows * width).view(rows, width) + 10_000 * rank  # every row its own ids
    return {"input_ids": ids, "attention_mask": mask, "response_mask": mask.float(), "done": mask[:, -1].bool(),
            "routes": (ids % 97).to(torch.int16)}, torch.arange(rows, dtype=torch.float32) + 100 * rank


def _moved(groups: int, width: int) -> dict:
    from hybridrl.parallel.distributed import current_groups, init_model_parallel
    from hybridrl.trainer.balance import balance_batch
    from hybridrl.trainer.step_batch import gather_dp

    init_model_parallel(1, 1)
    g = current_groups()
    batch, scores = _batch(g.dp_rank, groups, width)
    everything = {k: gather_dp(v.long(), g) if v.dtype in (torch.bool, torch.int16) else gather_dp(v, g)
                  for k, v in batch.items()}
    everything["scores"] = gather_dp(scores, g)
    moved, moved_scores, metrics = balance_batch(batch, scores, N, g)
    return {"moved": moved, "scores": moved_scores, "metrics": metrics, "everything": everything, "rank": g.dp_rank}


@pytest.mark.distributed
def test_groups_move_whole_to_their_balanced_rank():
    from hybridrl.trainer.balance import balanced_parts

    groups, width = 6, 12
    runs = run_distributed(_moved, 2, groups, width)
    every = runs[0]["everything"]
    tokens = every["attention_mask"].sum(-1).view(-1, N).sum(-1)
    parts = balanced_parts(tokens.tolist(), 2)
    before = tokens.view(2, -1).sum(-1)
    after = [int(tokens[p].sum()) for p in parts]
    assert max(after) < max(before) and max(after) - min(after) <= int(tokens.max())
    for res in runs:
        rows = torch.tensor([gr * N + j for gr in parts[res["rank"]] for j in range(N)])
        for key, t in res["moved"].items():
            want = every[key][rows]
            assert torch.equal(t.to(want.dtype), want), key
        assert res["moved"]["done"].dtype == torch.bool and res["moved"]["routes"].dtype == torch.int16
        assert torch.equal(res["scores"], every["scores"][rows])
        assert int(res["moved"]["attention_mask"].sum()) == after[res["rank"]]
        assert res["metrics"] == {"global_seqlen/min": float(before.min()), "global_seqlen/max": float(before.max()),
                                  "global_seqlen/minmax_diff": float(before.max() - before.min()),
                                  "global_seqlen/balanced_min": float(min(after)),
                                  "global_seqlen/balanced_max": float(max(after)),
                                  "global_seqlen/mean": float(before.sum()) / 2}


def _on_device():
    import types

    import torch.distributed as dist

    from virtual_device import VIRTUAL

    from hybridrl.trainer.balance import balance_batch

    rank = dist.get_rank()
    groups = types.SimpleNamespace(dp=2, dp_rank=rank, dp_group=dist.group.WORLD, device=VIRTUAL)
    batch, scores = _batch(rank, 4, 8)
    moved, moved_scores, metrics = balance_batch({k: v.to(VIRTUAL) for k, v in batch.items()}, scores.to(VIRTUAL),
                                                 N, groups)
    return {k: v.device == VIRTUAL for k, v in moved.items()}, moved_scores.device == VIRTUAL, metrics


@pytest.mark.distributed
def test_balancing_runs_on_the_device():
    """Every collective of the move gets device tensors (nccl refuses host ones); what moved stays there."""
    for placed, scores_placed, metrics in run_distributed(_on_device, 2, on_virtual_device=True, timeout=120):
        assert all(placed.values()) and scores_placed and metrics["global_seqlen/balanced_max"] > 0


def test_on_by_default_as_verl_unless_the_prompts_stream():
    import os

    from hybridrl.config.io import load_config
    from hybridrl.trainer.balance import balancing

    tiny = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "configs", "tiny_cpu.yaml")
    assert balancing(load_config(tiny, []))
    assert not balancing(load_config(tiny, ["trainer.balance_batch=false"]))
    assert not balancing(load_config(tiny, ["async_training.stream_prompts=1"]))


def _once_per_replica():
    import types

    import torch.distributed as dist

    from hybridrl.trainer.step_batch import once_per_replica

    rank = dist.get_rank()
    groups = types.SimpleNamespace(replica_size=2, replica=dist.group.WORLD)
    value = once_per_replica(lambda: ("rank", rank), groups)
    errors = []
    for fn in (lambda: 1 / 0, lambda: lambda: None):  # fn raises; its result does not pickle
        try:
            once_per_replica(fn, groups, LookupError)
            errors.append(None)
        except Exception as err:  # noqa: BLE001 (the type is what is checked)
            errors.append((type(err).__name__, str(err)))
    return value, errors


@pytest.mark.distributed
def test_once_per_replica_runs_on_rank_0_and_fails_everywhere():
    """`step_batch.once_per_replica` (the reward's path): rank 0's result on both ranks; when it raises or its
    result cannot be sent, rank 0 raises that and its peer the given error naming it, instead of waiting."""
    (first, first_errors), (second, second_errors) = run_distributed(_once_per_replica, 2, timeout=120)
    assert first == second == ("rank", 0)
    assert first_errors[0][0] == "ZeroDivisionError" and first_errors[1][0] in ("PicklingError", "AttributeError")
    assert [e[0] for e in second_errors] == ["LookupError", "LookupError"]
    assert "ZeroDivisionError" in second_errors[0][1] and "rank 0 of this model replica" in second_errors[0][1]


def test_at_dp_1_nothing_moves_and_the_step_tokens_are_logged():
    """verl logs global_seqlen/* at any DP size; at DP 1 every figure is the step's token count (a hand count)."""
    from types import SimpleNamespace

    from hybridrl.trainer.balance import balance_batch

    batch, scores = _batch(0, 3, 12)
    total = float(batch["attention_mask"].sum())  # rows of 11, 10, 9 real tokens, twice each: 60
    assert total == 60.0
    moved, moved_scores, metrics = balance_batch(batch, scores, N, SimpleNamespace(dp=1))
    assert moved is batch and moved_scores is scores
    assert metrics == {"global_seqlen/min": total, "global_seqlen/max": total, "global_seqlen/minmax_diff": 0.0,
                       "global_seqlen/balanced_min": total, "global_seqlen/balanced_max": total,
                       "global_seqlen/mean": total}
