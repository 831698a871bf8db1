"""The native rollout engine: KV-cache generation on a megatron-core GPTModel at rollout TP.

The engine owns a second GPTModel (pipeline size 1) laid out for the rollout TP, built on its own
process groups (`reshard.new_rollout_groups`) through megatron-core's `ProcessGroupCollection`, so
its TP is independent of the training TP held by megatron's global parallel_state. Its weights are
filled through `load_weights` (HF names, full tensors; each rank keeps its rollout-TP slice) or
`load_shards` (a trainer's shards at the same layout), both copies; or, at the same layout on the same
device, `share_shards` makes its parameters aliases of the trainer's own tensors: no copy, no second
copy in memory, and the optimizer's in-place updates are what the next generate reads.

Generation has two paths over those same weights. The default, `decode="lean"`, is a per-layer
decode over the model's own tensors (`lean_decode.py`) with continuous batching over
`max_num_seqs` KV-cache slots (`continuous_batching.py`) and, on CUDA unless `enforce_eager`, CUDA
graphs per batch-size bucket (`cuda_graphs.py`). `decode="megatron"` runs megatron's own forward
with its `StaticInferenceContext` (`megatron_static.py`). Both gather logits over rollout TP and
sample with the shared per-request seeded rule of `base.py`, so every TP rank draws the same tokens.

MoE models run with expert parallel size 1 in the engine (every expert on every rank, split over
rollout TP as the dense MLP is); the lean path runs them eagerly (its expert loop syncs with the host).
`record_routes=True` (lean path) returns the experts each token was routed to
(`RolloutOutput.routed_experts`).
"""
from __future__ import annotations

import contextlib
import dataclasses
from typing import Iterable

import torch

from hybridrl.models import hf_convert as hc
from hybridrl.models.gpt import GPTSpec, build_gpt
from hybridrl.models.hf_config import check_parallel_layout
from hybridrl.placement.offload import TensorStash
from hybridrl.placement.reshard import RolloutGroups, join_requests, new_rollout_groups
from hybridrl.rollout.base import RolloutOutput, SamplingParams, expand_requests, left_align_routes, pack_output
from hybridrl.placement.engine_layout import add_stored_parts
from hybridrl.placement.fingerprint import Fingerprints, Stored, hf_region, weight_digests
from hybridrl.rollout.continuous_batching import SlotBatch
from hybridrl.rollout.lean_decode import LeanGPT
from hybridrl.rollout.megatron_static import generate_static


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


def rollout_process_groups(groups: RolloutGroups):
    """megatron's ProcessGroupCollection of the engine: TP = rollout TP, PP = CP = 1, and for MoE layers
    EP = 1 (every expert local) with the experts split over the same TP group (expert TP = TP)."""
    from megatron.core.process_groups_config import ProcessGroupCollection

    tp, solo = groups.tp_group, groups.solo_group
    return ProcessGroupCollection(tp=tp, pp=solo, cp=solo, tp_cp=tp, mp=tp, embd=None, pos_embd=None,
                                  ep=solo, expt_tp=tp, expt_dp=solo, tp_ep=tp, tp_ep_pp=tp, tp_dp_cp=tp)


def build_rollout_model(spec: GPTSpec, groups: RolloutGroups, dtype: str = "float32"):
    """GPTModel at rollout TP (PP 1, EP 1) on `groups`, in eval mode, weights uninitialised."""
    with _default_process_groups(rollout_process_groups(groups)):
        # ep/etp explicit: the training layout's expert parallel size in parallel_state does not apply
        model = build_gpt(spec, groups.tp, 1, 0, dtype, ep=1, etp=groups.tp if spec.is_moe else None,
                          perform_initialization=False)
    model.eval()
    for p in model.parameters():
        p.requires_grad_(False)
    return model


def _check_moe_options(spec: GPTSpec, decode: str, record_routes: bool) -> None:
    if record_routes and not spec.is_moe:
        raise ValueError("record_routes=True needs an MoE model (routes are the experts each token went to); "
                         "this model is dense: leave it off")
    if record_routes and decode == "megatron":
        raise ValueError("record_routes=True is implemented on the lean decode path only; use decode='lean'")


