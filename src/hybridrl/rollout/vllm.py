"""RolloutEngine over vLLM's offline `LLM` API, written against vLLM 0.33's source (requirements-gpu.txt pins
the range; older versions are refused, newer ones warned about).

One LLM per torchrun rank with `distributed_executor_backend="external_launcher"`: vLLM's torchrun
mode, where the engine core and its single worker live in this process (it requires
VLLM_ENABLE_V1_MULTIPROCESSING=0 and reads RANK / LOCAL_RANK, which `parallel.distributed` exports
for bare srun launches too) and TP groups of consecutive ranks are formed over the existing
torch.distributed world, the groups acting as independent data-parallel replicas. Also
`enable_sleep_mode=True`, `skip_tokenizer_init=True` (token ids in and out), `dtype=rollout.dtype` and
`load_format="dummy"` when the trainer streams the weights in; the config-only model folder (with both
`rope_parameters` and the older `rope_scaling`) is removed with the engine. MoE models pin
`moe_backend="triton"` (as NeMo-RL does): its expert parameters keep the checkpoint layout, so streamed
expert weights land where the read-back looks, and the worker refuses another backend.
Build it while the training state is offloaded: vLLM's worker refuses to start with less than
`gpu_memory_utilization x total` memory free. Weight updates go through
`LLM.collective_rpc(fn, args=...)`, which calls `fn(worker, ...)` in the worker; there the model's own
`load_weights(iterable of (HF name, full tensor))` shards them for vLLM's TP; the slice each rank
stored is then read back from the model's parameters and digested (`vllm_layout` knows where vLLM
keeps each HF tensor), and the prefix cache is reset after every load (cached KV blocks were computed with
the old weights). Once the last bucket is in, vLLM's `process_weights_after_loading` runs once (as verl and
prime-rl do after an update), just before the next generation. The digests compare bit patterns, so the
trainer must send weights in the engine's dtype: another dtype is refused at the first bucket unless
`rollout.verify_weights=off` (then vLLM's loader casts them, as in verl).
Sleep is level 2 (as verl's since vLLM 0.8.5): weights and KV cache are discarded, not copied to the host,
since every weight is streamed in again before the next generation; generating before that is refused.
Sampling uses one request per (prompt, sample) with the per-sample seed from `base.sample_seed`,
`n=1`, `logprobs=0` (the sampled token's log-prob), and every eos id as a stop token.
Log-probs: the engine is built with `logprobs_mode="processed_logprobs"`, the log-softmax of the logits after
temperature (and after top-k / top-p, when those are on: then they are the log-probs of the truncated
distribution vLLM actually sampled from).
vLLM's sampler differs from the native engine's, so samples match only in distribution.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import tempfile
import warnings
import weakref
from typing import Iterable, Sequence

import torch
import torch.distributed as dist

from hybridrl.config import RolloutConfig
from hybridrl.config.checks import ConfigError
from hybridrl.models import hf_convert as hc
from hybridrl.models.gpt import DTYPES, GPTSpec
from hybridrl.models.hf_config import hf_config_from_spec
from hybridrl.placement.reshard import join_requests, new_rollout_groups
from hybridrl.rollout.base import RolloutOutput, SamplingParams, expand_requests, pack_output
from hybridrl.placement.fingerprint import Stored, weight_digests
from hybridrl.rollout.vllm_layout import FUSED_EXPERTS, expert_params, stored_slice

MIN_VLLM_VERSION = (0, 33, 0, 1)
"""The oldest vLLM accepted: the release whose source this adapter was read against."""
CHECKED_BELOW = (0, 34, 0, 0)
"""Newer vLLM runs with a warning: its weight layout has not been checked."""
INSTALL_HINT = "pip install -r requirements-gpu.txt"
SLEEP_TAGS = ("weights", "kv_cache")  # what LLM.wake_up(tags=...) can wake separately
SLEEP_LEVEL = 2  # weights and KV cache discarded: the weights are streamed in again before generating
CANONICAL_MOE_BACKENDS = ("TRITON", "BATCHED_TRITON")  # keep the checkpoint layout of expert weights


def _version_tuple(version: str) -> tuple:
    """(major, minor, patch, final) of e.g. "0.10.1", "0.11.0rc2", "0.10.2+cu128"; final is 0 for
    pre-releases and dev builds (0.10.0rc1 < 0.10.0 < 0.10.1.dev3); (0, 0, 0, 0) if unreadable."""
    m = re.match(r"(\d+)\.(\d+)(?:\.(\d+))?(.*)", version)
    if not m:
        return (0, 0, 0, 0)
    final = 0 if re.match(r"\.?(rc|a|b|dev|pre)", m.group(4)) else 1
    return tuple(int(g or 0) for g in m.groups()[:3]) + (final,)


def import_vllm():
    """The vllm module, or a clear error: not installed, or older than the source this adapter follows."""
    try:
        import vllm
    except ImportError as e:
        raise ImportError(f"rollout.name=vllm needs vLLM (not installed here): {INSTALL_HINT}, "
                          "or set rollout.name=native") from e
    version = getattr(vllm, "__version__", "0")
    if _version_tuple(version) < MIN_VLLM_VERSION:
        need = ".".join(map(str, MIN_VLLM_VERSION[:3]))
        raise ImportError(f"vLLM {version} is older than {need}, whose source hybridrl.rollout.vllm follows; "
                          f"upgrade with {INSTALL_HINT}")
    if _version_tuple(version) >= CHECKED_BELOW:
        warnings.warn(f"vLLM {version} is newer than the 0.33 series hybridrl.rollout.vllm was checked against; "
                      "the weight read-back will name any layout change", stacklevel=2)
    return vllm


def _model(worker):
    """The worker's model itself (vLLM may wrap it for CUDA graphs)."""
    runner = worker.model_runner
    return runner.get_model() if hasattr(runner, "get_model") else runner.model


