"""The PPO/GRPO loop (provisional: until the trainer lands this only checks the parallel layout)."""
from __future__ import annotations

from hybridrl.config import Config


class TrainingError(RuntimeError):
    """A run that cannot go on (NaN loss, broken checkpoint); the message names step and tensor."""


def run(cfg: Config, dry_run: bool = False, profile: bool = False) -> int:
    import torch.distributed as dist

    from hybridrl.config_io import to_yaml
    from hybridrl.layout import derive_layout
    from hybridrl.log import print0, setup_logging
    from hybridrl.parallel.distributed import init_distributed, init_model_parallel

    setup_logging()
    le = init_distributed()
    layout = derive_layout(cfg, le.world_size, vocab_size=64)
    print0(to_yaml(cfg))
    groups = init_model_parallel(layout.tp, layout.pp, seed=cfg.trainer.seed)
    print0(f"layout: {layout.describe()}")
    dist.barrier()
    print0(f"rank0 groups: tp_rank={groups.tp_rank} pp_rank={groups.pp_rank} dp_rank={groups.dp_rank}")
    print0("Layout OK (the trainer is not built yet)")
    return 0
