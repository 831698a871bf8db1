"""What one weight handoff into a rollout engine did (`reshard.update_engine_weights`): sizes, time, the check and
its path, and the peak memory it promised and measured; `metrics()` gives the trainer's perf/weight_sync_* values."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class HandoffReport:
    num_tensors: int
    """HF tensors handed over."""
    num_buckets: int
    total_bytes: int
    """Bytes of all HF tensors handed over (full tensors; this rank's shards on the direct path)."""
    bucket_bytes: int
    """The bucket size asked for."""
    max_bucket_bytes: int
    """Largest bucket sent (full megatron sizes; > bucket_bytes only for a single oversized tensor)."""
    largest_tensor_bytes: int
    """Largest full (TP-merged, vocab-padded) megatron tensor."""
    peak_extra_bytes: int | None
    """Most bytes of new tensor storage alive at once during the handoff (LiveTensorMeter), when measured."""
    peak_cuda_extra_bytes: int
    """Same from the CUDA allocator's peak statistics, when measured (measure_memory on CUDA); else 0."""
    seconds: float
    verify: str
    """rollout.verify_weights: fingerprint, exact or off."""
    direct: bool
    """Shards went straight into the engine's parameters (training TP == rollout TP, PP 1)."""
    verify_bytes: int = 0
    """Most the check allocates beside the bucket and the scratch (`verify_bytes`); 0 with verify off."""
    shared: bool = False
    """The engine reads the training tensors themselves (`shares_weights`): nothing copied (total_bytes 0),
    identity checked (verify "identity")."""
    engine_layout: bool = False
    """Sent in the engine's own megatron layout (`_send_layout`): no HF tensor, one digest per source shard."""
    stage_shared: bool = False
    """The engine reads this pipeline stage's own training tensors (`shares_stage`, identity checked) and holds
    copies of the other stages' layers only (copied and verified; total_bytes counts those)."""

    @property
    def verified(self) -> bool:
        """The engine's read-back digests agreed with the sender's for every tensor."""
        return self.verify != "off"

    @property
    def peak_bound_bytes(self) -> int:
        """What the stream promises: one (largest) bucket, the working set of the largest tensor and
        what the check allocates (the bucket and the scratch can fill the first two exactly)."""
        return max(self.bucket_bytes, self.max_bucket_bytes) + self.largest_tensor_bytes + self.verify_bytes

    def metrics(self, prefix: str = "perf/weight_sync") -> dict:
        out = {f"{prefix}_s": self.seconds, f"{prefix}_bytes": self.total_bytes, f"{prefix}_buckets": self.num_buckets}
        if self.peak_extra_bytes is not None:
            out[f"{prefix}_peak_extra_bytes"] = self.peak_extra_bytes
        return out
