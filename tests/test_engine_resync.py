"""An engine whose sleep discards its weights (vLLM at sleep level 2) gets them streamed in again before its next
generation, whichever phase asks for it: validation between two steps, ReMax's greedy baseline, DAPO's extra
batches. Here a NativeEngine that zeroes its parameters at sleep and reports `needs_weights` until a full sync,
driven by the real trainer: the training generation after a validation equals the one before it."""
import torch

from dist_helper import run_distributed
from test_trainer_passes import TINY, _overrides


def _generations(tmp):
    from hybridrl.config.io import load_config
    from hybridrl.rewards import RewardManager
    from hybridrl.rollout.native import NativeEngine
    from hybridrl.trainer.loop import setup_run
    from hybridrl.trainer.ppo import PPOTrainer
    from hybridrl.trainer.roles import build_roles

    class Discarding(NativeEngine):
        """Sleep as vLLM's level 2: the weights are gone (zeros) until every one is loaded again."""
        needs_weights = False

        def sleep(self):
            for p in self.params.values():
                p.zero_()
            self.needs_weights = True

        def load_weights(self, weights, verify="fingerprint"):
            stored = super().load_weights(weights, verify)
            self.needs_weights = False
            return stored

    cfg = load_config(TINY, _overrides(tmp, ["rollout.free_cache_engine=true", "rollout.share_weights=false"]))
    _, tok, layout, groups, loader, val_loader = setup_run(cfg)
    roles = build_roles(cfg, groups, tok, 4)
    roles.rollout.__class__ = Discarding
    trainer = PPOTrainer(cfg, layout, groups, tok, roles, RewardManager(cfg.reward), None)
    trainer.sync_rollout_weights()
    prompts = next(iter(loader))
    first = trainer.generate(prompts, trainer.train_sampling(), 1)["responses"].clone()
    trainer.validate(val_loader)
    again = trainer.generate(prompts, trainer.train_sampling(), 1)
    return first, again["responses"], trainer.timer.seconds.get("update_weights", 0.0)


def test_a_generation_after_validation_gets_the_weights_again(tmp_path):
    first, again, synced = run_distributed(_generations, 1, str(tmp_path))[0]
    assert (first != 0).any()
    torch.testing.assert_close(again, first)  # before: the zeroed engine's tokens
    assert synced > 0
