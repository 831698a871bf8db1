"""scripts/train_rm.py: train a reward model with the Bradley-Terry loss and save it as an HF folder.

The model is the critic's module (GPT trunk + scalar `ValueHead`), started from the actor's initial
weights (model.path, or the config's random init) with a fresh head (or model.path's reward head),
trained at the config's TP x PP x DP through megatron's pipeline schedule on preference pairs
generated from the training prompts (`preference_pairs`), and written to reward_model.path as a
*ForSequenceClassification folder that transformers and train_ppo.py load. Inputs are built as the
PPO reward model reads them (`workers.reward_model`: the actor's ids, or re-encoded for
reward_model.tokenizer) and scored at the same token. Loss per pair: -log sigmoid(r_chosen -
r_rejected), averaged over the DP-global batch. The head's bias stays at zero: HF's score layer has
none and the loss cannot see it.
"""
from __future__ import annotations

import argparse
import os
import shutil
import sys
from typing import Dict, List

import torch
import torch.distributed as dist
import torch.nn.functional as F

from hybridrl.config import Config, ConfigError
from hybridrl.data.prompts import left_pad
from hybridrl.log import print0
from hybridrl.workers.critic import value_tokens
from hybridrl.workers.engine import ModelEngine, dp_sum, split_micro_batches
from hybridrl.workers.reward_model import build_reencoder, check_vocab, score_positions


def parse_args(argv):
    p = argparse.ArgumentParser(prog="train_rm.py", description="Bradley-Terry reward model training on megatron-core")
    p.add_argument("--config", default="configs/tiny_cpu_rm.yaml", help="YAML config file (reward_model.* section)")
    p.add_argument("overrides", nargs="*", help="dotted overrides, e.g. reward_model.train.steps=50")
    return p.parse_args(argv)


def main(argv=None) -> int:
    from hybridrl.trainer.entry import run_with_config

    return run_with_config(parse_args(sys.argv[1:] if argv is None else argv), train_reward_model)


def _encoded_pairs(cfg: Config, rows, tokenizer, n: int, seed: int, sequence) -> Dict[str, List[List[int]]]:
    from hybridrl.reward_model.preference_pairs import make_pairs

    pairs = make_pairs(rows, tokenizer, n, cfg.data.max_response_length, seed)
    return {"chosen": [sequence(rows[p.prompt], p.chosen_ids) for p in pairs],
            "rejected": [sequence(rows[p.prompt], p.rejected_ids) for p in pairs]}


def _pair_sets(cfg: Config, tokenizer, train_rows, val_rows, pad_id: int):
    """Train and held-out pair tensors {chosen,rejected}_{ids,mask} [N, S], one width S for all."""
    reencoder = build_reencoder(cfg, pad_id)

    def sequence(row, response_ids):
        if reencoder is None:
            return list(row.input_ids) + list(response_ids)
        return reencoder.encode(row.messages, tokenizer.decode(response_ids))

    tc = cfg.reward_model.train
    sets = [_encoded_pairs(cfg, train_rows, tokenizer, tc.num_pairs, tc.seed, sequence),
            _encoded_pairs(cfg, val_rows, tokenizer, tc.num_val_pairs, tc.seed + 1, sequence)]
    width = max(len(s) for pairs in sets for side in pairs.values() for s in side)
    out = []
    for pairs in sets:
        tensors = {}
        for side, seqs in pairs.items():
            tensors[f"{side}_ids"], tensors[f"{side}_mask"] = left_pad(seqs, pad_id, width)
        out.append(tensors)
    return out


def pair_micro_batches(pairs: Dict[str, torch.Tensor], micro_pairs: int, pad_id: int) -> List[dict]:
    """Equal micro-batches of k pairs: rows [chosen_1..k, rejected_1..k] and the token each row is scored at."""
    out = []
    for mb in split_micro_batches(pairs, micro_pairs):
        ids, mask = (torch.cat([mb[f"chosen_{k}"], mb[f"rejected_{k}"]]) for k in ("ids", "mask"))
        out.append({"input_ids": ids, "attention_mask": mask, "score_index": score_positions(ids, mask, pad_id)})
    return out


