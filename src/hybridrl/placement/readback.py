"""What an engine stored, read back, against what was sent: the verdicts of the verified handoff.

An engine's `load_weights` / `load_shards` returns {hf_name: Stored(region, digest)} read back from its own
parameters; these checks compare them with the sender's digests of the same slices and raise (or, on the
rollout ranks of split placement, return) one `HandoffError` message naming the first tensor that differs.
The shared path checks identity instead (`check_identity`: the engine reads the training tensor itself).
"""
from __future__ import annotations

import contextlib

import torch

from hybridrl.models import hf_convert as hc
from hybridrl.models.gpt import GPTSpec
from hybridrl.placement.fingerprint import hf_region, weight_digests


class HandoffError(RuntimeError):
    """The engine did not receive exactly what was sent; `tensor`: the megatron name of the tensor that differs,
    where known (the other ranks of the replica name it too, `engine_layout.agree_on_failure`)."""

    def __init__(self, message: str, tensor: str | None = None):
        super().__init__(message)
        self.tensor = tensor


class FirstFault:
    """The first HandoffError of a stream whose collectives go on: raised at its end (`update_engine_weights`
    then agrees on it over the replica), not where found, which would leave the peers in the next collective."""

    def __init__(self):
        self.error = None

    @contextlib.contextmanager
    def noted(self):
        try:
            yield
        except HandoffError as e:
            self.error = self.error or e

    def raise_it(self) -> None:
        if self.error is not None:
            raise self.error


def check_digests(names: list, ours: list, received: dict, mode: str) -> None:
    """The engine's read-back digest of each tensor equals the sender's (one host sync per bucket)."""
    if mode == "fingerprint":
        theirs = torch.stack([received[n].digest.to(ours[0].device) for n in names])
        bad = (torch.stack(ours) != theirs).nonzero().flatten().tolist()
    else:
        bad = [i for i, n in enumerate(names) if received[n].digest != ours[i]]
    if bad:
        i = bad[0]
        theirs_i = received[names[i]].digest
        raise HandoffError(
            f"engine's stored copy of {names[i]!r} (slice {received[names[i]].region}) differs from what was "
            f"sent: {mode} sent {_show(ours[i])}, read back {_show(theirs_i)} ({len(bad)} tensors differ in "
            f"this bucket)")


_show = lambda digest: str(digest.item()) if isinstance(digest, torch.Tensor) else str(digest)  # noqa: E731


def require_reported(names, received: dict) -> None:
    """Every tensor sent was reported back by the engine."""
    for name in names:
        if name not in received:
            raise HandoffError(f"engine did not report tensor {name!r}: it was sent but not stored")


def as_stored(t: torch.Tensor, dtype) -> torch.Tensor:
    """What an engine that stores dtype `dtype` (None: the one sent) holds of t: the same rounding as its
    copy (a converted copy only where the dtypes differ)."""
    return t if dtype is None or t.dtype == dtype else t.to(dtype)


def digests_as_stored(pairs, received: dict, verify: str) -> list:
    """The digest of each (hf_name, tensor) as the engine that reported `received` holds it: the slice it stores
    (`Stored.region`) in the dtype it stores it in (`Stored.dtype`); what its read-back must equal."""
    return weight_digests([as_stored(hf_region(t, received[n].region), received[n].dtype) for n, t in pairs], verify)


def shard_hf_parts(batch, spec: GPTSpec, tp: int, tp_rank: int) -> list:
    """(hf_name, view, region of the full HF tensor) of each HF tensor's slice in a batch of megatron shards."""
    return [(hf, view.reshape(-1) if shard.dim() == 1 else view, region) for g, shard in batch
            for hf, view, region in hc.shard_parts(g, shard, spec, tp, tp_rank)]


def stored_shard_error(parts: list, received: dict, verify: str) -> str | None:
    """What is wrong with an engine's read-back (`load_shards`) of the slices `parts` it was given: a slice
    not reported, stored at another region, or with another digest than the one sent (in the dtype the engine
    stores it in: a TE trainer's bf16 norms are fp32 in the local-spec engine); None when all agree."""
    try:
        names = [hf for hf, _, _ in parts]
        require_reported(names, received)
        for hf, _, region in parts:
            if received[hf].region != region:
                raise HandoffError(f"engine stores slice {received[hf].region} of {hf!r}; "
                                   f"the shard sent holds {region}")
        check_digests(names, weight_digests([as_stored(view, received[hf].dtype) for hf, view, _ in parts], verify),
                      received, verify)
    except HandoffError as err:
        return str(err)
    return None


def check_identity(name: str, sent: torch.Tensor, adopted: torch.Tensor, param: torch.Tensor) -> None:
    """The shared path: the engine's alias of `name` and the parameter it decodes with are the training tensor
    `sent` itself (storage, offset, shape, stride, dtype and version counter)."""
    def where(t):
        return (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), t.stride(), t.dtype)

    storage = sent.untyped_storage()
    if param.untyped_storage() is not storage or adopted.untyped_storage() is not storage \
            or where(param) != where(sent) or where(adopted) != where(sent):
        raise HandoffError(
            f"the engine reads {name!r} at (storage, offset, shape, stride, dtype) {where(param)}, the training "
            f"parameter is at {where(sent)}: the parameter was replaced, not updated in place (its views in the "
            f"engine are stale); call engine.release_shared() after replacing parameters")
    if adopted._version != sent._version:
        raise HandoffError(f"the engine's alias of {name!r} is at version {adopted._version}, the training "
                           f"parameter at {sent._version}: the same storage, but not the same tensor; call "
                           f"engine.release_shared() after replacing parameters")
