"""torch.distributed and megatron-core process groups, and the CPU compatibility patches."""
