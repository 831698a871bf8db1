"""Per-GPU memory formulas of the layout planner, in bytes, for one rank of a TP x PP (x DP) layout.

Pure arithmetic on an `Arch` (no tensors, no process groups). `hybridrl.planner.plan` combines these
terms into the phases of a hybrid-engine step and decides what fits; this module must not.
Notation: s sequence (prompt + response), b micro batch, h hidden, a heads, g KV heads, d head dim,
f intermediate size, L layers, Vp padded vocab, t TP, e bytes per element of params_dtype.

Training states, bytes per parameter (Megatron-LM's distributed-optimizer table; bf16 training
accumulates grads in fp32, Adam keeps an fp32 master copy and two fp32 moments):
    bf16/fp16 params:  weights 2 + grads 4 + optimizer 12      distributed optimizer: 12 / dp
    fp32 params:       weights 4 + grads 4 + optimizer 8       distributed optimizer:  8 / dp

Activations per transformer layer and micro batch: the bytes autograd saves for backward, counted
op by op as in Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer
Models" (their GPT layer: s·b·h·(34 + 5·a·s/h) bytes in fp16), applied to this project's megatron
local-spec layer (torch RMSNorm, unfused attention with K/V expanded to all heads, SwiGLU, no
dropout), tensor parallel without sequence parallel:
    replicated   6·s·b·h·e          per RMSNorm: input, normalised, weighted output (= linear input)
    TP-sharded   (4·s·b·a·d + 5·s·b·f)·e / t
                                    Q, K, V, context; fc1 output (2f), silu(gate), up, product
    scores       a·s²·b·(4 + e) / t fp32 softmax output + its e-byte copy for the value matmul
                                    (one fp32 tensor when e = 4)
Full recomputation keeps each layer's input (s·b·h·e) and rebuilds one layer at a time in backward.
Final norm: 3·s·b·h·e. Logits: s·b·Vp/t·e for every position, plus the loss side over the R
response positions (`loss_side_bytes`): the log-prob and entropy function works in chunks and
saves per-token statistics only, so its backward holds the logits' gradient (R·b·Vp/t·e, then
s·b·Vp/t·e) and two fp32 chunks. Checked against the bytes autograd saves in a real fp32 CPU step
(tests/test_planner.py: within 3%). Where kernels differ the count is off: a fused RMSNorm saves
only its input (fewer bytes), torch's composite bf16 RMSNorm on CPU adds fp32 copies (~7% more in
total), flash attention drops the scores term (much less at long sequences).
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass

from hybridrl.config import ConfigError, ModelConfig
from hybridrl.models.logprobs import CHUNK_ELEMENTS

GIB = 1024 ** 3
BYTES_PER_ELEMENT = {"float32": 4, "bfloat16": 2, "float16": 2}


@dataclass(frozen=True)
class Arch:
    """The sizes that memory depends on (HF vocabulary)."""
    num_layers: int
    hidden_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    tie_word_embeddings: bool
    qkv_bias: bool

    def padded_vocab(self, tp: int) -> int:
        """Megatron pads the vocabulary to a multiple of 128·TP."""
        step = 128 * tp
        return -(-self.vocab_size // step) * step


def arch_from_model_config(model: ModelConfig, vocab_size: int = 0) -> Arch:
    """config.json at model.path when it exists, else the model fields (size configs carry the real
    architecture numbers next to a placeholder path)."""
    cfg_path = os.path.join(model.path, "config.json")
    if model.path and os.path.isfile(cfg_path):
        with open(cfg_path) as f:
            hf = json.load(f)
        heads = hf["num_attention_heads"]
        return Arch(hf["num_hidden_layers"], hf["hidden_size"], heads, hf.get("num_key_value_heads") or heads,
                    hf.get("head_dim") or hf["hidden_size"] // heads, hf["intermediate_size"], hf["vocab_size"],
                    bool(hf.get("tie_word_embeddings", False)), hf.get("model_type") == "qwen2")
    vocab = model.vocab_size or vocab_size
    if vocab <= 0:
        raise ConfigError("model.vocab_size is 0 and no tokenizer size was given; set model.vocab_size "
                          "(or pass the tokenizer's vocab size to the planner)")
    return Arch(model.num_layers, model.hidden_size, model.num_attention_heads, model.num_key_value_heads,
                model.hidden_size // model.num_attention_heads, model.intermediate_size, vocab,
                model.tie_word_embeddings, model.architecture == "qwen2")


def layer_params(arch: Arch, tp: int) -> int:
    """Parameters of one transformer layer on one TP rank."""
    q, kv = arch.num_attention_heads * arch.head_dim, arch.num_key_value_heads * arch.head_dim
    qkv = arch.hidden_size * (q + 2 * kv) + ((q + 2 * kv) if arch.qkv_bias else 0)
    proj = q * arch.hidden_size
    mlp = 3 * arch.hidden_size * arch.intermediate_size
    return (qkv + proj + mlp) // tp + 2 * arch.hidden_size  # the two RMSNorm weights are replicated


def stage_params(arch: Arch, tp: int, pp: int, stage: int, critic: bool = False) -> int:
    """Parameters on one rank of pipeline stage `stage`: its layers, the embedding on the first
    stage, final norm and head on the last (megatron keeps a tied embedding copy there when pp > 1)."""
    n = layer_params(arch, tp) * (arch.num_layers // pp)
    embedding = arch.padded_vocab(tp) * arch.hidden_size // tp
    if stage == 0:
        n += embedding
    if stage == pp - 1:
        n += arch.hidden_size
        if critic:
            n += arch.hidden_size + 1  # value head h -> 1
        elif not arch.tie_word_embeddings or pp > 1:
            n += embedding
    return n


def total_params(arch: Arch) -> int:
    """Parameters of the whole (unsharded, unpadded) model, for the rollout engine's copy."""
    embedding = arch.vocab_size * arch.hidden_size
    head = 0 if arch.tie_word_embeddings else embedding
    return layer_params(arch, 1) * arch.num_layers + embedding + head + arch.hidden_size


