"""Where weights live between the trainer and the engine: resharding, verification and offload.

reshard.py     the trained weights gathered over TP, broadcast over PP, renamed to HF names and streamed in
               bounded buckets into the engine at its own TP, with the rollout replica groups
fingerprint.py digests of what a receiver stored, read back from its own tensors (the verified handoff)
offload.py     the hybrid engine's stashes: parameters, gradients and optimizer state to host and back
transport.py   split placement: the same bucket stream from the trainers to rollout ranks of their own, verified

Placement stands on models, parallel and config; it must not import rollout engines, workers or the
trainer (engines import it to receive weights, never the other way round).
"""
