"""ModelEngine (workers/engine.py) at PP > 1: the last stage's per-micro-batch results reach every
stage on the run's device, and what travels pickled holds host tensors only (a pickled CUDA tensor
unpickles onto the sender's GPU). On the emulated accelerator of tests/virtual_device.py."""
import pytest
import torch

from dist_helper import run_distributed


def _pp2_results():
    import dataclasses

    import torch.distributed as dist
    from torch.utils._pytree import tree_flatten

    from virtual_device import VIRTUAL, is_on_device, virtual_device

    import hybridrl.workers.engine as engine_module
    from hybridrl.parallel.distributed import init_model_parallel

    groups = dataclasses.replace(init_model_parallel(1, 2), device=VIRTUAL)
    sent, real = [], dist.broadcast_object_list

    def spy(objects, src=0, group=None, device=None):
        if dist.get_rank() == src:
            sent.extend(t for t in tree_flatten(objects)[0] if isinstance(t, torch.Tensor))
        return real(objects, src=src, group=group, device=device)

    def last_stage_stats(module, micro_batches, loss_fn, forward_only, token_fn=None):
        return [{"actor/pg_loss": torch.tensor(0.25 * i, device="cuda"), "finite": 1.0,
                 "rows": {"log_probs": torch.arange(6.0, device="cuda").view(2, 3) + i}} for i in range(2)]

    engine_module.pipeline_forward, dist.broadcast_object_list = last_stage_stats, spy
    with virtual_device():
        engine = engine_module.ModelEngine(torch.nn.Linear(1, 1), groups)
        stats = engine.run([{}, {}], None, forward_only=True)
        received = [t for t in tree_flatten(stats)[0] if isinstance(t, torch.Tensor)]
        return dict(last=groups.is_last_stage, sent_on_device=[is_on_device(t) for t in sent],
                    received_on_device=[is_on_device(t) for t in received],
                    values=[torch.Tensor.clone(t).as_subclass(torch.Tensor) for t in received],
                    floats=[s["finite"] for s in stats])


@pytest.mark.distributed
def test_pp_results_travel_on_the_host_and_arrive_on_the_run_device():
    first, last = sorted(run_distributed(_pp2_results, 2), key=lambda r: r["last"])
    assert last["sent_on_device"] == [False] * 4, "device tensors were pickled"
    assert first["received_on_device"] == last["received_on_device"] == [True] * 4
    for a, b in zip(first["values"], last["values"]):
        assert torch.equal(a, b)
    assert first["floats"] == [1.0, 1.0]
