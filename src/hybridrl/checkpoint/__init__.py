"""Checkpoints of a run on megatron-core dist_checkpointing: resumable at another TP x PP x DP,
one copy of each shard, optional async writing, crash-safe publication.

folders.py   naming, atomic publication, pointer file, pruning, resume-path checks (no collectives)
integrity.py every file's size and crc32, listed in meta.json at publish and checked before a load
resume.py    which checkpoint a resume takes (damaged ones skipped); load errors that name the file
sharded.py   one role's model + optimizer as sharded state dicts; shape checks; load/save of a role
writer.py    the collective save (sync or async) and resume of a whole run, RNG streams, meta.json
to_hf.py     a checkpoint's actor as an HF folder, offline, at any world size

Checkpoints stand on models, parallel and config; they must not import workers, rollout engines
or the trainer (the trainer hands them its roles' modules and optimizers).
"""
from hybridrl.checkpoint.folders import CheckpointError, CheckpointManager, read_meta
from hybridrl.checkpoint.resume import choose_checkpoint, naming_damage
from hybridrl.checkpoint.rng import rng_state, set_rng_state
from hybridrl.checkpoint.writer import CheckpointWriter, load_checkpoint

__all__ = ["CheckpointError", "CheckpointManager", "CheckpointWriter", "choose_checkpoint", "load_checkpoint",
           "naming_damage", "read_meta", "rng_state", "set_rng_state"]
