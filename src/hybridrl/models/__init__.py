"""Models: megatron-core GPT (actor/ref), critic, HF <-> megatron conversion, vocab-parallel log-probs.

Submodules: gpt (GPTSpec, build_gpt), hf_config (HF config -> GPTSpec), hf_convert (pure name/layout
mapping, TP split/merge), hf_checkpoint (safetensors load/export), mcore_checkpoint (per-rank
megatron folders), critic, logprobs, forward (pipeline-schedule forward at any TP/PP).

Models stand on parallel only (and megatron-core, transformers' config names); they must not import
the config tree, workers, rollout or the trainer: parallelism and roles are applied from outside.
"""
from hybridrl.models.critic import build_critic, critic_from_hf
from hybridrl.models.forward import causal_padding_mask, pipeline_forward
from hybridrl.models.gpt import GPTSpec, build_gpt
from hybridrl.models.hf_checkpoint import (CheckpointMismatchError, load_hf_into_mcore, mcore_to_hf_stream,
                                           model_from_hf, random_hf_model_folder, save_hf)
from hybridrl.models.hf_config import UnsupportedConfigError, spec_from_hf_config
from hybridrl.models.logprobs import shifted_log_probs, vocab_parallel_entropy, vocab_parallel_log_probs

__all__ = ["GPTSpec", "build_gpt", "build_critic", "critic_from_hf", "causal_padding_mask", "pipeline_forward",
           "CheckpointMismatchError", "load_hf_into_mcore", "mcore_to_hf_stream", "model_from_hf",
           "random_hf_model_folder", "save_hf", "UnsupportedConfigError", "spec_from_hf_config",
           "shifted_log_probs", "vocab_parallel_entropy", "vocab_parallel_log_probs"]
