"""Packed (THD) micro-batches: a micro-batch's rows as one sequence without padding, and back.

`Pack.of(attention_mask, align, cp_size, cp_rank)` lays the real tokens of each row (left-padded prompt +
right-padded response: contiguous) one after another; each row is padded at its end to a multiple of
`align` (TP under sequence parallelism x 2·CP under context parallelism, as verl's
`preprocess_packed_seqs` does), so a row's pad tokens follow its own last token and causal attention
within the row never reaches them. `cu_seqlens` are the padded boundaries: megatron's `PackedSeqParams`
(qkv_format "thd") takes them for attention (per-sequence causal) and RoPE (positions restart per row).
Under context parallelism this rank holds chunks r and 2·CP-1-r of every row (`context_parallel.zigzag_positions`).
Per-token results come back with `Pack.unpack` as [B, S] tensors in the rows' own columns, zero at padding,
differentiable. No torch.distributed here; the CP gather of per-token results is `gather_tokens`'s caller's.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


def next_token_labels(input_ids: torch.Tensor) -> torch.Tensor:
    """[B, S]: each column's next token in its row (0 at the last column)."""
    labels = torch.zeros_like(input_ids)
    labels[:, :-1] = input_ids[:, 1:]
    return labels


def _padded_lengths(real: torch.Tensor, align: int, whole_rows: bool) -> torch.Tensor:
    """Each row's length in the pack: its real tokens (or the micro-batch's width), at least 1, up to `align`."""
    b, s = real.shape
    lengths = torch.full((b,), s, device=real.device) if whole_rows else real.sum(1)
    return ((lengths.clamp(min=1) + align - 1) // align) * align


@dataclass
class Pack:
    rows: torch.Tensor
    """[N] batch row of each real token, in pack order."""
    cols: torch.Tensor
    """[N] column of each real token in its row."""
    dest: torch.Tensor
    """[N] index of each real token in the whole (all CP ranks') packed sequence."""
    cu_seqlens: torch.Tensor
    """int32 [B + 1]: padded row boundaries in the whole pack."""
    max_seqlen: int
    local: torch.Tensor | None
    """[T / CP] this CP rank's positions of the whole pack (None without context parallelism)."""
    shape: tuple

    @staticmethod
    def of(attention_mask: torch.Tensor, align: int = 1, cp_size: int = 1, cp_rank: int = 0,
           min_total: int = 0, whole_rows: bool = False) -> "Pack":
        """The pack of a [B, S] mask (1 = token). `min_total` (a multiple of `align`): the last row's padding
        makes the whole pack at least that long (expert-parallel ranks agree on one length). `whole_rows`:
        every row keeps the micro-batch's width (rounded up to `align`), its padding moved behind its tokens:
        the padded layout's cost, for context parallelism without model.use_remove_padding."""
        real = attention_mask.bool()
        b, s = real.shape
        padded = _padded_lengths(real, align, whole_rows)
        total = int(padded.sum())
        if min_total > total:
            padded[-1] += min_total - total
        cu = torch.zeros(b + 1, dtype=torch.int32, device=real.device)
        cu[1:] = padded.cumsum(0)
        rows, cols = real.nonzero(as_tuple=True)  # row-major: each row's tokens in column order
        first = torch.where(real.any(1), real.int().argmax(1), 0)
        last = s - 1 - real.flip(1).int().argmax(1)
        counts = real.sum(1)
        if bool(((last - first + 1 != counts) & (counts > 0)).any()):  # a hole would put two tokens in one place
            raise ValueError("packing needs each row's real tokens to be contiguous (attention_mask 0..0 1..1 0..0)")
        dest = cu.long()[rows] + cols - first[rows]
        local = None
        if cp_size > 1:
            from hybridrl.models.context_parallel import zigzag_positions

            local = zigzag_positions(cu, cp_size, cp_rank)
        return Pack(rows, cols, dest, cu, int(padded.max()), local, (b, s))

    @staticmethod
    def length(attention_mask: torch.Tensor, align: int = 1, whole_rows: bool = False) -> int:
        """The whole pack's length, without building it."""
        return int(_padded_lengths(attention_mask.bool(), align, whole_rows).sum())

    @property
    def total(self) -> int:
        return int(self.cu_seqlens[-1])

    def _whole(self, values: torch.Tensor, fill=0) -> torch.Tensor:
        """[B, S, ...] -> [T, ...]: the real tokens at their pack positions, `fill` at padding."""
        out = values.new_full((self.total,) + tuple(values.shape[2:]), fill)
        out[self.dest] = values[self.rows, self.cols]
        return out

    def pack(self, values: torch.Tensor, fill=0) -> torch.Tensor:
        """[B, S, ...] -> [1, T_local, ...]: this rank's part of the pack."""
        whole = self._whole(values, fill)
        return (whole if self.local is None else whole[self.local]).unsqueeze(0)

    def positions(self) -> torch.Tensor:
        """[1, T_local] position of each packed token within its row (RoPE restarts per row)."""
        row_start = torch.repeat_interleave(self.cu_seqlens[:-1].long(), (self.cu_seqlens[1:] - self.cu_seqlens[:-1]).long())
        whole = torch.arange(self.total, device=self.cu_seqlens.device) - row_start
        return (whole if self.local is None else whole[self.local]).unsqueeze(0)

    def next_token_labels(self, input_ids: torch.Tensor) -> torch.Tensor:
        """[1, T_local]: at each real token the row's next token (0 after a row's last token and at padding)."""
        return self.pack(next_token_labels(input_ids))

    def params(self, cp_group=None):
        """megatron's PackedSeqParams of this pack (THD; padded and unpadded boundaries are the same)."""
        from megatron.core.packed_seq_params import PackedSeqParams

        cu = self.cu_seqlens
        return PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, cu_seqlens_q_padded=cu,
                               cu_seqlens_kv_padded=cu, max_seqlen_q=self.max_seqlen, max_seqlen_kv=self.max_seqlen,
                               cp_group=cp_group)

    def unpack(self, whole: torch.Tensor) -> torch.Tensor:
        """[1, T, ...] per-token results of the whole pack (every CP rank's, in pack order) -> [B, S, ...],
        zero where the rows hold padding; differentiable."""
        whole = whole.squeeze(0)
        out = whole.new_zeros(self.shape + tuple(whole.shape[1:]))
        return out.index_put((self.rows, self.cols), whole[self.dest])
