"""The native engine reporting each token's experts shifted by one on chosen generate calls of this process. If
the trainer's forwards use the reported routes (routing replay), its log-probs stop agreeing with the engine's on
exactly those batches. Under torchrun: `patched_run.py` with SHIFT_ROUTES_ON."""


def shift_routes(calls: set) -> None:
    """Generate calls `calls` (1-based) of this process report shifted routes."""
    from hybridrl.rollout.native import NativeEngine

    generate, count = NativeEngine.generate, [0]

    def shifted(self, *args, **kwargs):
        out = generate(self, *args, **kwargs)
        count[0] += 1
        if count[0] in calls:
            out.routed_experts = (out.routed_experts + 1) % self.spec.num_experts
        return out

    NativeEngine.generate = shifted
