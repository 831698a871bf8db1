"""Profile one stage of the trainer's step from inside a run (profile_demo.py, hybridrl_side.py).

`StageProfile(stage)` wraps the method that runs the stage (STAGES): its first call is warm-up
(or the pre-training weight sync) and runs plain, the second runs under torch.profiler (aten ops by
self CPU time), every later one under cProfile (Python-level time, dispatch modes included).
`result()` gives both as text. The method is patched on its class, so the trainer itself is unchanged.
"""
from __future__ import annotations

import cProfile
import importlib
import io
import pstats

STAGES = {  # timing_s key -> (module, class, method) that the stage runs
    "gen": ("hybridrl.trainer.ppo", "PPOTrainer", "generate"),
    "old_log_prob": ("hybridrl.workers.actor", "LogProbWorker", "compute_log_prob"),
    "update_actor": ("hybridrl.workers.actor", "ActorWorker", "update_policy"),
    "update_critic": ("hybridrl.workers.critic", "CriticWorker", "update_critic"),
    "update_weights": ("hybridrl.trainer.ppo", "PPOTrainer", "sync_rollout_weights"),
}


class StageProfile:
    def __init__(self, stage: str):
        module, cls, method = STAGES[stage]
        owner = getattr(importlib.import_module(module), cls)
        original = getattr(owner, method)
        self.calls, self._cprofile, self._ops = 0, cProfile.Profile(), None

        def wrapped(*args, **kwargs):
            self.calls += 1
            if self.calls == 1:
                return original(*args, **kwargs)
            if self.calls == 2:
                from torch.profiler import ProfilerActivity, profile

                with profile(activities=[ProfilerActivity.CPU]) as p:
                    out = original(*args, **kwargs)
                self._ops = p
                return out
            self._cprofile.enable()
            try:
                return original(*args, **kwargs)
            finally:
                self._cprofile.disable()

        setattr(owner, method, wrapped)

    def result(self, rows: int = 18) -> dict:
        """{"cprofile": top rows by tottime, "ops": top aten ops, "calls": calls under cProfile}."""
        if self.calls < 3:
            raise RuntimeError(f"the stage ran {self.calls} times; profiling needs at least 3 (more steps)")
        buf = io.StringIO()
        pstats.Stats(self._cprofile, stream=buf).strip_dirs().sort_stats("tottime").print_stats(rows)
        text = buf.getvalue()
        ops = self._ops.key_averages().table(sort_by="self_cpu_time_total", row_limit=15, max_name_column_width=45)
        return {"cprofile": text[text.find("ncalls"):].rstrip(), "ops": ops.rstrip(), "calls": self.calls - 2}
