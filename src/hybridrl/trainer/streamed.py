"""A streamed step (split placement, `async_training.stream_prompts` m > 0): the rollout ranks hand over
finished prompt groups in chunks of m prompts; each chunk is scored and its forward passes (old and
reference log-probs, values) run while the next chunk is generated. The step's batch is the chunks put
back in prompt order, so nothing after this point depends on the order in which they completed.
"""
from __future__ import annotations

import dataclasses

import torch

from hybridrl.trainer.estimator_inputs import keep_reward_components


def prompt_rows(prompts, lo: int, hi: int):
    """Prompts [lo, hi) of a PromptBatch (tensors and per-prompt lists alike)."""
    cut = {f.name: getattr(prompts, f.name)[lo:hi] for f in dataclasses.fields(prompts)
           if not (f.name == "messages" and not prompts.messages)}
    return dataclasses.replace(prompts, **cut)


def sample_streamed(trainer, prompts, step: int, source: str):
    """(batch, scores) of this rank's prompts, scored and passed forward chunk by chunk."""
    sampling, n = trainer.train_sampling(), trainer.cfg.rollout.n
    chunks = iter(trainer.remote.stream(*trainer.rollout_request(prompts, sampling, step)))
    parts = []
    while True:
        with trainer.timer("gen"), trainer.timer("generate_sequences"):  # the wait for the next chunk
            chunk = next(chunks, None)
        if chunk is None:
            break
        out, lo, hi, versions = chunk
        trainer.gen_versions += versions.tolist()
        rows = prompt_rows(prompts, lo, hi)
        batch = trainer.assemble_batch(rows, sampling, out, True)
        with trainer.timer("reward"):
            scores, _, infos = trainer.score_details(batch, rows, n)
        keep_reward_components(batch, infos, trainer.cfg.algorithm)
        trainer.forward_passes(batch, source)
        parts.append((lo, batch, scores))
    parts.sort(key=lambda p: p[0])
    batch = {k: torch.cat([b[k] for _, b, _ in parts]) for k in parts[0][1]}
    return batch, torch.cat([s for _, _, s in parts])
