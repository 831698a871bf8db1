"""scripts/train_ppo.py with the native engine storing one HF tensor wrongly: after copying the tensor named in
CORRUPT_TENSOR (or the megatron shard holding it) into its parameters it adds 1 to the first element, as a
faulty load path would. The verified
handoff reads the store back, so every trainer rank must stop with the same HandoffError."""
import os
import runpy
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def corrupt_store(name: str) -> None:
    import torch

    from hybridrl.models import hf_convert as hc
    from hybridrl.rollout.native import NativeEngine

    copy_in = NativeEngine._copy_in

    def faulty(self, hf_name, tensor):
        copy_in(self, hf_name, tensor)
        if hf_name == name:
            with torch.no_grad():
                self._slots[hf_name][1].view(-1)[0] += 1

    copy_shard = NativeEngine._copy_shard

    def faulty_shard(self, own, shard):  # shard to shard (split placement at equal TP)
        copy_shard(self, own, shard)
        if name in hc.hf_sources(own, self.spec):
            with torch.no_grad():
                self.params[own].view(-1)[0] += 1

    NativeEngine._copy_in, NativeEngine._copy_shard = faulty, faulty_shard


if __name__ == "__main__":
    corrupt_store(os.environ["CORRUPT_TENSOR"])
    script = os.path.join(ROOT, "scripts", "train_ppo.py")
    sys.argv = [script] + sys.argv[1:]
    runpy.run_path(script, run_name="__main__")