class NativeEngine:
    """RolloutEngine on megatron-core.

    `groups`: the engine's `RolloutGroups`; anything else (None, the training `ParallelGroups`) means
    `new_rollout_groups(rollout_tp)` (collective on the world the first time). `max_num_seqs`: KV-cache
    slots of the lean path (the batch bound of the megatron path). `enforce_eager`: no CUDA graphs.
    `record_routes` (MoE models, lean path): every output carries `routed_experts` (routing replay).
    """

    def __init__(self, spec: GPTSpec, rollout_tp: int = 1, groups: RolloutGroups | None = None,
                 dtype: str = "float32", pad_id: int = 0, eos_id: int | None = None,
                 max_num_seqs: int = 256, offload_weights_on_sleep: bool | None = None,
                 enforce_eager: bool = False, decode: str = "lean", record_routes: bool = False):
        check_parallel_layout(spec, rollout_tp, 1)
        _check_moe_options(spec, decode, record_routes)
        self.groups = groups if isinstance(groups, RolloutGroups) else new_rollout_groups(rollout_tp)
        if self.groups.tp != rollout_tp:
            raise ValueError(f"groups have tp={self.groups.tp}, engine asked for rollout_tp={rollout_tp}")
        if decode not in ("lean", "megatron"):
            raise ValueError(f"decode must be 'lean' or 'megatron', got {decode!r}")
        self.spec, self.pad_id, self.eos_id, self.max_num_seqs = spec, pad_id, eos_id, max_num_seqs
        self.decode, self.enforce_eager, self.record_routes = decode, enforce_eager, record_routes
        self.between_steps = None
        """Partial rollout (lean path): called between decode steps; True when it replaced the weights."""
        self.model = build_rollout_model(spec, self.groups, dtype)
        self.device = next(self.model.parameters()).device
        self._init_weights(offload_weights_on_sleep)

    # ---- weights -------------------------------------------------------------------------------

    def _init_weights(self, offload_weights_on_sleep: bool | None) -> None:
        names = [g for _, g in hc.stage_names(self.spec, 1, 0)]
        state = self.model.state_dict(keep_vars=True)
        self.params = {g: state[g] for g in names}
        self._dtypes = {g: p.dtype for g, p in self.params.items()}  # kept while a parameter reads a trainer's
        self._by_sources = None  # own name by HF sources, for a Transformer Engine trainer's names (`_own_name`)
        self._shared: dict[str, torch.Tensor] = {}
        """name -> the trainer's tensor the parameter reads (`share_shards`); empty: the engine's own copy."""
        self._aliased: set[str] = set()
        """Parameters that alias storage not the engine's (shared now, or released and not reloaded since)."""
        self._bind_slots()
        self._loaded: set[str] = set()
        on_gpu = torch.cuda.is_available()
        self.offload_weights_on_sleep = on_gpu if offload_weights_on_sleep is None else offload_weights_on_sleep
        self._stash: TensorStash | None = None
        self._host_weights: list = []  # the host buffers of sleep, kept from one sleep to the next

    def _bind_slots(self) -> None:
        """Where each HF tensor's slice lives inside the parameters (views, valid across sleep / wake);
        megatron's vocab padding rows zeroed in an own copy (no HF tensor covers them)."""
        self._slots = {hf: (g, view, region) for g, p in self.params.items() for hf, view, region
                       in hc.shard_parts(g, p, self.spec, self.groups.tp, self.groups.tp_rank)}
        with torch.no_grad():
            for g, p in self.params.items():
                if hc.is_vocab_tensor(g) and g not in self._aliased:
                    p[self._slots[hc.hf_sources(g, self.spec)[0]][1].shape[0]:].zero_()

    def shard_layout(self) -> tuple:
        """(tp, tp_rank, dtype) of the parameters: a trainer with the same layout can `load_shards`."""
        return self.groups.tp, self.groups.tp_rank, next(iter(self._dtypes.values()))

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]], verify: str = "fingerprint") -> dict:
        """Copy this rank's slice of each HF tensor straight into its place in the parameters.

        After the whole bucket, each slice is read back from the parameters and digested:
        {hf_name: Stored(region, digest)}. A sleeping engine is woken first, without its old weights;
        an engine that read a trainer's tensors (`share_shards`) gets its own copy back first.
        """
        self._wake_to_overwrite()
        self._own_copy()
        placed = []
        for name, tensor in weights:
            if name not in self._slots:
                raise KeyError(f"load_weights got {name!r}, which is not a weight of this model")
            self._copy_in(name, tensor)
            placed.append((name, tensor.dim()))
        return self._read_back(placed, verify)

    def load_shards(self, shards: Iterable[tuple[str, torch.Tensor]], verify: str = "fingerprint") -> dict:
        """Megatron tensors already at this engine's layout (`shard_layout`), by global name: copied
        whole into the parameters, then read back per HF tensor like `load_weights`."""
        self._wake_to_overwrite()
        self._own_copy()
        placed = []
        for global_name, shard in shards:
            own = self._own_name(global_name)
            self._copy_shard(own, shard)
            placed += [(hf, shard.dim()) for hf in hc.hf_sources(own, self.spec)]
        return self._read_back(placed, verify)

    # ---- megatron-layout handoff: a sender writes the parameters, the engine reads back -------

    def layout_targets(self, names: Iterable[str]) -> dict:
        """{trainer's global megatron name: the parameter it is written into}, at this engine's own layout
        (`shard_layout`): a resharding sender gathers straight into them (`reshard._send_layout`) or hands
        full tensors to `take_full`. Wakes the engine and gives those parameters storage of its own first, like
        `load_weights`; the others keep what they read (a trainer stage's own tensors, `share_shards`)."""
        names = list(names)
        owns = [self._own_name(name) for name in names]
        self._wake_to_overwrite()
        self._own_copy(owns)
        out = {}
        for name, own in zip(names, owns):
            out[name] = self.params[own]
            self._loaded.update(hc.hf_sources(own, self.spec))
        return out

    def stored_dtype(self, name: str) -> torch.dtype:
        """The dtype this engine stores a trainer's megatron tensor in (global name, either spec) in a copy of its
        own: the local spec's norms fp32, the rest the engine's dtype (a Transformer Engine trainer holds its norms in
        the model's dtype). So even while a parameter reads the trainer's tensor itself (`share_shards`), in the
        trainer's dtype: what another stage's engine, which copies it, stores."""
        return self._dtypes[self._own_name(name)]

    @torch.no_grad()
    def take_full(self, name: str, full: torch.Tensor) -> None:
        """Copy this rank's shard of a full (TP-merged) megatron tensor into its parameter; vocabulary rows
        past the true vocabulary stay zero (the full tensor may be padded for another TP)."""
        param, tp, rank = self.params[self._own_name(name)], self.groups.tp, self.groups.tp_rank
        if hc.is_vocab_tensor(name):
            start = rank * param.shape[0]
            rows = max(0, min(param.shape[0], self.spec.vocab_size - start))
            param[:rows].copy_(full[start:start + rows])
        elif tp == 1 or hc.tp_split_dim(name) is None:
            param.copy_(full)
        elif "linear_fc1.weight" in name:  # [gate_r; up_r] from the merged [gate; up]
            for dst, src in zip(param.chunk(2), full.chunk(2)):
                dst.copy_(src.chunk(tp)[rank])
        else:
            param.copy_(full.chunk(tp, dim=hc.tp_split_dim(name))[rank])

    def layout_digests(self, names: Iterable[str], into: Fingerprints) -> None:
        """Add into `into`, under each name, the fingerprint of what the parameter holds of that megatron tensor
        at its place in the merged tensor (`engine_layout.add_stored_parts`), read back after a
        `layout_targets` handoff."""
        for n in names:
            add_stored_parts(into, n, n, self.params[self._own_name(n)], self.spec, self.groups.tp, self.groups.tp_rank)

    # ---- shared weights: the trainer's own tensors, no copy ------------------------------------

    def share_shards(self, shards: Iterable[tuple[str, torch.Tensor]]) -> dict:
        """Read a trainer's own tensors at this engine's layout (`shard_layout`, same device), by global
        name: each parameter becomes an alias of that tensor's storage - no copy, and the engine's own
        copy is freed. Some tensors only (a pipeline stage's, `reshard._send_layout`): the others keep the
        engine's storage and are loaded as before. A tensor already shared is kept as it was (not re-adopted),
        so what this returns, {name: (the tensor adopted, the parameter the decode reads)}, is what the caller
        checks the identity of: a trainer tensor replaced since (not updated in place) no longer matches.
        In-place updates (the optimizer's step, a checkpoint load) and offload / onload (the storage is
        resized, not replaced) need nothing. After replacing parameters, `release_shared()`.
        """
        adopted, held = False, {}
        for name, shard in shards:
            own = self._own_name(name)
            if own not in self._shared:
                self._adopt(own, shard)
                adopted = True
            self._loaded.update(hc.hf_sources(own, self.spec))  # a wake for the other tensors' load forgot it
            held[name] = (self._shared[own], self.params[own])
        if adopted:
            self._bind_slots()  # the old slot views kept the engine's own storages alive
            self._host_weights = []
        return held

    @torch.no_grad()
    def _adopt(self, own: str, shard: torch.Tensor) -> None:
        param = self.params[own]
        # a tensor kept in another dtype than the weights (the local spec's fp32 norms) reads the trainer's as it
        # is, in the weights' dtype too (a Transformer Engine trainer's norms are bf16 in a bf16 model)
        dtypes = {self._dtypes[own], self.shard_layout()[2]}
        if (shard.shape, shard.device) != (param.shape, param.device) or shard.dtype not in dtypes:
            raise ValueError(f"share_shards: {own!r} is {list(shard.shape)} {shard.dtype} on {shard.device}, the "
                             f"engine's is {list(param.shape)} {self._dtypes[own]} on {param.device}; such a layout "
                             f"takes the copy path (load_shards / load_weights)")
        if self._stash is not None:  # asleep: the freed storages are dropped, not restored
            self._stash, self._loaded = None, set()
        param.data = shard.detach()
        self._shared[own] = shard.detach()  # shares the trainer tensor's version counter
        self._aliased.add(own)

    def release_shared(self) -> None:
        """Forget the trainer tensors; the next `share_shards` adopts the ones it is given (call it after
        replacing the trainer's parameters). Generation refuses to run until then."""
        self._shared, self._loaded = {}, set()

    def own_weight_bytes(self) -> int:
        """Bytes of the weights the engine holds itself (none of those that alias a trainer's tensors)."""
        return sum({id(p.untyped_storage()): p.untyped_storage().nbytes() for g, p in self.params.items()
                    if g not in self._aliased}.values())

    def _own_copy(self, owns=None) -> None:
        """Before a copy into the parameters `owns` (own names; None: all): storage of the engine's own where
        they alias a trainer's (a load must never write into the trainer's tensors), or where a sleep's stash
        was dropped by a later `share_shards`; their values come with the load."""
        owns = list(self.params) if owns is None else owns
        bare = [g for g in owns if g in self._aliased or self.params[g].untyped_storage().nbytes() == 0]
        if not bare:
            return
        with torch.no_grad():
            for g in bare:
                self.params[g].data = torch.empty_like(self.params[g], dtype=self._dtypes[g])  # its own dtype again
                self._aliased.discard(g)
                self._shared.pop(g, None)
                self._loaded.difference_update(hc.hf_sources(g, self.spec))
        self._bind_slots()

    def _own_name(self, name: str) -> str:
        """This engine's (local layer spec) name of a trainer's global megatron name (either spec)."""
        if name in self.params:
            return name
        if self._by_sources is None:
            self._by_sources = {hc.hf_sources(g, self.spec): g for g in self.params}
        return self._by_sources[hc.hf_sources(name, dataclasses.replace(self.spec, layer_spec="te"))]

    @torch.no_grad()
    def _copy_shard(self, own: str, shard: torch.Tensor) -> None:
        self.params[own].copy_(shard)
        self._loaded.update(hc.hf_sources(own, self.spec))

    @torch.no_grad()
    def _copy_in(self, name: str, tensor: torch.Tensor) -> None:
        _, view, region = self._slots[name]
        view.copy_(hf_region(tensor, region).reshape(view.shape))
        self._loaded.add(name)

    def _read_back(self, placed: list, verify: str) -> dict:
        if verify == "off":
            return {}
        slots = [self._slots[name] for name, _ in placed]
        digests = weight_digests([view.reshape(-1) if hf_dim == 1 else view
                                  for (_, view, _), (_, hf_dim) in zip(slots, placed)], verify)
        return {name: Stored(region, digest, view.dtype)
                for (name, _), (_, view, region), digest in zip(placed, slots, digests)}

    def _check_ready(self) -> None:
        if self._stash is not None:
            raise RuntimeError("NativeEngine is asleep: call wake_up() before generate()")
        missing = sorted(set(self._slots) - self._loaded)
        if missing:
            raise RuntimeError(f"NativeEngine weights not loaded: {missing[:3]} ({len(missing)} tensors); "
                               "stream the model in with reshard.update_engine_weights first")
        gone = [g for g, t in self._shared.items()
                if t.untyped_storage().nbytes() < (t.storage_offset() + t.numel()) * t.element_size()]
        if gone:
            raise RuntimeError(f"NativeEngine reads the trainer's own weights, and {gone[0]!r} ({len(gone)} "
                               "tensors) is offloaded now: keep the actor's params on the device while generating "
                               "(PhaseOffload.engine_reads)")

    def sleep(self) -> None:
        """Drop nothing that is needed; on GPU (or when asked) move the engine's own weights to host memory.
        Shared weights stay: they are the trainer's, whose offload decides where they live."""
        own = [p for g, p in self.params.items() if g not in self._aliased]
        if self.offload_weights_on_sleep and self._stash is None and own:
            self._stash = TensorStash(own, hosts=self._host_weights)

    def wake_up(self) -> None:
        if self._stash is not None:
            self._stash.restore()
            self._stash = None

    def _wake_to_overwrite(self) -> None:
        """Wake for a weight sync: the parameters come back zeroed, not copied from the host, since the
        sync overwrites them; until it has loaded every weight, generate refuses to run."""
        if self._stash is not None:
            self._stash.restore(values=False)
            self._stash = None
            self._loaded = set()

    # ---- generation ----------------------------------------------------------------------------

    def generate(self, prompt_token_ids: list[list[int]], sampling: SamplingParams,
                 prompt_seeds: list[int] | None = None) -> RolloutOutput:
        self._check_ready()
        if prompt_seeds is None:
            prompt_seeds = [sampling.seed + i for i in range(len(prompt_token_ids))]
        prompts, seeds, (lo, hi) = join_requests(prompt_token_ids, prompt_seeds, self.groups)
        rows = expand_requests(prompts, sampling, seeds)
        stops = set() if sampling.ignore_eos else \
            set(sampling.stop_token_ids) | ({self.eos_id} if self.eos_id is not None else set())
        rows_out = slice(lo * sampling.n, hi * sampling.n)
        if not rows:  # no request on any rank of the group (e.g. an agent loop with every episode done)
            out = pack_output([], [], sampling.max_new_tokens, self.pad_id,
                              {"rollout/forward_tokens": 0, "rollout/generated_tokens": 0})
            if self.record_routes:
                out.routed_experts = torch.zeros(0, sampling.max_new_tokens, self.spec.num_layers,
                                                 self.spec.moe_topk, dtype=torch.int16)
            return out
        if self.decode == "megatron":
            return self._generate_megatron(rows, sampling, stops, rows_out)
        # the MoE expert loop reads each expert's token count on the host: no CUDA graphs
        eager = self.enforce_eager or self.spec.is_moe
        graphs = "capture" if self.device.type == "cuda" and not eager else "off"
        batch = SlotBatch(LeanGPT(self.model, self.spec, self.groups), rows, sampling, stops, self.pad_id,
                          self.max_num_seqs, graphs, self.between_steps, self.record_routes)
        responses, mask, log_probs = batch.run()
        epochs = torch.tensor(batch.row_epoch)[rows_out] if batch.epoch else None
        routes = None
        if batch.routes is not None:
            lens = [len(p) for p, _ in rows[rows_out]]
            routes = left_align_routes(batch.routes[rows_out], lens, sampling.max_new_tokens).cpu()
        return RolloutOutput(responses[rows_out].cpu(), mask[rows_out].cpu(), log_probs[rows_out].cpu(),
                             batch.stats, weight_epochs=epochs, routed_experts=routes)

    def _generate_megatron(self, rows, sampling: SamplingParams, stops: set, rows_out: slice) -> RolloutOutput:
        tokens, log_probs, stats = [], [], {"rollout/forward_tokens": 0, "rollout/generated_tokens": 0}
        # micro-batches only bound memory: every row's samples depend on its own seed alone
        for start in range(0, len(rows), self.max_num_seqs):
            t, lp = generate_static(self.model, self.spec.vocab_size, rows[start:start + self.max_num_seqs],
                                    sampling, stops, self.pad_id, stats)
            tokens += t
            log_probs += lp
        return pack_output(tokens[rows_out], log_probs[rows_out], sampling.max_new_tokens, self.pad_id, stats)
