"""How a model's forward lays out the sequence: padded or packed rows, split over TP (sequence
parallelism) and over CP (context parallelism); read from the built model, so every role that runs a
model through `pipeline_forward` gets the layout it was built with."""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from hybridrl.models.packing import Pack
from hybridrl.parallel.expert_lockstep import agree_max


@dataclass(frozen=True)
class SequenceLayout:
    packed: bool
    whole_rows: bool
    """Context parallelism on padded rows (model.use_remove_padding false): each row packed at the micro-batch's
    width, its padding behind its tokens (computed, as padded rows are, but never attended by a real token)."""
    sp: int
    """TP size the sequence is split over (1 without sequence parallelism)."""
    sp_rank: int
    cp: int
    cp_rank: int
    cp_group: object
    ep_group: object
    """Expert-parallel peers that must forward packs of one length (None for a dense model or EP 1)."""

    @staticmethod
    def of(model) -> "SequenceLayout":
        from megatron.core.utils import get_model_config

        inner = model
        while hasattr(inner, "module"):
            inner = inner.module
        config = get_model_config(model)
        groups = getattr(inner, "pg_collection", None)
        sp = config.tensor_model_parallel_size if config.sequence_parallel else 1
        cp = config.context_parallel_size
        ep_group = getattr(groups, "ep", None) if config.num_moe_experts else None
        ep_group = ep_group if ep_group is not None and dist.get_world_size(ep_group) > 1 else None
        remove_padding = bool(getattr(inner, "remove_padding", False))
        return SequenceLayout(
            packed=remove_padding or cp > 1, whole_rows=cp > 1 and not remove_padding, sp=sp,
            sp_rank=dist.get_rank(groups.tp) if sp > 1 else 0, cp=cp,
            cp_rank=dist.get_rank(groups.cp) if cp > 1 else 0, cp_group=groups.cp if groups is not None else None,
            ep_group=ep_group)

    @property
    def align(self) -> int:
        """Every packed row is padded to a multiple of this (SP splits the pack over TP, CP each row in 2·CP)."""
        return self.sp * (2 * self.cp if self.cp > 1 else 1)

    @property
    def sp_split(self) -> tuple[int, int] | None:
        return (self.sp_rank, self.sp) if self.sp > 1 else None

    def pack(self, attention_mask, min_total: int = 0) -> Pack:
        return Pack.of(attention_mask, self.align, self.cp, self.cp_rank, min_total, self.whole_rows)

    def agree_pack_lengths(self, micro_batches: list[dict]) -> list[dict]:
        """Each micro-batch with "pack_length": this rank's part of its pack, after expert-parallel peers agree
        on the whole pack's length (the longest of theirs)."""
        totals = [Pack.length(mb["attention_mask"] if mb.get("attention_mask") is not None
                              else torch.ones_like(mb["input_ids"]), self.align, self.whole_rows) for mb in micro_batches]
        if self.ep_group is not None:
            totals = agree_max(totals, self.ep_group, micro_batches[0]["input_ids"].device)
        return [{**mb, "pack_length": total} for mb, total in zip(micro_batches, totals)]