def pair_margins(values: torch.Tensor, mb: dict) -> torch.Tensor:
    """r_chosen - r_rejected per pair of a micro-batch from the head's per-token scores [2k, S]."""
    scores = values[torch.arange(values.shape[0], device=values.device), mb["score_index"]]
    k = scores.shape[0] // 2
    return scores[:k] - scores[k:]


def _bradley_terry(values, mb, total_pairs: int, n_micro: int, dp: int):
    margin = pair_margins(values, mb)
    loss_sum = -F.logsigmoid(margin).sum()
    stats = {"reward_model/loss": loss_sum.item() / total_pairs,
             "reward_model/acc": (margin > 0).sum().item() / total_pairs,
             "reward_model/margin": margin.sum().item() / total_pairs, "finite": torch.isfinite(loss_sum).item()}
    # the schedule divides by n_micro (times CP) and DDP averages over DP x CP: undo both for the global mean
    return loss_sum / total_pairs * n_micro * dp, stats


def _step_slice(pairs: Dict[str, torch.Tensor], step: int, batch: int, groups, seed: int):
    """This DP rank's share of step `step`'s global batch (a seeded reshuffle every epoch)."""
    n = pairs["chosen_ids"].shape[0]
    epoch, k = divmod(step - 1, n // batch)
    order = torch.randperm(n, generator=torch.Generator().manual_seed(seed + epoch))[k * batch:(k + 1) * batch]
    per_rank = batch // groups.dp
    rows = order[groups.dp_rank * per_rank:(groups.dp_rank + 1) * per_rank]
    return {key: t[rows] for key, t in pairs.items()}


def train_step(engine: ModelEngine, optimizer, local: Dict[str, torch.Tensor], batch: int, micro_pairs: int,
               pad_id: int) -> Dict[str, float]:
    """One optimizer step on this rank's pairs of a `batch`-pair global batch; DP-global mean metrics."""
    from hybridrl.workers.update import finish_step

    engine.train(True)
    micro = pair_micro_batches(local, micro_pairs, pad_id)
    engine.zero_grad()
    optimizer.zero_grad()
    stats = engine.run(micro, lambda t, mb: _bradley_terry(t["values"], mb, batch, len(micro),
                                                           engine.groups.dp), False, value_tokens)
    return finish_step(engine, optimizer, stats, "reward_model")


@torch.no_grad()
def preference_accuracy(engine: ModelEngine, pairs: Dict[str, torch.Tensor], micro_pairs: int, pad_id: int) -> float:
    """Share of pairs (over all DP ranks) whose chosen response scores higher."""
    from hybridrl.data.prompts import shard_bounds

    engine.train(False)
    g = engine.groups
    start, end = shard_bounds(pairs["chosen_ids"].shape[0], g.dp_rank, g.dp)
    local = {k: t[start:end] for k, t in pairs.items()}
    correct = 0.0
    if end > start:
        stats = engine.run(pair_micro_batches(local, micro_pairs, pad_id),
                           lambda t, mb: (t["values"].new_zeros(()),
                                          {"correct": (pair_margins(t["values"], mb) > 0).sum().item()}),
                           True, value_tokens)
        correct = sum(s["correct"] for s in stats)
    totals = dp_sum({"correct": correct, "n": float(end - start)}, g)
    return totals["correct"] / max(totals["n"], 1.0)


def _build(cfg: Config, groups, init_folder: str, total_steps: int):
    from hybridrl.models.critic import critic_from_hf
    from hybridrl.trainer.roles import sequence_overrides, wrap_trainable
    from hybridrl.workers.optim import build_optimizer

    tc = cfg.reward_model.train
    model, spec, _ = critic_from_hf(init_folder, groups, cfg.model.params_dtype, seed=tc.seed,
                                    **sequence_overrides(cfg, groups))
    if groups.is_last_stage:  # a fresh head's bias is 0; one loaded from model.path is zeroed (HF has none)
        with torch.no_grad():
            model.output_layer.value_head.bias.zero_()
        model.output_layer.value_head.bias.requires_grad_(False)
    module = wrap_trainable(model, cfg)
    optimizer = build_optimizer(module, tc.optim, groups, total_steps, cfg.parallel.use_distributed_optimizer,
                                model.config.params_dtype)
    return ModelEngine(module, groups), optimizer, spec


def save_reward_model(engine: ModelEngine, spec, groups, cfg: Config, init_folder: str, pad_id: int, tokenizer) -> str:
    """Write reward_model.path (config.json, model.safetensors, tokenizer) via a temporary folder, so an
    earlier model there stays whole until the new one is complete."""
    from hybridrl.models.critic import reward_model_hf_config, reward_model_hf_stream
    from hybridrl.models.hf_checkpoint import save_hf
    from hybridrl.models.hf_config import load_hf_config

    path = os.path.normpath(cfg.reward_model.path)
    tmp, old = path + ".tmp", path + ".old"
    writer = dist.get_rank() == 0
    if writer:
        shutil.rmtree(tmp, ignore_errors=True)
    hf_config = reward_model_hf_config(load_hf_config(init_folder), pad_id)
    save_hf(tmp, reward_model_hf_stream(engine.module, spec, groups), hf_config, writer=writer)
    if writer:
        if hasattr(tokenizer, "hf"):  # an HF tokenizer travels with the model; train_ppo.py needs only the weights
            tokenizer.hf.save_pretrained(tmp)
        shutil.rmtree(old, ignore_errors=True)
        if os.path.exists(path):
            os.replace(path, old)
        os.replace(tmp, path)
        shutil.rmtree(old, ignore_errors=True)
    dist.barrier()
    return path


def train_reward_model(cfg: Config) -> int:
    from hybridrl.trainer.roles import init_model_folder
    from hybridrl.trainer.loop import setup_run

    rm, tc = cfg.reward_model, cfg.reward_model.train
    if not rm.path:
        raise ConfigError("reward_model.path is empty; set it to the folder the reward model is written to")
    _, tokenizer, layout, groups, train_loader, val_loader = setup_run(cfg)
    if layout.ep > 1:
        raise ConfigError("reward-model training shards pairs of different lengths over the ranks, but expert-"
                          "parallel ranks must forward in lockstep; train it with parallel.expert_model_parallel_size=1")
    if tc.batch_size % layout.dp or val_loader is None:
        raise ConfigError(f"reward_model.train.batch_size={tc.batch_size} must be a multiple of dp={layout.dp}, and "
                          "data.val_files must be set (held-out pairs come from them)")
    init_folder = init_model_folder(cfg, tokenizer.vocab_size)
    engine, optimizer, spec = _build(cfg, groups, init_folder, tc.steps)
    reencoder = build_reencoder(cfg, None)
    rm_tokenizer = reencoder.tokenizer if reencoder is not None else tokenizer
    check_vocab(rm_tokenizer, spec.vocab_size)
    pad_id = rm_tokenizer.pad_token_id
    device = next(engine.module.parameters()).device
    train, val = ({k: t.to(device) for k, t in pairs.items()} for pairs in
                  _pair_sets(cfg, tokenizer, train_loader.dataset.rows, val_loader.dataset.rows, pad_id))
    micro = tc.micro_batch_size_per_gpu
    print0(f"reward model: {train['chosen_ids'].shape[0]} training pairs, {val['chosen_ids'].shape[0]} held out, "
           f"sequences of {train['chosen_ids'].shape[1]} tokens; {layout.describe()}")
    history = [(0, preference_accuracy(engine, val, micro, pad_id))]
    for step in range(1, tc.steps + 1):
        metrics = train_step(engine, optimizer, _step_slice(train, step, tc.batch_size, groups, tc.seed),
                             tc.batch_size, micro, pad_id)
        if step == tc.steps or (tc.val_freq > 0 and step % tc.val_freq == 0):
            history.append((step, preference_accuracy(engine, val, micro, pad_id)))
            shown = " - ".join(f"{k}:{metrics[k]:.4g}" for k in ("reward_model/loss", "reward_model/acc"))
            print0(f"step:{step} - {shown} - reward_model/val_acc:{history[-1][1]:.4g}")
    path = save_reward_model(engine, spec, groups, cfg, init_folder, pad_id, rm_tokenizer)
    print0("held-out preference accuracy: " + " -> ".join(f"{acc:.3f} (step {s})" for s, acc in history))
    print0(f"saved the reward model to {path}")
    return 0