def training_state_bytes(n_params: int, dtype: str, dp: int, distributed_optimizer: bool) -> dict:
    """weights / grads / optimizer bytes of `n_params` parameters trained with Adam (see module doc)."""
    e = BYTES_PER_ELEMENT[dtype]
    optimizer = n_params * (8 if e == 4 else 12)
    if distributed_optimizer:
        optimizer /= dp
    return {"weights": n_params * e, "grads": n_params * 4, "optimizer": optimizer}


def layer_activation_bytes(arch: Arch, seq: int, micro: int, tp: int, dtype: str) -> float:
    """Bytes one transformer layer saves for backward for one micro batch (see module doc)."""
    e = BYTES_PER_ELEMENT[dtype]
    sb = seq * micro
    q = arch.num_attention_heads * arch.head_dim
    replicated = 6 * sb * arch.hidden_size * e
    sharded = (4 * sb * q + 5 * sb * arch.intermediate_size) * e / tp
    score_bytes = 4 if e == 4 else 4 + e
    scores = arch.num_attention_heads * seq * sb * score_bytes / tp
    return replicated + sharded + scores


def stage_activation_bytes(arch: Arch, seq: int, micro: int, tp: int, pp: int, in_flight: int,
                           recompute: bool, dtype: str) -> float:
    """Saved activations of one stage's layers with `in_flight` micro batches held by the 1F1B
    schedule (stage r holds min(pp - r, micro batches)); with full recompute only layer inputs stay,
    plus one layer rebuilt at a time during backward."""
    e = BYTES_PER_ELEMENT[dtype]
    layers = arch.num_layers // pp
    one_layer = layer_activation_bytes(arch, seq, micro, tp, dtype)
    if recompute:
        return layers * in_flight * seq * micro * arch.hidden_size * e + one_layer
    return layers * in_flight * one_layer


def loss_side_bytes(arch: Arch, seq: int, response: int, micro: int, tp: int, dtype: str, grad: bool) -> float:
    """What the fused log-prob / entropy function (`models.logprobs`) adds to the logits over
    `response` positions: two fp32 temporaries of one chunk while it runs; with grad, in backward,
    the gradient of the response logits (e bytes) next to the larger of those temporaries and the
    gradient of all `seq` positions it is then scattered into."""
    v = arch.padded_vocab(tp) / tp
    chunk = 2 * min(CHUNK_ELEMENTS, response * micro * v) * 4
    if not grad:
        return chunk
    e = BYTES_PER_ELEMENT[dtype]
    return response * micro * v * e + max(chunk, seq * micro * v * e)


def head_activation_bytes(arch: Arch, seq: int, micro: int, tp: int, dtype: str, critic: bool = False,
                          response: int = 0) -> float:
    """Last stage of an update: the final norm's saved tensors, plus for the actor the logits of every
    position (kept for the log-prob backward) and the loss side over `response` positions."""
    e = BYTES_PER_ELEMENT[dtype]
    norm = 3 * seq * micro * arch.hidden_size * e
    if critic:
        return norm
    logits = seq * micro * arch.padded_vocab(tp) / tp * e
    return norm + logits + loss_side_bytes(arch, seq, response, micro, tp, dtype, True)


def forward_bytes(arch: Arch, seq: int, micro: int, tp: int, dtype: str, last_stage: bool = True,
                  scalar_head: bool = False, response: int = 0) -> float:
    """Working memory of a forward without grad (log-probs, values; scores with a scalar head; the
    engine's prefill with response 0): nothing is saved for backward, so a layer holds at most its
    input plus its widest intermediates (the MLP's fused gate/up output and the activation of it, or
    attention's q/k/v and output), plus on the last pipeline stage the final norm's tensors, the
    logits and, over `response` positions, the log-prob (and entropy) working set."""
    e, sb = BYTES_PER_ELEMENT[dtype], seq * micro
    q, kv = arch.num_attention_heads * arch.head_dim, arch.num_key_value_heads * arch.head_dim
    widest = max(3 * arch.intermediate_size, 2 * q + 2 * kv) / tp
    head = 0.0
    if last_stage:
        head = 3 * sb * arch.hidden_size * e
        if not scalar_head:
            head += sb * arch.padded_vocab(tp) / tp * e
            head += loss_side_bytes(arch, seq, response, micro, tp, dtype, False) if response else 0.0
    return sb * (arch.hidden_size + widest) * e + head


def largest_tensor_params(arch: Arch, tp: int) -> int:
    """Elements of the largest full (TP-merged) megatron tensor: the padded embedding / head, fused
    QKV, fused gate/up or down projection; the weight stream's working set holds one of them."""
    q, kv = arch.num_attention_heads * arch.head_dim, arch.num_key_value_heads * arch.head_dim
    h, f = arch.hidden_size, arch.intermediate_size
    return max(arch.padded_vocab(tp) * h, (q + 2 * kv) * h, 2 * f * h)


def kv_bytes_per_token(arch: Arch, tp: int, pp: int, dtype: str) -> float:
    """K and V of one token over the layers of one rank; KV heads are split over TP (replicated
    when TP exceeds them, as vLLM does)."""
    e = BYTES_PER_ELEMENT[dtype]
    kv_heads = max(arch.num_key_value_heads // tp, 1)
    return 2 * (arch.num_layers // pp) * kv_heads * arch.head_dim * e