def _check_moe_backend(params: dict) -> None:
    """Refuse expert weights a non-Triton MoE backend has padded or reordered (read as NeMo-RL does: the
    fused parameter's loader belongs to the layer whose quant method names the backend)."""
    for name, param in params.items():
        if name.rpartition(".")[2] not in FUSED_EXPERTS:
            continue
        owner = getattr(getattr(param, "weight_loader", None), "__self__", None)
        backend = getattr(getattr(owner, "quant_method", None), "unquantized_backend", None)
        if backend is not None and getattr(backend, "name", None) not in CANONICAL_MOE_BACKENDS:
            raise RuntimeError(f"vLLM runs {name!r} on the {backend.name} MoE backend, whose weight layout the "
                               "streamed weights would not match; build the engine with moe_backend='triton'")


def load_weights_on_worker(worker, weights, spec: GPTSpec, tp: int, tp_rank: int, verify: str) -> dict:
    """Runs inside the vLLM worker (via collective_rpc): load, then read each HF tensor's slice back
    from the model's own parameters (`vllm_layout`) and digest it: {hf_name: Stored}."""
    weights = list(weights)
    model = _model(worker)
    params = dict(model.named_parameters())
    _check_moe_backend(params)
    model.load_weights(weights=iter(weights))
    if verify == "off":
        return {}
    experts = expert_params(params)
    stored = [stored_slice(name, params, spec, tp, tp_rank, experts) for name, _ in weights]
    digests = weight_digests([view.reshape(-1) if tensor.dim() == 1 else view
                              for (view, _), (_, tensor) in zip(stored, weights)], verify)
    return {name: Stored(region, digest, view.dtype)  # the dtype it stores: a local-spec trainer's fp32 norms are bf16
            for (name, _), (view, region), digest in zip(weights, stored, digests)}


def process_weights_on_worker(worker) -> None:
    """Runs inside the vLLM worker once all buckets are in: vLLM's own post-load step over every layer."""
    from vllm.model_executor.model_loader.utils import process_weights_after_loading

    model = _model(worker)
    process_weights_after_loading(model, worker.model_runner.model_config, next(model.parameters()).device)


def dummy_model_folder(spec: GPTSpec, dtype: str = "bfloat16", eos_ids: Sequence[int] = ()) -> str:
    """A folder with config.json for `spec` (vLLM builds the architecture, weights come later) and a
    generation_config.json naming the tokenizer's eos ids: without one vLLM derives it from config.json, where
    transformers' Llama / Mixtral classes default eos_token_id to 2 (a `#` in Llama 3's vocabulary), and stops
    every response there. Both rope keys: transformers 5 reads `rope_parameters` (preferring a non-empty
    `rope_scaling`, equal here), releases on transformers 4 read `rope_theta` and `rope_scaling`."""
    cfg = hf_config_from_spec(spec, dtype=dtype)
    rope = {k: v for k, v in cfg["rope_parameters"].items() if k != "rope_theta"}
    cfg["rope_scaling"] = rope if rope.get("rope_type", "default") != "default" else None
    eos = list(eos_ids) or None
    cfg["eos_token_id"] = eos
    folder = tempfile.mkdtemp(prefix="hybridrl_vllm_")
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(cfg, f, indent=2)
    with open(os.path.join(folder, "generation_config.json"), "w") as f:
        json.dump({"eos_token_id": eos}, f, indent=2)
    return folder


