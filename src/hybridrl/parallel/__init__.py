"""torch.distributed and megatron-core process groups, and the CPU compatibility patches.

distributed.py   the process groups of a run (torchrun or SLURM), one device per process, DP collectives
cpu_compat.py    the documented shims that let megatron-core run under gloo without CUDA
tp_collectives.py the few tensor-parallel collectives of the lean decode loop
split_world.py   split placement: a torch.distributed world per role on one store, and bridges between roles

This is the floor of the tree: it must not import any other hybridrl package.
"""
