"""The SFT loop: next-token cross-entropy on assistant tokens, megatron-core at any TP x PP x DP.

One step: a global batch of trajectories (each DP rank its slice) -> micro-batches through the
model engine's pipeline schedule -> one optimizer step. The loss is the mean over every assistant
token of the global batch, so it (and the gradient) does not depend on the layout or the
micro-batch split. The model starts from model.path (or the seeded random model of the config's
model fields, as the RL roles do) and is written at the end as an HF folder (weights, config,
tokenizer) that an RL run loads with model.path=<sft.output_dir>.

Checkpoints (sft.save_freq, a stop signal, the stop file, trainer.max_runtime) are the RL run's kind of
global_step_K folder under sft.default_local_dir, the model as role "actor" (so `convert_checkpoint.py
ckpt-to-hf` reads them too), with meta "run": "sft" and the data position; a resumed run goes on from the
batch after the saved step with the saved optimizer, LR schedule and RNG streams, as if never stopped.
"""
from __future__ import annotations

import os
import shutil
from typing import Dict

import torch
import torch.distributed as dist

from hybridrl import algos
from hybridrl.config import Config
from hybridrl.log import print0
from hybridrl.models.logprobs import vocab_parallel_log_probs
from hybridrl.workers.engine import ModelEngine, dp_sum, split_micro_batches
from hybridrl.workers.update import finish_step


class SFTTrainer:
    def __init__(self, cfg: Config, groups, tokenizer, total_steps: int):
        from hybridrl.models.hf_checkpoint import model_from_hf
        from hybridrl.trainer.roles import init_model_folder, training_overrides, wrap_trainable
        from hybridrl.workers.optim import build_optimizer

        self.cfg, self.groups, self.tok = cfg, groups, tokenizer
        self.init_folder = init_model_folder(cfg, tokenizer.vocab_size)
        model, self.spec = model_from_hf(self.init_folder, groups, cfg.model.params_dtype, **training_overrides(cfg, groups))
        module = wrap_trainable(model, cfg)
        self.engine = ModelEngine(module, groups)
        self.optimizer = build_optimizer(module, cfg.sft.optim, groups, total_steps,
                                         cfg.parallel.use_distributed_optimizer, model.config.params_dtype)

    def _log_probs(self, logits, labels):
        """Per-token log-probs of the next token, in any sequence layout (`ModelEngine.run`'s token_fn)."""
        return {"log_probs": vocab_parallel_log_probs(logits, labels, self.groups.tp_group, self.spec.vocab_size)}

    def _loss(self, tokens, mb, weight: float, n_micro: int):
        """Mean negative log-likelihood of the assistant tokens; `weight`: the micro-batch's token share."""
        loss = -algos.masked_mean(tokens["log_probs"][:, :-1], mb["loss_mask"][:, 1:])
        # the schedule divides by n_micro (times CP) and DDP averages over DP x CP: undo both for a global token mean
        scaled = loss * weight * n_micro * self.groups.dp
        return scaled, {"sft/loss": loss.item() * weight, "finite": torch.isfinite(loss).item()}

    def _run(self, batch: Dict[str, torch.Tensor], forward_only: bool):
        """(per-micro-batch stats, the global batch's loss tokens): the batch through the schedule, each micro-batch
        weighted by its share of those tokens."""
        micro = split_micro_batches(batch, self.cfg.sft.micro_batch_size_per_gpu)
        tokens = [float(mb["loss_mask"][:, 1:].sum()) for mb in micro]
        total = max(dp_sum({"n": sum(tokens)}, self.groups)["n"], 1.0)
        weights = iter([t / total for t in tokens])
        self.engine.train(not forward_only)
        return self.engine.run(micro, lambda out, mb: self._loss(out, mb, next(weights), len(micro)), forward_only,
                               self._log_probs), total

    def step(self, batch: Dict[str, torch.Tensor]) -> Dict[str, float]:
        self.engine.zero_grad()
        self.optimizer.zero_grad()
        stats, total = self._run(batch, forward_only=False)
        metrics = finish_step(self.engine, self.optimizer, stats, "sft")
        metrics["sft/tokens"] = total
        return metrics

    @torch.no_grad()
    def validate(self, batches) -> Dict[str, float]:
        """verl's val/loss: the mean negative log-likelihood over every assistant token of `batches` (no update)."""
        nll, tokens = 0.0, 0.0
        for batch in batches:
            stats, total = self._run(batch, forward_only=True)
            loss = dp_sum({"l": sum(s["sft/loss"] for s in stats)}, self.groups)["l"]
            nll, tokens = nll + loss * total, tokens + total
        return {"val/loss": nll / max(tokens, 1.0)}

    def save_checkpoint(self, saver, step: int, seed: int) -> None:
        """global_step_{step}: the model and optimizer (LR schedule included), RNG streams, the data position (the
        batches trained and the shuffle's seed)."""
        from hybridrl.checkpoint.writer import layout_of
        from hybridrl.models.hf_config import load_hf_config
        from hybridrl.models.lora_export import lora_meta

        meta = {"run": "sft", "data": {"batches": step, "seed": seed}, "layout": layout_of(self.groups),
                "hf_config": load_hf_config(self.init_folder), **lora_meta(self.engine.module)}
        saver.save(step, {"actor": self}, meta)

    def resume(self, path: str | None) -> dict:
        """Load a published SFT checkpoint (None: a fresh start); its data position, {"batches": trained before it,
        "seed": the shuffle's (absent in checkpoints written before it was saved)}."""
        if path is None:
            return {"batches": 0}
        from hybridrl.checkpoint import load_checkpoint
        from hybridrl.checkpoint.writer import layout_of

        meta = load_checkpoint(path, {"actor": self}, layout_of(self.groups), run="sft")
        print0(f"resumed from {path} at step {meta['step']}")
        return meta["data"]

    def save(self, folder: str) -> None:
        """Write the model (and the tokenizer, when it is an HF one) as an HF folder, replacing `folder`
        only once the new one is complete."""
        from hybridrl.models.hf_checkpoint import mcore_to_hf_stream, save_hf
        from hybridrl.models.hf_config import load_hf_config

        folder = os.path.abspath(folder)
        staging = folder + ".tmp"
        rank0 = dist.get_rank() == 0
        if rank0 and os.path.exists(staging):
            shutil.rmtree(staging)
        dist.barrier()
        save_hf(staging, mcore_to_hf_stream(self.engine.module, self.spec, self.groups),
                load_hf_config(self.init_folder), source=self.init_folder)  # its generation config (extra eos ids)
        if rank0:
            if hasattr(self.tok, "hf"):
                self.tok.hf.save_pretrained(staging)
            previous = folder + ".old"
            if os.path.exists(folder):
                os.replace(folder, previous)
            os.replace(staging, folder)
            shutil.rmtree(previous, ignore_errors=True)
        dist.barrier()


