"""Launch environment parsing, megatron-core groups under gloo, and the test harness itself."""
import pytest
import torch

from dist_helper import run_distributed

from hybridrl.parallel.distributed import _first_slurm_host, export_launch_env, launch_env


def test_launch_env_torchrun_and_slurm():
    le = launch_env({"RANK": "3", "WORLD_SIZE": "8", "LOCAL_RANK": "1", "MASTER_ADDR": "h0", "MASTER_PORT": "1234"})
    assert (le.rank, le.world_size, le.local_rank, le.master_addr, le.master_port) == (3, 8, 1, "h0", 1234)
    le = launch_env({"SLURM_PROCID": "5", "SLURM_NTASKS": "16", "SLURM_LOCALID": "5",
                     "SLURM_JOB_NODELIST": "gpu[012-015,020]"})
    assert (le.rank, le.world_size, le.local_rank, le.master_addr) == (5, 16, 5, "gpu012")
    assert launch_env({}).world_size == 1
    assert _first_slurm_host("node7") == "node7"


def test_bare_srun_gets_the_variables_vllm_external_launcher_reads():
    env = {"SLURM_PROCID": "5", "SLURM_NTASKS": "16", "SLURM_LOCALID": "1", "SLURM_JOB_NODELIST": "gpu[012-015]",
           "MASTER_PORT": "4242"}
    export_launch_env(launch_env(env), env)
    assert (env["RANK"], env["LOCAL_RANK"], env["WORLD_SIZE"], env["MASTER_ADDR"], env["MASTER_PORT"]) == (
        "5", "1", "16", "gpu012", "4242")
    torchrun = {"RANK": "3", "WORLD_SIZE": "8", "LOCAL_RANK": "1", "MASTER_ADDR": "h0"}
    export_launch_env(launch_env(torchrun), torchrun)
    assert (torchrun["RANK"], torchrun["LOCAL_RANK"], torchrun["MASTER_ADDR"]) == ("3", "1", "h0")


def _groups_body(tp, pp):
    import torch.distributed as dist

    from hybridrl.parallel.distributed import init_model_parallel

    g = init_model_parallel(tp, pp)
    ranks = lambda group: dist.get_process_group_ranks(group)
    # CUDA RNG tracker routed to CPU: fork works and TP ranks draw different numbers.
    from megatron.core.tensor_parallel import get_cuda_rng_tracker
    with get_cuda_rng_tracker().fork():
        draw = torch.rand(1).item()
    return dict(tp=ranks(g.tp_group), pp=ranks(g.pp_group), dp=ranks(g.dp_group), dp_rank=g.dp_rank, draw=draw)


@pytest.mark.distributed
def test_megatron_groups_tp2_pp2():
    outs = run_distributed(_groups_body, 4, 2, 2)
    assert [o["tp"] for o in outs] == [[0, 1], [0, 1], [2, 3], [2, 3]]
    assert [o["pp"] for o in outs] == [[0, 2], [1, 3], [0, 2], [1, 3]]
    assert all(o["dp"] == [r] for r, o in enumerate(outs))
    assert outs[0]["draw"] != outs[1]["draw"]


def _fails_on_rank_one():
    import torch.distributed as dist

    if dist.get_rank() == 1:
        raise ValueError("boom on purpose")
    return dist.get_rank()


def test_harness_surfaces_failing_rank():
    with pytest.raises(AssertionError, match=r"(?s)rank 1 of 2 failed.*ValueError: boom on purpose"):
        run_distributed(_fails_on_rank_one, 2, timeout=60)


def _hangs():
    import time

    time.sleep(60)


def test_harness_times_out():
    with pytest.raises(AssertionError, match="timed out"):
        run_distributed(_hangs, 2, timeout=5)
