"""scripts/train_ppo.py with the native engine reporting each token's experts shifted by one, on the generate
calls of this process named in SHIFT_ROUTES_ON (1-based, comma-separated): for torchrun, which starts a script
and not a function. If the trainer's forwards use the reported routes (routing replay), its log-probs stop
agreeing with the engine's on exactly those batches."""
import os
import runpy
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def shift_routes(calls: set) -> None:
    from hybridrl.rollout.native import NativeEngine

    generate, count = NativeEngine.generate, [0]

    def shifted(self, *args, **kwargs):
        out = generate(self, *args, **kwargs)
        count[0] += 1
        if count[0] in calls:
            out.routed_experts = (out.routed_experts + 1) % self.spec.num_experts
        return out

    NativeEngine.generate = shifted


if __name__ == "__main__":
    shift_routes({int(c) for c in os.environ["SHIFT_ROUTES_ON"].split(",")})
    script = os.path.join(ROOT, "scripts", "train_ppo.py")
    sys.argv = [script] + sys.argv[1:]
    runpy.run_path(script, run_name="__main__")