def sft_loader(cfg: Config, tokenizer, groups, files=None):
    """The run's trajectories (or those of `files`), this DP rank's slices; demonstrations are generated first
    (rank 0) when the files are missing and sft.synthetic_task is set."""
    from hybridrl.data.synthetic import write_arith_demonstrations
    from hybridrl.data.tool_demos import write_demonstrations
    from hybridrl.parallel.distributed import agreed_random_seed
    from hybridrl.sft.data import SFTDataset, SFTLoader

    train = files is None  # only training files are generated: held-out ones must be the user's
    files = cfg.sft.train_files if train else files
    missing = [p for p in map(os.path.expanduser, files) if not os.path.exists(p)]
    writers = {"arith": write_arith_demonstrations, "arith_tools": write_demonstrations} if train else {}
    write = writers.get(cfg.sft.synthetic_task)
    if dist.get_rank() == 0 and missing and write is not None:
        for path in missing:
            write(path)
    dist.barrier()
    dataset = SFTDataset(files, tokenizer, cfg.sft, "sft.train_files" if train else "sft.val_files")
    drawn = cfg.data.seed is None and train  # held-out files are read in file order: no seed to draw
    seed = agreed_random_seed() if drawn else cfg.data.seed or 0
    return SFTLoader(dataset, cfg.sft.train_batch_size, groups.dp_rank, groups.dp, cfg.sft.shuffle, seed, drawn)


