"""The native rollout engine: batched KV-cache generation on a megatron-core GPTModel at rollout TP.

The engine owns a second GPTModel (pipeline size 1) laid out for the rollout TP, built on its own
process groups (`reshard.new_rollout_groups`) through megatron-core's `ProcessGroupCollection`, so
its TP is independent of the training TP held by megatron's global parallel_state. Its weights are
filled only through `load_weights` (HF names, full tensors; each rank keeps its rollout-TP slice).

Generation: prompts are left-padded; one prefill, then one token per step through megatron's
`StaticInferenceContext` (the KV cache). Padded keys are masked with an explicit mask (True =
masked). RoPE in megatron's static inference path indexes rotary angles by cache slot, not by
position id; attention scores depend only on the distance between query and key, so a left pad
shift leaves the results unchanged (position ids are still derived from the mask and passed). Rows
that stop leave the batch and the cache is compacted, so finished sequences cost nothing. Logits are
gathered over rollout TP and every TP rank samples identically from the per-row generators.
"""
from __future__ import annotations

import contextlib
from typing import Iterable

import torch

from hybridrl.models import hf_convert as hc
from hybridrl.models.gpt import GPTSpec, build_gpt
from hybridrl.models.hf_config import check_parallel_layout
from hybridrl.offload import TensorStash
from hybridrl.reshard import RolloutGroups, join_requests, new_rollout_groups
from hybridrl.rollout.base import (RolloutOutput, SamplingParams, expand_requests, pack_output,
                                   row_generators, sample_next, weight_checksum)


@contextlib.contextmanager
def _default_process_groups(pg_collection):
    """While building, megatron's fallback for a missing pg_collection returns the rollout groups.

    `build_gpt` takes no pg_collection; GPTModel and each of its layers call
    `ProcessGroupCollection.use_mpu_process_groups()` exactly when none is given, so routing that
    call reuses build_gpt's architecture unchanged on the rollout groups.
    """
    from megatron.core.process_groups_config import ProcessGroupCollection as PGC

    saved = PGC.__dict__["use_mpu_process_groups"]
    PGC.use_mpu_process_groups = classmethod(lambda cls, required_pgs=None: pg_collection)
    try:
        yield
    finally:
        PGC.use_mpu_process_groups = saved


def build_rollout_model(spec: GPTSpec, groups: RolloutGroups, dtype: str = "float32"):
    """GPTModel at rollout TP (PP 1) on `groups`, in eval mode, weights uninitialised."""
    from megatron.core.process_groups_config import ProcessGroupCollection

    pgc = ProcessGroupCollection(tp=groups.tp_group, pp=groups.solo_group, cp=groups.solo_group,
                                 tp_cp=groups.tp_group, mp=groups.tp_group, embd=None, pos_embd=None)
    with _default_process_groups(pgc):
        model = build_gpt(spec, groups.tp, 1, 0, dtype, perform_initialization=False)
    model.eval()
    for p in model.parameters():
        p.requires_grad_(False)
    return model


def _attention_mask(valid: torch.Tensor, s_in: int) -> torch.Tensor:
    """[B, 1, s_in, Sk] bool, True = masked: causal, padded keys, for the last s_in query slots."""
    sk = valid.shape[1]
    keys = torch.arange(sk, device=valid.device)
    queries = keys[sk - s_in:]
    masked = (keys[None, :] > queries[:, None])[None] | ~valid[:, None, :]
    # a left-pad query would see no key at all; letting it see itself keeps its softmax finite
    masked &= ~(keys[None, :] == queries[:, None])[None]
    return masked[:, None]


def _compact_cache(ctx, keep: torch.Tensor) -> None:
    """Keep only the rows `keep` of every layer's KV cache ([S, B, groups, dim])."""
    for layer, (k, v) in ctx.key_value_memory_dict.items():
        ctx.key_value_memory_dict[layer] = (k.index_select(1, keep), v.index_select(1, keep))
    ctx.max_batch_size = keep.numel()


