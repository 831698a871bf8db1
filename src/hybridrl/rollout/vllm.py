"""RolloutEngine over vLLM's offline `LLM` API (follows vLLM 0.10's V1 engine; older versions refused).

One LLM per torchrun rank with `distributed_executor_backend="external_launcher"`: vLLM's torchrun
mode, where the engine core and its single worker live in this process (it requires
VLLM_ENABLE_V1_MULTIPROCESSING=0 and reads RANK / LOCAL_RANK, which `parallel.distributed` exports
for bare srun launches too) and TP groups of consecutive ranks are formed over the existing
torch.distributed world, the groups acting as independent data-parallel replicas. Also
`enable_sleep_mode=True`, `skip_tokenizer_init=True` (token ids in and out) and `load_format="dummy"`
when the trainer streams the weights in; the config-only model folder is removed with the engine.
Build it while the training state is offloaded: vLLM's worker refuses to start with less than
`gpu_memory_utilization x total` memory free. Weight updates go through
`LLM.collective_rpc(fn, args=...)`, which calls `fn(worker, ...)` in the worker; there the model's own
`load_weights(iterable of (HF name, full tensor))` shards them for vLLM's TP; the slice each rank
stored is then read back from the model's parameters and digested (`vllm_layout` knows where vLLM
keeps each HF tensor), and the prefix cache is reset after every load (cached KV blocks were computed with the old weights).
Sampling uses one request per (prompt, sample) with the per-sample seed from `base.sample_seed`,
`n=1`, `logprobs=0` (the sampled token's log-prob), and every eos id as a stop token.
Log-probs: from vLLM 0.10.2 the engine is built with `logprobs_mode="processed_logprobs"`, the
log-softmax of the logits after temperature (and after top-k / top-p, when those are on: then they
are the log-probs of the truncated distribution vLLM actually sampled from). Older versions report
raw log-probs (before temperature), which equal log_softmax(logits / T) only for T in {0, 1}.
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
from hybridrl.models.gpt import GPTSpec
from hybridrl.models.hf_config import hf_config_from_spec
from hybridrl.placement.reshard import join_requests, new_rollout_groups
from hybridrl.rollout.base import RolloutOutput, SamplingParams, expand_requests, pack_output
from hybridrl.placement.fingerprint import Stored, weight_digest
from hybridrl.rollout.vllm_layout import stored_slice

MIN_VLLM_VERSION = (0, 10, 0, 1)
PROCESSED_LOGPROBS_VERSION = (0, 10, 2, 0)  # first release with LLM(logprobs_mode=...)
INSTALL_HINT = "pip install -r requirements-gpu.txt"
SLEEP_TAGS = ("weights", "kv_cache")  # what LLM.wake_up(tags=...) can wake separately


def _version_tuple(version: str) -> tuple:
    """(major, minor, patch, final) of e.g. "0.10.1", "0.11.0rc2", "0.10.2+cu128"; final is 0 for
    pre-releases and dev builds (0.10.0rc1 < 0.10.0 < 0.10.1.dev3); (0, 0, 0, 0) if unreadable."""
    m = re.match(r"(\d+)\.(\d+)(?:\.(\d+))?(.*)", version)
    if not m:
        return (0, 0, 0, 0)
    final = 0 if re.match(r"\.?(rc|a|b|dev|pre)", m.group(4)) else 1
    return tuple(int(g or 0) for g in m.groups()[:3]) + (final,)


def import_vllm():
    """The vllm module, or a clear error: not installed, or older than the API this adapter follows."""
    try:
        import vllm
    except ImportError as e:
        raise ImportError(f"rollout.name=vllm needs vLLM (not installed here): {INSTALL_HINT}, "
                          "or set rollout.name=native") from e
    version = getattr(vllm, "__version__", "0")
    if _version_tuple(version) < MIN_VLLM_VERSION:
        need = ".".join(map(str, MIN_VLLM_VERSION[:3]))
        raise ImportError(f"vLLM {version} is older than {need}, whose API hybridrl.rollout.vllm follows; "
                          f"upgrade with {INSTALL_HINT}")
    return vllm


def load_weights_on_worker(worker, weights, spec: GPTSpec, tp: int, tp_rank: int, verify: str) -> dict:
    """Runs inside the vLLM worker (via collective_rpc): load, then read each HF tensor's slice back
    from the model's own parameters (`vllm_layout`) and digest it: {hf_name: Stored}."""
    weights = list(weights)
    model = worker.model_runner.model
    model.load_weights(weights=iter(weights))
    if verify == "off":
        return {}
    params = dict(model.named_parameters())
    out = {}
    for name, tensor in weights:
        view, region = stored_slice(name, params, spec, tp, tp_rank)
        out[name] = Stored(region, weight_digest(view.reshape(-1) if tensor.dim() == 1 else view, verify))
    return out


