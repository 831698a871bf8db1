"""Role workers (actor, critic, reference) over megatron-core models."""
