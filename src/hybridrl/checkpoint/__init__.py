"""Checkpoints of a run on megatron-core dist_checkpointing: resumable at another TP x PP x DP,
one copy of each shard, optional async writing, crash-safe publication.

folders.py  naming, atomic publication, pointer file, pruning, resume-path checks (no collectives)
sharded.py  one role's model + optimizer as sharded state dicts; shape checks; load/save of a role
writer.py   the collective save (sync or async) and resume of a whole run, RNG streams, meta.json
to_hf.py    a checkpoint's actor as an HF folder, offline, at any world size

Checkpoints stand on models, parallel and config; they must not import workers, rollout engines
or the trainer (the trainer hands them its roles' modules and optimizers).
"""
from hybridrl.checkpoint.folders import CheckpointError, CheckpointManager, read_meta
from hybridrl.checkpoint.rng import rng_state, set_rng_state
from hybridrl.checkpoint.writer import CheckpointWriter, load_checkpoint

__all__ = ["CheckpointError", "CheckpointManager", "CheckpointWriter", "load_checkpoint", "read_meta",
           "rng_state", "set_rng_state"]