def dummy_model_folder(spec: GPTSpec, dtype: str = "bfloat16") -> str:
    """A folder with only config.json for `spec`: vLLM builds the architecture, weights come later."""
    folder = tempfile.mkdtemp(prefix="hybridrl_vllm_")
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(hf_config_from_spec(spec, dtype=dtype), f, indent=2)
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
                 dtype: str = "bfloat16", max_model_len: int | None = None, load_format: str = "dummy",
                 llm=None, **llm_kwargs):
        self.spec, self.pad_id, self.groups, self._asleep = spec, pad_id, None, set()
        self.eos_ids = () if eos_id is None else (eos_id,) if isinstance(eos_id, int) else tuple(eos_id)
        self._warned: set = set()
        cfg = cfg or RolloutConfig(name="vllm")
        if llm is not None:  # an LLM built elsewhere (tests); one process without torch.distributed is TP 1
            self.llm, self.vllm = llm, None
            self.groups = new_rollout_groups(cfg.tensor_model_parallel_size) if dist.is_initialized() else None
            return
        self.vllm = import_vllm()
        if _version_tuple(self.vllm.__version__) >= PROCESSED_LOGPROBS_VERSION:
            llm_kwargs.setdefault("logprobs_mode", "processed_logprobs")
        # external_launcher asserts an in-process engine core; collective_rpc then passes tensors by reference
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        if model_path is None:
            model_path = dummy_model_folder(spec, dtype)
            self._remove_folder = weakref.finalize(self, shutil.rmtree, model_path, True)
        self.llm = self.vllm.LLM(
            model=model_path, load_format=load_format,
            tensor_parallel_size=cfg.tensor_model_parallel_size, dtype=dtype, seed=cfg.seed,
            gpu_memory_utilization=cfg.gpu_memory_utilization, enforce_eager=cfg.enforce_eager,
            max_num_seqs=cfg.max_num_seqs,
            max_model_len=max_model_len or spec.max_position_embeddings, skip_tokenizer_init=True,
            enable_sleep_mode=True, distributed_executor_backend="external_launcher", **llm_kwargs)
        # vLLM forms its TP groups from consecutive ranks, as new_rollout_groups does
        self.groups = new_rollout_groups(cfg.tensor_model_parallel_size)

    @property
    def logprobs_mode(self) -> str:
        """The engine's `ModelConfig.logprobs_mode` ("raw_logprobs" before vLLM 0.10.2)."""
        model_config = getattr(getattr(self.llm, "llm_engine", None), "model_config", None)
        return getattr(model_config, "logprobs_mode", "raw_logprobs")

    def _warn_once(self, key: str, message: str) -> None:
        if key not in self._warned:
            self._warned.add(key)
            warnings.warn(message, stacklevel=3)

    def _check_log_prob_semantics(self, sampling: SamplingParams) -> None:
        processed = str(self.logprobs_mode).endswith("processed_logprobs")
        if not processed and sampling.temperature not in (0, 1):
            self._warn_once("raw", "this vLLM returns log-probs before temperature; recompute them with the "
                                   f"actor (temperature={sampling.temperature}) or upgrade vLLM to >= 0.10.2")
        filtered = sampling.top_p < 1 or 0 < sampling.top_k
        if processed and filtered and sampling.temperature > 0:
            self._warn_once("filtered", "with top-k/top-p vLLM's log-probs are those of the truncated "
                                        "distribution it samples from, not the full-vocabulary log-softmax")

    def _sampling_params(self, sampling: SamplingParams, seed: int):
        vllm = self.vllm if self.vllm is not None else import_vllm()
        stops = set(sampling.stop_token_ids) | set(self.eos_ids)
        return vllm.SamplingParams(
            n=1, seed=seed, temperature=sampling.temperature, top_p=sampling.top_p,
            top_k=sampling.top_k if sampling.top_k > 0 else -1, max_tokens=sampling.max_new_tokens,
            logprobs=0, stop_token_ids=sorted(stops), detokenize=False)

    def generate(self, prompt_token_ids: list[list[int]], sampling: SamplingParams,
                 prompt_seeds: list[int] | None = None) -> RolloutOutput:
        self._check_log_prob_semantics(sampling)
        if prompt_seeds is None:
            prompt_seeds = [sampling.seed + i for i in range(len(prompt_token_ids))]
        # every rank of a vLLM TP group must submit the same requests
        joint, seeds, (lo, hi) = join_requests(prompt_token_ids, prompt_seeds, self.groups)
        rows = expand_requests(joint, sampling, seeds)
        if not rows:  # e.g. an agent loop's later turn once every trajectory of the group is done
            return pack_output([], [], sampling.max_new_tokens, self.pad_id, {"rollout/generated_tokens": 0})
        prompts = [{"prompt_token_ids": p} for p, _ in rows]
        params = [self._sampling_params(sampling, seed) for _, seed in rows]
        outputs = self.llm.generate(prompts, params, use_tqdm=False) if rows else []
        tokens, log_probs = [], []
        for out in outputs:
            completion = out.outputs[0]
            ids = list(completion.token_ids)
            tokens.append(ids)
            log_probs.append([step[t].logprob for t, step in zip(ids, completion.logprobs or [])])
        tokens, log_probs = tokens[lo * sampling.n:hi * sampling.n], log_probs[lo * sampling.n:hi * sampling.n]
        return pack_output(tokens, log_probs, sampling.max_new_tokens, self.pad_id,
                           {"rollout/generated_tokens": sum(len(t) for t in tokens)})

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]], verify: str = "fingerprint") -> dict:
        """One bucket into the (single, in-process) worker; returns its read-back digests.

        Wakes only the weights of a sleeping engine first (the KV cache stays freed until generate);
        afterwards the prefix cache is reset, since its blocks hold keys/values of the old weights.
        """
        self.wake_up(["weights"])
        tp, tp_rank = (self.groups.tp, self.groups.tp_rank) if self.groups is not None else (1, 0)
        args = (list(weights), self.spec, tp, tp_rank, verify)
        stored = self.llm.collective_rpc(load_weights_on_worker, args=args)[0]
        self.llm.reset_prefix_cache()
        return stored

    def sleep(self) -> None:
        """Level 1: weights to host memory, KV cache discarded."""
        if not self._asleep:
            self.llm.sleep(level=1)
            self._asleep = set(SLEEP_TAGS)

    def wake_up(self, tags: list[str] | None = None) -> None:
        """Wake what is asleep among `tags` (default: weights and KV cache)."""
        todo = [t for t in SLEEP_TAGS if t in self._asleep and (tags is None or t in tags)]
        if todo:
            self.llm.wake_up(tags=todo)
            self._asleep -= set(todo)