class NativeEngine:
    """RolloutEngine on megatron-core.

    `groups`: the engine's `RolloutGroups`; anything else (None, the training `ParallelGroups`) means
    `new_rollout_groups(rollout_tp)` (collective on the world the first time).
    """

    def __init__(self, spec: GPTSpec, rollout_tp: int = 1, groups: RolloutGroups | None = None,
                 dtype: str = "float32", pad_id: int = 0, eos_id: int | None = None,
                 max_batch_size: int = 256, offload_weights_on_sleep: bool | None = None):
        check_parallel_layout(spec, rollout_tp, 1)
        self.groups = groups if isinstance(groups, RolloutGroups) else new_rollout_groups(rollout_tp)
        if self.groups.tp != rollout_tp:
            raise ValueError(f"groups have tp={self.groups.tp}, engine asked for rollout_tp={rollout_tp}")
        self.spec, self.pad_id, self.eos_id, self.max_batch_size = spec, pad_id, eos_id, max_batch_size
        self.model = build_rollout_model(spec, self.groups, dtype)
        self.device = next(self.model.parameters()).device
        names = [g for _, g in hc.stage_names(spec, 1, 0)]
        state = self.model.state_dict(keep_vars=True)
        self.params = {g: state[g] for g in names}
        self._to_mcore = hc.mcore_to_hf_name_map(spec)
        self._pending: dict[str, dict[str, torch.Tensor]] = {}
        self._loaded: set[str] = set()
        on_gpu = torch.cuda.is_available()
        self._offload_on_sleep = on_gpu if offload_weights_on_sleep is None else offload_weights_on_sleep
        self._stash: TensorStash | None = None

    # ---- weights -------------------------------------------------------------------------------

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> dict:
        """Copy this rank's rollout-TP slice of each megatron tensor once all its HF parts arrived.

        A sleeping engine is woken first (its weights must be in place to be overwritten).
        """
        self.wake_up()
        received = {}
        for name, tensor in weights:
            received[name] = weight_checksum(tensor)
            if name == hc.HF_LM_HEAD and self.spec.tie_word_embeddings:
                continue  # tied: the head is the embedding, which arrives under its own name
            if name not in self._to_mcore:
                raise KeyError(f"load_weights got {name!r}, which is not a weight of this model")
            global_name = self._to_mcore[name][0]
            parts = self._pending.setdefault(global_name, {})
            parts[name] = tensor
            if len(parts) == len(hc.hf_sources(global_name, self.spec)):
                del self._pending[global_name]
                self._copy_in(global_name, parts)
        return received

    @torch.no_grad()
    def _copy_in(self, global_name: str, parts: dict) -> None:
        param = self.params[global_name]
        if hc.is_vocab_tensor(global_name):
            # rows straight into the parameter: the padded shard (often the largest tensor) is never
            # materialised; rows past the true vocabulary are megatron's zero padding
            rows = next(iter(parts.values()))[self.groups.tp_rank * param.shape[0]:][:param.shape[0]]
            param[:rows.shape[0]].copy_(rows)
            param[rows.shape[0]:].zero_()
        else:
            param.copy_(hc.read_shard(global_name, hc.DictReader(parts), self.spec, self.groups.tp,
                                      self.groups.tp_rank))
        self._loaded.add(global_name)

    def _check_ready(self) -> None:
        if self._stash is not None:
            raise RuntimeError("NativeEngine is asleep: call wake_up() before generate()")
        missing = sorted(set(self.params) - self._loaded)
        if missing:
            raise RuntimeError(f"NativeEngine weights not loaded: {missing[:3]} ({len(missing)} tensors); "
                               "stream the model in with reshard.update_engine_weights first")

    def sleep(self) -> None:
        """Drop nothing that is needed; on GPU (or when asked) move the weights to host memory."""
        if self._offload_on_sleep and self._stash is None:
            self._stash = TensorStash(self.params.values())

    def wake_up(self) -> None:
        if self._stash is not None:
            self._stash.restore()
            self._stash = None

    # ---- generation ----------------------------------------------------------------------------

    def generate(self, prompt_token_ids: list[list[int]], sampling: SamplingParams,
                 prompt_seeds: list[int] | None = None) -> RolloutOutput:
        self._check_ready()
        if prompt_seeds is None:
            prompt_seeds = [sampling.seed + i for i in range(len(prompt_token_ids))]
        prompts, seeds, (lo, hi) = join_requests(prompt_token_ids, prompt_seeds, self.groups)
        rows = expand_requests(prompts, sampling, seeds)
        stops = set(sampling.stop_token_ids) | ({self.eos_id} if self.eos_id is not None else set())
        tokens, log_probs, stats = [], [], {"rollout/forward_tokens": 0, "rollout/generated_tokens": 0}
        # micro-batches only bound memory: every row's samples depend on its own generator alone
        for start in range(0, len(rows), self.max_batch_size):
            t, lp = self._generate_batch(rows[start:start + self.max_batch_size], sampling, stops, stats)
            tokens += t
            log_probs += lp
        n = sampling.n
        return pack_output(tokens[lo * n:hi * n], log_probs[lo * n:hi * n], sampling.max_new_tokens,
                           self.pad_id, stats)

    @torch.no_grad()
    def _forward(self, input_ids, valid, ctx, stats) -> torch.Tensor:
        """Next-token logits [B, V] (true vocab, fp32) after feeding input_ids through the cache."""
        s_in = input_ids.shape[1]
        position_ids = (valid.long().cumsum(-1) - 1).clamp(min=0)[:, -s_in:]
        logits = self.model(input_ids, position_ids, _attention_mask(valid, s_in), inference_context=ctx,
                            runtime_gather_output=True)
        ctx.sequence_len_offset += s_in
        stats["rollout/forward_tokens"] += input_ids.numel()
        return logits[:, -1, :self.spec.vocab_size].float()

    def _generate_batch(self, rows, sampling: SamplingParams, stops: set, stats: dict):
        from megatron.core.inference.contexts import StaticInferenceContext

        batch, plen, new = len(rows), max(len(p) for p, _ in rows), sampling.max_new_tokens
        input_ids = torch.full((batch, plen), self.pad_id, dtype=torch.long, device=self.device)
        valid = torch.zeros(batch, plen + new, dtype=torch.bool, device=self.device)
        for b, (prompt, _) in enumerate(rows):
            input_ids[b, plen - len(prompt):] = torch.tensor(prompt, device=self.device)
            valid[b, plen - len(prompt):plen] = True
        generators = row_generators([seed for _, seed in rows], self.device)
        ctx = StaticInferenceContext(batch, plen + new)
        active = list(range(batch))
        out_tokens, out_logp = [[] for _ in rows], [[] for _ in rows]
        logits = self._forward(input_ids, valid[:, :plen], ctx, stats)
        for step in range(new):
            tok, logp = sample_next(logits, sampling, [generators[r] for r in active])
            keep = []
            for i, (t, lp) in enumerate(zip(tok.tolist(), logp.tolist())):
                out_tokens[active[i]].append(t)
                out_logp[active[i]].append(lp)
                if t not in stops:
                    keep.append(i)
            stats["rollout/generated_tokens"] += len(active)
            if step == new - 1 or not keep:
                break
            if len(keep) < len(active):
                idx = torch.tensor(keep, device=self.device)
                _compact_cache(ctx, idx)
                valid, tok, active = valid[idx], tok[idx], [active[i] for i in keep]
            valid[:, plen + step] = True
            logits = self._forward(tok[:, None], valid[:, :plen + step + 1], ctx, stats)
        return out_tokens, out_logp
