"""DAPO's overlong reward shaping (verl's DAPO reward manager, `reward.overlong_buffer`).

A response of L tokens with max length M and buffer length B loses
    min(0, -(L - (M - B)) / B * penalty_factor)
from its score: nothing up to M - B tokens, then linearly more, -penalty_factor at M. Computed in
float32 like verl's reward tensor. Pure function: no I/O, no state.
"""
from __future__ import annotations

import torch


def overlong_penalty(lengths: torch.Tensor, max_response_length: int, buffer_len: int,
                     penalty_factor: float) -> torch.Tensor:
    """[B] response lengths (tokens) -> [B] penalties <= 0 (float32)."""
    if buffer_len <= 0:
        raise ValueError(f"overlong buffer length must be > 0, got {buffer_len}")
    exceed = lengths.to(torch.float32) - (max_response_length - buffer_len)
    return torch.clamp(-exceed / buffer_len * penalty_factor, max=0.0)