class VLLMEngine:
    """vLLM behind the RolloutEngine protocol.

    Built from `spec` + `cfg` (a `config.RolloutConfig`): the model folder defaults to a config-only
    dummy folder and `load_format="dummy"` (the trainer streams the weights in). `llm=` wraps an
    LLM built elsewhere instead. Token ids in and out: no tokenizer is loaded, so `eos_id` (one id or
    all of them) is passed to vLLM as stop tokens.
    """

    def __init__(self, spec: GPTSpec | None = None, cfg: RolloutConfig | None = None, pad_id: int = 0,
                 eos_id: int | Sequence[int] | None = None, model_path: str | None = None,
                 max_model_len: int | None = None, load_format: str = "dummy", llm=None, **llm_kwargs):
        self.spec, self.pad_id, self.groups, self._asleep = spec, pad_id, None, set()
        self.eos_ids = () if eos_id is None else (eos_id,) if isinstance(eos_id, int) else tuple(eos_id)
        self._warned: set = set()
        self._processed, self._reloaded, self._discarded = True, set(), False
        cfg = cfg or RolloutConfig(name="vllm")
        self._dtype = None if llm is not None else DTYPES[cfg.dtype]
        if llm is not None:  # an LLM built elsewhere (tests); one process without torch.distributed is TP 1
            self.llm, self.vllm = llm, None
            self.groups = new_rollout_groups(cfg.tensor_model_parallel_size) if dist.is_initialized() else None
            return
        self.vllm = import_vllm()
        llm_kwargs.setdefault("logprobs_mode", "processed_logprobs")
        if spec.is_moe:  # expert weights keep the checkpoint layout (the read-back and later loads rely on it)
            llm_kwargs.setdefault("moe_backend", "triton")
        # external_launcher asserts an in-process engine core; collective_rpc then passes tensors by reference
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        if model_path is None:
            model_path = dummy_model_folder(spec, cfg.dtype, self.eos_ids)
            self._remove_folder = weakref.finalize(self, shutil.rmtree, model_path, True)
        self.llm = self.vllm.LLM(
            model=model_path, load_format=load_format,
            tensor_parallel_size=cfg.tensor_model_parallel_size, dtype=cfg.dtype, seed=cfg.seed,
            gpu_memory_utilization=cfg.gpu_memory_utilization, enforce_eager=cfg.enforce_eager,
            max_num_seqs=cfg.max_num_seqs,
            max_model_len=max_model_len or spec.max_position_embeddings, skip_tokenizer_init=True,
            enable_sleep_mode=True, distributed_executor_backend="external_launcher", **llm_kwargs)
        # vLLM forms its TP groups from consecutive ranks, as new_rollout_groups does
        self.groups = new_rollout_groups(cfg.tensor_model_parallel_size)

    @property
    def needs_weights(self) -> bool:
        """A sleep discarded the weights and they have not all been streamed in again: the caller syncs them
        before the next generate (verl streams them in at every switch to rollout mode)."""
        return bool(self._missing())

    def _missing(self) -> list:
        """The weights a sleep discarded that have not been streamed in again (sorted HF names)."""
        if not self._discarded or self.spec is None:
            return []
        return sorted(set(hc.mcore_to_hf_name_map(self.spec)) - self._reloaded)

    @property
    def _model_config(self):
        return getattr(getattr(self.llm, "llm_engine", None), "model_config", None)

    @property
    def logprobs_mode(self) -> str:
        """The engine's `ModelConfig.logprobs_mode`."""
        return getattr(self._model_config, "logprobs_mode", "raw_logprobs")

    @property
    def dtype(self) -> torch.dtype | None:
        """The dtype vLLM holds its weights in (`ModelConfig.dtype`; None where the LLM does not say)."""
        dtype = getattr(self._model_config, "dtype", None) or self._dtype
        return DTYPES.get(dtype, dtype) if isinstance(dtype, str) else dtype

    def _warn_once(self, key: str, message: str) -> None:
        if key not in self._warned:
            self._warned.add(key)
            warnings.warn(message, stacklevel=3)

    def _check_log_prob_semantics(self, sampling: SamplingParams) -> None:
        processed = str(self.logprobs_mode).endswith("processed_logprobs")
        if not processed and sampling.temperature not in (0, 1):
            self._warn_once("raw", "this engine returns log-probs before temperature; recompute them with the "
                                   f"actor (temperature={sampling.temperature}) or build it with "
                                   "logprobs_mode='processed_logprobs'")
        filtered = sampling.top_p < 1 or 0 < sampling.top_k
        if processed and filtered and sampling.temperature > 0:
            self._warn_once("filtered", "with top-k/top-p vLLM's log-probs are those of the truncated "
                                        "distribution it samples from, not the full-vocabulary log-softmax")

    def _sampling_params(self, sampling: SamplingParams, seed: int):
        vllm = self.vllm if self.vllm is not None else import_vllm()
        stops = set() if sampling.ignore_eos else set(sampling.stop_token_ids) | set(self.eos_ids)
        return vllm.SamplingParams(
            n=1, seed=seed, temperature=sampling.temperature, top_p=sampling.top_p,
            top_k=max(sampling.top_k, 0), max_tokens=sampling.max_new_tokens,
            logprobs=0, stop_token_ids=sorted(stops), ignore_eos=sampling.ignore_eos, detokenize=False)

    def _ready_to_generate(self) -> None:
        """Every weight streamed in since a sleep discarded them; vLLM's post-load step once after the last bucket."""
        missing = self._missing()
        if missing:
            raise RuntimeError(f"vLLM discarded its weights at sleep (level {SLEEP_LEVEL}) and {len(missing)} "
                               f"were not streamed in again ({missing[:3]}); run reshard.update_engine_weights "
                               "before generate")
        self._discarded = False
        if not self._processed:
            self.llm.collective_rpc(process_weights_on_worker)
            self._processed = True

    def generate(self, prompt_token_ids: list[list[int]], sampling: SamplingParams,
                 prompt_seeds: list[int] | None = None) -> RolloutOutput:
        self._check_log_prob_semantics(sampling)
        self._ready_to_generate()
        if prompt_seeds is None:
            prompt_seeds = [sampling.seed + i for i in range(len(prompt_token_ids))]
        # every rank of a vLLM TP group must submit the same requests
        joint, seeds, (lo, hi) = join_requests(prompt_token_ids, prompt_seeds, self.groups)
        rows = expand_requests(joint, sampling, seeds)
        if not rows:  # e.g. an agent loop's later turn once every trajectory of the group is done
            return pack_output([], [], sampling.max_new_tokens, self.pad_id, {"rollout/generated_tokens": 0})
        prompts = [{"prompt_token_ids": p} for p, _ in rows]
        params = [self._sampling_params(sampling, seed) for _, seed in rows]
        outputs = self.llm.generate(prompts, params, use_tqdm=False)
        tokens, log_probs = [], []
        for out in outputs:
            completion = out.outputs[0]
            ids = list(completion.token_ids)
            tokens.append(ids)
            log_probs.append([step[t].logprob for t, step in zip(ids, completion.logprobs or [])])
        tokens, log_probs = tokens[lo * sampling.n:hi * sampling.n], log_probs[lo * sampling.n:hi * sampling.n]
        return pack_output(tokens, log_probs, sampling.max_new_tokens, self.pad_id,
                           {"rollout/generated_tokens": sum(len(t) for t in tokens)})

    def _check_dtype(self, weights: list, verify: str) -> None:
        """The model's dtype (its weight matrices') must be the engine's; a vector may differ (the local spec keeps
        its norms in fp32 in a bf16 model): vLLM casts it, and it is checked as stored (`Stored.dtype`)."""
        sent = {t.dtype for _, t in weights if t.dim() >= 2}
        if verify == "off" or self.dtype is None or sent <= {self.dtype}:
            return
        name = {v: k for k, v in DTYPES.items()}
        got = ", ".join(sorted(name.get(d, str(d)) for d in sent))
        raise ConfigError(f"the trainer sends {got} weights (model.params_dtype) to a vLLM engine holding "
                          f"{name.get(self.dtype, self.dtype)} (rollout.dtype): the verified handoff compares their "
                          f"bits; set rollout.dtype={got} or model.params_dtype={name.get(self.dtype, self.dtype)}, "
                          "or rollout.verify_weights=off (vLLM then casts them)")

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]], verify: str = "fingerprint") -> dict:
        """One bucket into the (single, in-process) worker; returns its read-back digests.

        Wakes only the weights of a sleeping engine first (the KV cache stays freed until generate);
        afterwards the prefix cache is reset, since its blocks hold keys/values of the old weights.
        """
        weights = list(weights)
        self._check_dtype(weights, verify)
        self.wake_up(["weights"])
        tp, tp_rank = (self.groups.tp, self.groups.tp_rank) if self.groups is not None else (1, 0)
        stored = self.llm.collective_rpc(load_weights_on_worker, args=(weights, self.spec, tp, tp_rank, verify))[0]
        self.llm.reset_prefix_cache()
        self._reloaded.update(n for n, _ in weights)
        self._processed = False
        return stored

    def sleep(self) -> None:
        """Level 2: weights and KV cache discarded (no host copy: the next weight sync overwrites them)."""
        if not self._asleep:
            self.llm.sleep(level=SLEEP_LEVEL)
            self._asleep, self._discarded, self._reloaded = set(SLEEP_TAGS), True, set()

    def wake_up(self, tags: list[str] | None = None) -> None:
        """Wake what is asleep among `tags` (default: weights and KV cache)."""
        todo = [t for t in SLEEP_TAGS if t in self._asleep and (tags is None or t in tags)]
        if todo:
            self.llm.wake_up(tags=todo)
            self._asleep -= set(todo)
