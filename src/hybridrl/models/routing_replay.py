"""Routing replay (R3): an MoE model's forward uses given experts instead of choosing its own.

A model built with megatron's `moe_enable_routing_replay=True` gives each TopKRouter a `RouterReplay`;
told to REPLAY_FORWARD it takes the target expert ids and gathers its own scores at them, so the
routing weights (and their gradients) are still the trainer's, only the choice is the rollout's.
megatron also keeps every such router in one process-wide list, shared by every model of the process;
here each model's routers are addressed directly, so an actor's replay never reaches a reference or a
critic. Routes come as [B, S, L, k] (batch row, column, global MoE layer, choice), megatron's routers
take [S * B, k] in their [S, B] token order. Activation recomputation would re-run the router with the
last micro-batch's target, so replay and recomputation are not combined (config check).
"""
from __future__ import annotations

import contextlib

import torch


def replay_routers(model) -> list:
    """The model's routers that can replay, in layer order (empty for a dense model or replay off)."""
    return [m for m in model.modules() if getattr(m, "router_replay", None) is not None]


@contextlib.contextmanager
def replaying(model, routes: torch.Tensor | None, sequence_split: tuple[int, int] | None = None):
    """Inside the block, each router of `model` uses `routes[:, :, its global layer]`; nothing without routes.
    `sequence_split` (rank, size): under sequence parallelism a router sees only its TP rank's slice of the
    [S, B] tokens."""
    routers = replay_routers(model) if routes is not None else []
    if not routers:
        yield
        return
    from megatron.core.transformer.moe.router_replay import RouterReplayAction

    b, s = routes.shape[:2]
    for router in routers:
        layer = router.layer_number - 1
        target = routes[:, :, layer].transpose(0, 1).reshape(s * b, -1).long()
        if sequence_split is not None:
            rank, size = sequence_split
            target = target.view(size, -1, target.shape[-1])[rank]
        router.router_replay.clear_indices()
        router.router_replay.set_target_indices(target)
        router.router_replay.set_router_replay_action(RouterReplayAction.REPLAY_FORWARD)
    try:
        yield
    finally:
        for router in routers:
            router.router_replay.clear_indices()
            router.router_replay.clear_router_replay_action()
