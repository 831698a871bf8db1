"""Digests of weights at both ends of the verified handoff: what a receiver stored, read back from its tensors.

`weight_fingerprint` is a device-side position-weighted sum over the tensor's bit patterns (one int64, no
host copy); `weight_checksum` a byte-exact host hash; `weight_digest` picks one by `rollout.verify_weights`.
No torch.distributed and no model code here.
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass

import torch

VERIFY_MODES = ("fingerprint", "exact", "off")
"""rollout.verify_weights: a device-side fingerprint (default), a byte-exact host hash, or no check."""


@dataclass(frozen=True)
class Stored:
    """What an engine holds of one HF tensor after a load, read back from its own parameters."""
    region: tuple | None
    """(dim, start, stop) of the HF tensor this rank stores; None: all of it."""
    digest: object
    """`weight_digest` of the stored slice: a 0-d int64 tensor on its device, or a hex string (exact)."""
    dtype: torch.dtype | None = None
    """The dtype it is stored in, where that may differ from the one sent (None: the one sent)."""


def hf_region(t: torch.Tensor, region: tuple | None) -> torch.Tensor:
    """The slice `region` of an HF tensor (a view)."""
    if region is None:
        return t
    dim, start, stop = region
    return t.narrow(dim, start, stop - start)


_INT_OF_SIZE = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_POSITION_WEIGHTS: dict[tuple, torch.Tensor] = {}


def _signed(c: int) -> int:
    return c - (1 << 64) if c >> 63 else c


def _mix(index: torch.Tensor, salt: int) -> torch.Tensor:
    """A splitmix64-style hash of each int64 index, in wrapping int64 arithmetic (same on every device)."""
    x = index * _signed(0x9E3779B97F4A7C15) + salt
    x = (x ^ (x >> 30)) * _signed(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> 27)) * _signed(0x94D049BB133111EB)
    return x ^ (x >> 31)


_WEIGHT_SLICES: dict[tuple, torch.Tensor] = {}
_MAX_SLICES = 4096


def _weights(start: int, n: int, device: torch.device, kind: str) -> torch.Tensor:
    """The position weights of positions [start, start + n): odd ones for rows, even ones for columns (cached
    per device, and each range asked for as its slice: a model asks for the same few ranges at every handoff)."""
    span = (device, kind, start, n)
    cut = _WEIGHT_SLICES.get(span)
    if cut is not None:
        return cut
    key = (device, kind)
    have = _POSITION_WEIGHTS.get(key)
    if have is None or have.numel() < start + n:
        size = 1 << max(start + n - 1, 63).bit_length()  # a power of two >= start + n: few regrowths, little slack
        h = _mix(torch.arange(size, dtype=torch.int64, device=device), 1 if kind == "row" else 2)
        have = _POSITION_WEIGHTS[key] = h | 1 if kind == "row" else h * 2
        _WEIGHT_SLICES.clear()  # the slices of the old table would keep it alive
    if len(_WEIGHT_SLICES) >= _MAX_SLICES:
        _WEIGHT_SLICES.clear()
    cut = _WEIGHT_SLICES[span] = have[start:start + n]
    return cut


def _as_words(t: torch.Tensor) -> torch.Tensor:
    """t's raw bits as integers: 32-bit words where the last dim packs evenly, else t's own width."""
    size = t.element_size()
    if size < 4 and t.shape[-1] % (4 // size) == 0:
        try:
            return t.view(torch.int32)
        except RuntimeError:  # last dim not contiguous or not word-aligned: same bits, packed after a copy
            return t.contiguous().view(torch.int32)
    return t.view(_INT_OF_SIZE[size])


_CACHE_CHUNK_BYTES = 1 << 20  # rows summed together on a CPU: they stay in a core's cache for the column sums


def _row_and_column_sums(bits: torch.Tensor) -> tuple:
    """Sums over the last dim and over the leading ones, wrapping at the word width. On a CPU, a tensor
    larger than a cache chunk is read from memory once: each chunk of rows gives its row sums, then its
    column sums from the cache (two whole-tensor reductions would read it twice)."""
    rows = bits
    if bits.dim() > 2:
        try:
            rows = bits.view(-1, bits.shape[-1])
        except RuntimeError:  # strides that do not flatten: two reductions over the view itself
            rows = None
    step = max(1, _CACHE_CHUNK_BYTES // max(1, bits.shape[-1] * bits.element_size()))
    if rows is None or bits.device.type != "cpu" or rows.shape[0] <= step:
        return bits.sum(dim=-1, dtype=bits.dtype), bits.sum(dim=tuple(range(bits.dim() - 1)), dtype=bits.dtype)
    row_sums = torch.empty(rows.shape[0], dtype=bits.dtype)
    col_sums = torch.zeros(rows.shape[1], dtype=bits.dtype)
    for start in range(0, rows.shape[0], step):
        part = rows[start:start + step]
        torch.sum(part, dim=-1, dtype=bits.dtype, out=row_sums[start:start + step])
        col_sums += part.sum(dim=0, dtype=bits.dtype)
    return row_sums, col_sums


def _word_sums(t: torch.Tensor, origin: tuple[int, int]) -> tuple:
    """(row sums, column sums, row and column position weights, word bytes) of t placed at `origin`."""
    bits = _as_words(t.detach().reshape(1) if t.dim() == 0 else t.detach())
    row0, col0 = origin
    size = bits.element_size()
    if size != t.element_size():
        col0 = col0 * t.element_size() // size
    if bits.dim() == 1:
        row_sums, col_sums = bits.sum(dim=0, keepdim=True, dtype=bits.dtype), bits
    else:
        row_sums, col_sums = _row_and_column_sums(bits)
        if row_sums.dim() > 1:
            row_sums = row_sums.reshape(-1)
    device = bits.device
    return (row_sums, col_sums, _weights(row0, row_sums.numel(), device, "row"),
            _weights(col0, col_sums.numel(), device, "col"), size)


def weight_fingerprint(t: torch.Tensor, origin: tuple[int, int] = (0, 0)) -> torch.Tensor:
    """A 0-d int64 tensor on t's device from two integer reductions over t's raw bits (no host copy).

    The bits, as integer words of b bits, are read as rows x last dim (leading dims flattened, any
    strides; a 1-D tensor is one row); rowsum and colsum wrap at the word width. With t placed at
    (row, column) `origin` (in elements) of a larger tensor, F = 2^(64-b) * (sum_r m_r * rowsum_r +
    sum_c w_c * colsum_c) + numel (mod 2^64), with odd row weights m_r and even column weights w_c
    indexed by the position in the larger tensor. F depends on each sum only mod 2^b, so it is linear
    in t's words: the fingerprints of the pieces of a partition, each at its origin, sum to the
    whole tensor's (a sender can digest its shard, a receiver the slice it stored). One flipped bit
    (bit k of a word) changes F by (m_r + w_c) * 2^(64-b+k): odd times a power of two below 2^64,
    never 0, so it is always caught; a wrong slice, a swapped or transposed block or stale data goes
    unseen only by a ~2^-b coincidence. Equal bits in equal order at equal origins give equal F.
    Many small tensors: `Fingerprints` gives the same values with a few ops per batch, not per tensor.
    """
    row_sums, col_sums, m, w, size = _word_sums(t, origin)
    mixed = (row_sums.long() * m).sum() + (col_sums.long() * w).sum()
    return mixed * (1 << (64 - 8 * size)) + t.numel() if size < 8 else mixed + t.numel()


FOLD_WORDS = 1 << 14
"""A `Fingerprints` batch weights its pending word sums once they reach this many (the part that crosses the
line included), so what it holds stays bounded whatever the batch's size."""


