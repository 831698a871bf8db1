"""Collectives on the run's device: small pieces of split placement and expert parallelism, run on the
emulated accelerator (tests/virtual_device.py through `run_distributed(..., on_virtual_device=True)`), where
a tensor collective on a host tensor fails as it would on an nccl group of a GPU run."""
import pytest

from dist_helper import run_distributed


class _Store:
    """The handshake key of partial rollout, as the leader's TCPStore holds it; counts reads."""

    def __init__(self):
        self.value, self.reads = b"generating", 0

    def get(self, key):
        self.reads += 1
        return self.value

    def set(self, key, value):
        self.value = value.encode()

    def compare_set(self, key, expected, value):
        if self.value == expected.encode():
            self.set(key, value)
        return self.value


class _Receiver:
    def __init__(self):
        self.taken = 0

    def receive(self, engine):
        self.taken += 1
        return 7


def _partial_rollout_flag():
    import torch.distributed as dist

    from virtual_device import VIRTUAL

    from hybridrl.trainer.split import _PartialWeights

    leader = dist.get_rank() == 0
    store, receiver = _Store(), _Receiver()
    partial = _PartialWeights(store if leader else None, receiver, None, leader, VIRTUAL)
    partial.begin()
    took = []
    for step in range(1, 13):
        if step == 6 and leader:
            store.set("k", "weights")  # the trainers claimed the generation
        if partial.between_steps():
            took.append(step)
    partial.end()
    return dict(took=took, version=partial.version, taken=receiver.taken, reads=store.reads if leader else None)


def _expert_widths():
    import types

    import torch.distributed as dist

    from virtual_device import VIRTUAL

    from hybridrl.parallel.expert_lockstep import width_agreement

    rank = dist.get_rank()
    groups = types.SimpleNamespace(ep=2, ep_group=dist.group.WORLD, device=VIRTUAL)
    agree = width_agreement(groups)
    widths = agree([(3 + rank, 9 - rank), (5, 2 + 2 * rank)])
    try:
        agree([(1, 1)] * (1 + rank))
        mismatch = None
    except RuntimeError as err:
        mismatch = str(err)
    return dict(widths=widths, mismatch=mismatch)


def _pieces():
    return _partial_rollout_flag(), _expert_widths(), _handoff_verdicts()


@pytest.fixture(scope="module")
def pieces():
    """One launch on the emulated accelerator for the small pieces below."""
    return run_distributed(_pieces, 2, on_virtual_device=True, timeout=120)


@pytest.mark.distributed
def test_partial_rollout_flag_and_expert_widths_run_on_the_device(pieces):
    """The partial-rollout flag is agreed on the rollout world's device and the leader reads the store every
    4th decode step only; expert-parallel widths are agreed on the device (both were host tensors: nccl)."""
    results = [(partial, experts) for partial, experts, _ in pieces]
    for partial, _ in results:
        assert partial["took"] == [8] and partial["version"] == 7 and partial["taken"] == 1
    assert results[0][0]["reads"] == 3  # steps 4, 8, 12 of 12
    for _, experts in results:
        assert experts["widths"] == [(4, 9), (5, 4)]
        assert "different numbers of micro-batches (1 to 2)" in experts["mismatch"]


def _handoff_verdicts():
    """The handoff's agreement on the device (`agree_on_failure`): nothing found on any rank; a fault on rank 0
    only, unnamed; a digest mismatch on rank 0 only, naming its tensor."""
    import types

    import torch.distributed as dist

    from virtual_device import VIRTUAL

    from hybridrl.models import hf_convert as hc
    from hybridrl.models.gpt import GPTSpec
    from hybridrl.placement import engine_layout as el
    from hybridrl.placement.readback import HandoffError

    rank = dist.get_rank()
    groups = types.SimpleNamespace(tp=2, tp_group=dist.group.WORLD, pp=1, pp_group=None, ep=1, ep_group=None)
    spec = GPTSpec(num_layers=1, hidden_size=8, num_attention_heads=2, num_key_value_heads=2, intermediate_size=6,
                   vocab_size=8, max_position_embeddings=4)
    order = list(hc.hf_to_mcore_name_map(spec))
    el.agree_on_failure(None, groups, VIRTUAL, HandoffError, order, spec)
    out = []
    for error in (HandoffError("rank 0's own"), HandoffError("rank 0's digest", order[2])):
        try:
            el.agree_on_failure(error if rank == 0 else None, groups, VIRTUAL, HandoffError, order, spec)
            out.append(None)
        except HandoffError as err:
            out.append(str(err))
    return out, order[2]


@pytest.mark.distributed
def test_handoff_verdicts_are_agreed_on_the_device(pieces):
    """A rank with nothing found still joins the verdict on the device (it was a host flag: nccl), and a fault
    found on one rank fails the handoff on both, the finder with its own message, its peer naming the tensor
    where the finder's error names one."""
    (first, victim), (second, _) = (verdict for _, _, verdict in pieces)
    assert first == ["rank 0's own", "rank 0's digest"] and all("another rank" in e for e in second)
    assert victim in second[1] and victim not in second[0]


MOE = ["model.architecture=qwen3_moe", "model.num_experts=4", "model.moe_topk=2", "model.moe_intermediate_size=32"]


@pytest.mark.distributed
def test_one_moe_step_at_ep2_on_the_device(tmp_path):
    """A whole GRPO step of a MoE actor at EP 2 on the emulated accelerator: expert-parallel agreements,
    megatron's token dispatcher and the router metrics all run on device tensors."""
    from test_device_placement import SMALL, _check, _paths, _step_on_virtual_device

    overrides = SMALL + _paths(tmp_path) + MOE + ["algorithm.adv_estimator=grpo", "parallel.expert_model_parallel_size=2"]
    _check(run_distributed(_step_on_virtual_device, 2, overrides, timeout=300))