def _setup(cfg: Config):
    from hybridrl.config.layout import expert_parallel_size, model_dims, model_parallel_sizes
    from hybridrl.log import setup_logging
    from hybridrl.parallel.distributed import init_distributed, init_model_parallel
    from hybridrl.tokenizer import load_data_tokenizer

    setup_logging()
    le = init_distributed()
    torch.manual_seed(cfg.trainer.seed)
    tokenizer = load_data_tokenizer(cfg.data, cfg.model.path)
    dims = model_dims(cfg.model, tokenizer.vocab_size)
    tp, pp, dp = model_parallel_sizes(cfg, le.world_size, dims)
    groups = init_model_parallel(tp, pp, seed=cfg.trainer.seed, ep=expert_parallel_size(cfg, dims, tp, dp),
                                 cp=cfg.parallel.context_parallel_size)
    return le, tokenizer, groups, sft_loader(cfg, tokenizer, groups)


def sft_steps(sft, batches_per_epoch: int) -> int:
    """The LR schedule's length: sft.total_training_steps, or with 0 (the default) sft.total_epochs passes over
    the data."""
    return sft.total_training_steps or batches_per_epoch * sft.total_epochs


def sft_run_steps(sft, batches_per_epoch: int) -> int:
    """The steps the run lasts, as verl's SFT loop: the schedule's, ended early when total_epochs passes over the
    data are done."""
    return min(sft_steps(sft, batches_per_epoch), batches_per_epoch * sft.total_epochs)


def run_sft(cfg: Config) -> int:
    from hybridrl.checkpoint import CheckpointManager, CheckpointWriter, choose_checkpoint
    from hybridrl.trainer.loop import open_writer
    from hybridrl.trainer.preemption import STOP_FILE, StopRequests, deadline, saves_at

    sc = cfg.sft
    le, tokenizer, groups, loader = _setup(cfg)
    total = sft_steps(sc, len(loader))
    ckpt = CheckpointManager(sc.default_local_dir, {"actor": sc.max_ckpt_to_keep})
    resume_from = choose_checkpoint(ckpt, sc.resume_mode, cfg.trainer.verify_checkpoint_digests)
    writer = open_writer(cfg, le.rank == 0, suffix="_sft")
    trainer = SFTTrainer(cfg, groups, tokenizer, total)
    position = trainer.resume(resume_from)
    start = int(position["batches"])
    loader.resume_seed(position.get("seed"))
    writer.resumed_at(start)  # a fresh start (0) too: what an earlier attempt logged in these sinks goes
    val = sft_loader(cfg, tokenizer, groups, sc.val_files) if sc.val_files else None
    saver = CheckpointWriter(ckpt)
    stops = StopRequests(os.path.join(sc.default_local_dir, STOP_FILE),
                         deadline(cfg.trainer.max_runtime, cfg.trainer.stop_margin_s))
    stops.clear_stop_file(ckpt.latest())
    losses, code = [], 0
    last = sft_run_steps(sc, len(loader))
    for step, batch in zip(range(start + 1, last + 1), loader.batches_after(start)):
        metrics = trainer.step(batch)
        losses.append(metrics["sft/loss"])
        if val is not None and (step == last or (sc.test_freq and step % sc.test_freq == 0)):
            metrics.update(trainer.validate(val.one_pass()))
        writer.log(metrics, step, ("sft/loss", "sft/grad_norm", "sft/lr", "val/loss"))
        reason, at_the_end = stops.at_step_end(step, last, groups.device)
        if at_the_end:
            stops.ended_as_planned(step, at_the_end)
        if saves_at(step, last, sc.save_freq, reason):
            trainer.save_checkpoint(saver, step, loader.seed)
        if reason:
            code = stops.stopped(step, reason, ckpt.latest())
            break
    stops.restore()
    if losses:
        k = max(1, len(losses) // 10)
        print0(f"sft loss: first {k} steps {sum(losses[:k]) / k:.4f} -> last {k} steps {sum(losses[-k:]) / k:.4f}")
    if not code:
        trainer.save(sc.output_dir)
        print0(f"saved the SFT model to {sc.output_dir} (RL: model.path={sc.output_dir})")
    writer.close()
    return code