class Fingerprints:
    """`weight_fingerprint`s of many tensors (or pieces at their origins), summed per key: each part's word sums
    are taken as it is added (the one pass over its bytes), the weighting of the parts' sums together, once
    they reach FOLD_WORDS or at `result`. A small tensor's fingerprint is a dozen tiny ops, each costing more
    than its bytes; a batch pays them once. A 1-D part's words are kept as views until weighted: they must not
    change in between."""

    def __init__(self, device):
        self.device = device
        """Where the digests go while no part has been added; then where the parts' word sums are."""
        self._groups = {}  # word bytes -> ([sums], [weights], [key index per part], [length per part])
        self._index, self._numel, self._pending = {}, [], 0
        self._acc = None  # int64 [keys]: what the folded parts gave

    def add(self, key, t: torch.Tensor, origin: tuple[int, int] = (0, 0)) -> None:
        """Add the fingerprint of t placed at `origin` into `key`'s."""
        k = self._slot(key)
        row_sums, col_sums, m, w, size = _word_sums(t, origin)
        sums, weights, slots, lengths = self._groups.setdefault(size, ([], [], [], []))
        sums += [row_sums, col_sums]
        weights += [m, w]
        slots.append(k)
        lengths.append(row_sums.numel() + col_sums.numel())
        self._numel[k] += t.numel()
        self._pending += lengths[-1]
        if self._pending >= FOLD_WORDS:
            self._fold()

    def touch(self, key) -> None:
        """`key` gets a digest even with no part (0, as a tensor with no part: one that holds nothing)."""
        self._slot(key)

    def _slot(self, key) -> int:
        if key not in self._index:
            self._index[key] = len(self._numel)
            self._numel.append(0)
        return self._index[key]

    def __contains__(self, key) -> bool:
        return key in self._index

    def _fold(self) -> None:
        """Weight the pending parts' sums into the per-key accumulator (on the device the sums are on)."""
        if self._groups:
            self.device = next(iter(self._groups.values()))[0][0].device
        acc = torch.zeros(len(self._numel), dtype=torch.int64, device=self.device)
        if self._acc is not None:
            acc[:self._acc.numel()] = self._acc
        for size, (sums, weights, slots, lengths) in self._groups.items():
            mixed = torch.cat(sums).long() * torch.cat(weights)
            segment = torch.repeat_interleave(torch.tensor(slots, device=self.device),
                                              torch.tensor(lengths, device=self.device),
                                              output_size=mixed.numel())  # known: no device-to-host sync
            per_key = torch.zeros_like(acc).index_add_(0, segment, mixed)
            acc += per_key * (1 << (64 - 8 * size)) if size < 8 else per_key
        self._acc, self._groups, self._pending = acc, {}, 0

    def result(self, keys) -> torch.Tensor:
        """[len(keys)] int64: each key's fingerprint (the sum over its parts; 0 for a key without any)."""
        self._fold()
        out = torch.cat([self._acc + torch.tensor(self._numel, dtype=torch.int64, device=self._acc.device),
                         torch.zeros(1, dtype=torch.int64, device=self._acc.device)])
        missing = len(self._numel)
        return out[torch.tensor([self._index.get(k, missing) for k in keys], device=self._acc.device)]


_CHUNK_ELEMS = 1 << 24  # bounds the host copy when hashing a GPU tensor


def weight_checksum(t: torch.Tensor) -> str:
    """blake2b of dtype, element count and raw bytes in element order: equal iff bit-identical."""
    h = hashlib.blake2b(digest_size=16)
    h.update(f"{t.dtype}|{t.numel()}|".encode())
    flat = t.detach().contiguous().reshape(-1)
    for start in range(0, flat.numel(), _CHUNK_ELEMS):
        # always a copy: .numpy() on a view of the live storage would pin it as non-resizable,
        # which breaks offloading that storage later (TensorStash shrinks and regrows it)
        chunk = flat[start:start + _CHUNK_ELEMS].to("cpu", copy=True)
        h.update(chunk.view(torch.uint8).numpy().data)
    return h.hexdigest()


def weight_digests(tensors, mode: str) -> list:
    """`weight_digest` of each tensor, in order; with "fingerprint" all of them in one `Fingerprints` batch."""
    tensors = list(tensors)
    if mode != "fingerprint" or not tensors:
        return [weight_digest(t, mode) for t in tensors]
    batch = Fingerprints(tensors[0].device)
    for i, t in enumerate(tensors):
        batch.add(i, t)
    return list(batch.result(range(len(tensors))).unbind(0))


def weight_digest(t: torch.Tensor, mode: str):
    """The digest `mode` ("fingerprint" or "exact") of t."""
    if mode == "fingerprint":
        return weight_fingerprint(t)
    if mode == "exact":
        return weight_checksum(t)
    raise ValueError(f"no weight digest for verify mode {mode!r}; use one of {VERIFY_MODES[:2]}")
