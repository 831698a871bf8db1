"""Per-GPU memory formulas of the layout planner, in bytes, for one rank of a TP x PP (x DP) layout.

Pure arithmetic on an `Arch` (no tensors, no process groups). `hybridrl.planner.plan` combines these
terms into the phases of a hybrid-engine step and decides what fits; this module must not.
Notation: s sequence (prompt + response), b micro batch, h hidden, a heads, g KV heads, d head dim,
f intermediate size, L layers, Vp padded vocab, t TP, e bytes per element of params_dtype; for MoE
models E experts, k experts per token, f_e one expert's intermediate size, ep expert parallel size.

Parameters per rank: attention and MLP split over TP, norms replicated (Qwen3 families add a q and a
k RMSNorm of d each per layer). An MoE layer (every layer of qwen3_moe / mixtral) has instead of the
MLP a router (E·h, replicated) and E/ep experts of 3·h·f_e/t each (expert TP = TP).

Training states, bytes per parameter (Megatron-LM's distributed-optimizer table; bf16 training
accumulates grads in fp32, Adam keeps an fp32 master copy and two fp32 moments):
    bf16/fp16 params:  weights 2 + grads 4 + optimizer 12      distributed optimizer: 12 / dp
    fp32 params:       weights 4 + grads 4 + optimizer 8       distributed optimizer:  8 / dp
Expert parameters exist on their EP rank only; the distributed optimizer shards their states over
the expert-data-parallel group (the dp / ep ranks that hold the same experts), the rest over dp.

Activations per transformer layer and micro batch: the bytes autograd saves for backward, counted
op by op as in Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer
Models" (their GPT layer: s·b·h·(34 + 5·a·s/h) bytes in fp16), applied to this project's megatron
local-spec layer (torch RMSNorm, `models.sdpa_attention`: torch's fused attention, K and V at their
g heads, no scores kept; SwiGLU, no dropout), tensor parallel without sequence parallel:
    replicated   6·s·b·h·e          per RMSNorm: input, normalised, weighted output (= linear input)
    TP-sharded   (2·s·b·(a + g)·d + 5·s·b·f)·e / t
                                    Q, context, K, V; fc1 output (2f), silu(gate), up, product
    q/k norms    3·s·b·d·(a + g)·e / t   (Qwen3) the fused QKV output (a + 2g heads: K is a view of
                                    it), Q's contiguous copy, normalised Q and K
    attention    4·s·b·a / t        the fused kernel's fp32 log-sum-exp per query and head
and once per micro batch, shared by its layers, the additive attention mask b·s²·e (`mask_bytes`).
Long sequences (`SeqSplit`): sequence parallelism divides the replicated terms (norms, residuals, the final
norm, recomputation's layer inputs) by t; context parallelism divides every token-wise term by CP and adds
the other ranks' K and V each layer keeps after the all-gather, 2·s·b·(CP-1)/CP·g·d·e/t; packed rows keep
no mask (per-sequence causal kernels). Packed micro batches are counted at their rows x the padded width,
an upper bound of their real tokens.
megatron's unfused attention (not built here) would save instead K and V expanded to all a heads and
the scores, a·s²·b·(4 + e) / t per layer.
Full recomputation keeps each layer's input (s·b·h·e) and rebuilds one layer at a time in backward.
Final norm: 3·s·b·h·e. Logits: s·b·Vp/t·e for every position, plus the loss side over the R
response positions (`loss_side_bytes`): the log-prob and entropy function works in chunks and
saves per-token statistics only, so its backward holds the logits' gradient (R·b·Vp/t·e, then
s·b·Vp/t·e) and two fp32 chunks. Checked against the bytes autograd saves in a real fp32 CPU step
(tests/test_planner.py: within 3%). Where kernels differ the count is off: a fused RMSNorm saves
only its input (fewer bytes), torch's composite bf16 RMSNorm on CPU adds fp32 copies (about
8·s·b·h bytes more per layer).

An MoE layer replaces the MLP term by the routed one (megatron's MoELayer, allgather dispatcher,
SequentialMLP experts, router in fp32). Each EP rank gathers the s·b·ep tokens of its EP group and
computes its E/ep experts on the copies routed to them, k·s·b per rank on average (balanced
routing; a rank whose experts draw more tokens holds proportionally more):
    routed       k·s·b·(h + 6·f_e / t)·e    the permuted token copies (the experts' fc1 input); per
                                    copy fc1 output (2f_e), silu(gate), up, product, product
                                    scaled by its routing weight (fc2's input)
    routing      s·b·(24·k + 5·E)   fp32 weight and int64 source index per copy, int64 top-k
                                    indices and fp32 top-k softmax per token; the local experts'
                                    routing map (bool) and weights (fp32) over the EP group's tokens
                 + 4·s·b·(E - k)    pre-softmax routing (norm_topk_prob false): softmax over all E
                 + s·b·(4·E + 8·k)  with an aux loss: its own softmax scores and top-k indices
Checked against what autograd saves in a real fp32 MoE step (tests/test_planner_moe.py: the layers
within 1.4% at EP 1 and, averaged over the EP ranks, at EP 2; what is left out is free of h: RoPE's
cos/sin tables, RMSNorm statistics, the mask). Not saved but held while one MoE layer runs
(`dispatch_bytes`, an item of its own in the plan): the EP group's gathered tokens s·b·ep·h·e, the
expert outputs, and the combined output before the reduce-scatter (s·b·ep·h, with an fp32 copy in bf16).
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass

from hybridrl.config import ConfigError, ModelConfig
from hybridrl.models.hf_config import spec_from_hf_config
from hybridrl.models.logprobs import CHUNK_ELEMENTS

GIB = 1024 ** 3
BYTES_PER_ELEMENT = {"float32": 4, "bfloat16": 2, "float16": 2}


@dataclass(frozen=True)
class Arch:
    """The sizes that memory depends on (HF vocabulary); the expert fields are 0 for a dense model."""
    num_layers: int
    hidden_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    """The dense MLP's; unused when every layer is MoE."""
    vocab_size: int
    tie_word_embeddings: bool
    qkv_bias: bool
    qk_norm: bool = False
    """Qwen3 families: an RMSNorm of head_dim over every query and key head."""
    num_experts: int = 0
    moe_topk: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = True
    """Softmax over the top-k logits; False: over all E logits, then the top k (pre-softmax)."""

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    def padded_vocab(self, tp: int) -> int:
        """Megatron pads the vocabulary to a multiple of 128·TP."""
        step = 128 * tp
        return -(-self.vocab_size // step) * step


def arch_from_model_config(model: ModelConfig, vocab_size: int = 0) -> Arch:
    """config.json at model.path when it exists (read by the model builder's own mapping), else the
    model fields (size configs carry the real architecture numbers next to a placeholder path)."""
    cfg_path = os.path.join(model.path, "config.json")
    if model.path and os.path.isfile(cfg_path):
        with open(cfg_path) as f:
            try:
                spec = spec_from_hf_config(json.load(f))
            except ValueError as err:
                raise ConfigError(f"{cfg_path}: {err}") from err
        return Arch(spec.num_layers, spec.hidden_size, spec.num_attention_heads, spec.num_key_value_heads,
                    spec.kv_channels, spec.intermediate_size, spec.vocab_size, spec.tie_word_embeddings,
                    spec.qkv_bias, spec.qk_norm, spec.num_experts, spec.moe_topk, spec.moe_intermediate_size,
                    spec.norm_topk_prob)
    vocab = model.vocab_size or vocab_size
    if vocab <= 0:
        raise ConfigError("model.vocab_size is 0 and no tokenizer size was given; set model.vocab_size "
                          "(or pass the tokenizer's vocab size to the planner)")
    moe = (model.num_experts, model.moe_topk, model.moe_intermediate_size,
           model.norm_topk_prob or model.architecture == "mixtral") if model.is_moe else ()
    return Arch(model.num_layers, model.hidden_size, model.num_attention_heads, model.num_key_value_heads,
                model.head_dim or model.hidden_size // model.num_attention_heads, model.intermediate_size, vocab,
                model.tie_word_embeddings, model.architecture == "qwen2", model.architecture.startswith("qwen3"), *moe)


def layer_params(arch: Arch, tp: int, ep: int = 1) -> int:
    """Parameters of one transformer layer on one TP (and EP) rank: attention and the dense MLP split
    over TP; the norms (q/k norms too) and an MoE layer's router replicated; its E/ep experts."""
    q, kv = arch.num_attention_heads * arch.head_dim, arch.num_key_value_heads * arch.head_dim
    qkv = arch.hidden_size * (q + 2 * kv) + ((q + 2 * kv) if arch.qkv_bias else 0)
    proj = q * arch.hidden_size
    mlp = 0 if arch.is_moe else 3 * arch.hidden_size * arch.intermediate_size
    replicated = 2 * arch.hidden_size + (2 * arch.head_dim if arch.qk_norm else 0)
    router = arch.num_experts * arch.hidden_size
    return (qkv + proj + mlp) // tp + replicated + router + layer_expert_params(arch, tp, ep)


def layer_expert_params(arch: Arch, tp: int, ep: int = 1) -> int:
    """The routed experts of one MoE layer on one rank: E/ep of them, each a fused gate/up (fc1) and a
    down projection (fc2) split over TP (expert TP = TP); 0 for a dense layer."""
    return arch.num_experts // ep * (3 * arch.hidden_size * arch.moe_intermediate_size // tp)


def stage_params(arch: Arch, tp: int, pp: int, stage: int, critic: bool = False, ep: int = 1) -> int:
    """Parameters on one rank of pipeline stage `stage`: its layers, the embedding on the first
    stage, final norm and head on the last (megatron keeps a tied embedding copy there when pp > 1)."""
    n = layer_params(arch, tp, ep) * (arch.num_layers // pp)
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
    """Parameters of the whole (unsharded, unpadded) model, every expert included: what memory holds."""
    embedding = arch.vocab_size * arch.hidden_size
    head = 0 if arch.tie_word_embeddings else embedding
    return layer_params(arch, 1) * arch.num_layers + embedding + head + arch.hidden_size


def active_params(arch: Arch) -> int:
    """Parameters one token passes through: the total less the experts it is not routed to (k of E)."""
    idle = arch.num_experts - arch.moe_topk
    return total_params(arch) - arch.num_layers * idle * 3 * arch.hidden_size * arch.moe_intermediate_size


def training_state_bytes(n_params: int, dtype: str, dp: int, distributed_optimizer: bool) -> dict:
    """weights / grads / optimizer bytes of `n_params` parameters trained with Adam (see module doc)."""
    e = BYTES_PER_ELEMENT[dtype]
    optimizer = n_params * (8 if e == 4 else 12)
    if distributed_optimizer:
        optimizer /= dp
    return {"weights": n_params * e, "grads": n_params * 4, "optimizer": optimizer}


def stage_state_bytes(arch: Arch, tp: int, pp: int, stage: int, dp: int, ep: int, dtype: str,
                      distributed_optimizer: bool, critic: bool = False) -> dict:
    """`training_state_bytes` of one rank of pipeline stage `stage`: the experts' optimizer states shard
    over the expert-data-parallel size dp / ep (the ranks holding the same experts), the rest over dp."""
    experts = layer_expert_params(arch, tp, ep) * (arch.num_layers // pp)
    dense = training_state_bytes(stage_params(arch, tp, pp, stage, critic, ep) - experts, dtype, dp,
                                 distributed_optimizer)
    expert = training_state_bytes(experts, dtype, dp // ep, distributed_optimizer)
    return {kind: dense[kind] + expert[kind] for kind in dense}


@dataclass(frozen=True)
class SeqSplit:
    """How one micro batch's tokens are spread (module doc, "Long sequences")."""
    sp: int = 1
    """TP ranks the norms and residuals split the sequence over (sequence parallelism); 1: off."""
    cp: int = 1
    """Context parallel ranks every token-wise tensor is split over."""
    packed: bool = False
    """Rows packed without padding: no attention mask."""


NO_SPLIT = SeqSplit()


def layer_activation_bytes(arch: Arch, seq: int, micro: int, tp: int, dtype: str, aux_loss: bool = False,
                           split: SeqSplit = NO_SPLIT) -> float:
    """Bytes one transformer layer saves for backward for one micro batch (see module doc)."""
    e = BYTES_PER_ELEMENT[dtype]
    sb = seq * micro / split.cp
    heads = arch.num_attention_heads + arch.num_key_value_heads
    replicated = 6 * sb * arch.hidden_size * e / split.sp
    mlp = 0 if arch.is_moe else 5 * sb * arch.intermediate_size
    sharded = (2 * sb * heads * arch.head_dim + mlp) * e / tp
    if arch.qk_norm:
        sharded += 3 * sb * arch.head_dim * heads * e / tp
    log_sum_exp = 4 * sb * arch.num_attention_heads / tp
    gathered_kv = 2 * sb * (split.cp - 1) * arch.num_key_value_heads * arch.head_dim * e / tp
    routed = routed_activation_bytes(arch, seq // split.cp, micro, tp, dtype, aux_loss)
    return replicated + sharded + log_sum_exp + gathered_kv + routed


def mask_bytes(seq: int, micro: int, dtype: str, split: SeqSplit = NO_SPLIT) -> float:
    """The additive attention mask of one micro batch, kept once for all its layers (module doc); none
    for packed rows (per-sequence causal kernels)."""
    return 0.0 if split.packed or split.cp > 1 else micro * seq * seq * BYTES_PER_ELEMENT[dtype]


def routed_activation_bytes(arch: Arch, seq: int, micro: int, tp: int, dtype: str, aux_loss: bool = False) -> float:
    """What an MoE layer saves for backward in place of the dense MLP, on one rank for balanced
    routing (module doc: routed + routing); 0 for a dense layer."""
    if not arch.is_moe:
        return 0.0
    e, sb, k, n = BYTES_PER_ELEMENT[dtype], seq * micro, arch.moe_topk, arch.num_experts
    routed = k * sb * (arch.hidden_size + 6 * arch.moe_intermediate_size / tp) * e
    routing = sb * (24 * k + 5 * n) + (0 if arch.norm_topk_prob else 4 * sb * (n - k))
    return routed + routing + (sb * (4 * n + 8 * k) if aux_loss else 0)


def stage_activation_bytes(arch: Arch, seq: int, micro: int, tp: int, pp: int, in_flight: int,
                           recompute: bool, dtype: str, aux_loss: bool = False, split: SeqSplit = NO_SPLIT) -> float:
    """Saved activations of one stage's layers with `in_flight` micro batches held by the 1F1B
    schedule (stage r holds min(pp - r, micro batches)), each with its attention mask; with full
    recompute only layer inputs stay, plus one layer (and its mask) rebuilt at a time in backward."""
    e = BYTES_PER_ELEMENT[dtype]
    layers = arch.num_layers // pp
    one_layer = layer_activation_bytes(arch, seq, micro, tp, dtype, aux_loss, split)
    mask = mask_bytes(seq, micro, dtype, split)
    if recompute:
        inputs = seq * micro * arch.hidden_size * e / (split.sp * split.cp)
        return layers * in_flight * inputs + one_layer + mask
    return in_flight * (layers * one_layer + mask)


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
                          response: int = 0, split: SeqSplit = NO_SPLIT) -> float:
    """Last stage of an update: the final norm's saved tensors, plus for the actor the logits of every
    position (kept for the log-prob backward) and the loss side over `response` positions; under context
    parallelism each rank holds its share of the positions."""
    e = BYTES_PER_ELEMENT[dtype]
    norm = 3 * seq * micro * arch.hidden_size * e / (split.sp * split.cp)
    if critic:
        return norm
    seq, response = -(-seq // split.cp), -(-response // split.cp)
    logits = seq * micro * arch.padded_vocab(tp) / tp * e
    return norm + logits + loss_side_bytes(arch, seq, response, micro, tp, dtype, True)


def forward_bytes(arch: Arch, seq: int, micro: int, tp: int, dtype: str, last_stage: bool = True,
                  scalar_head: bool = False, response: int = 0, ep: int = 1) -> float:
    """Working memory of a forward without grad (log-probs, values; scores with a scalar head; the
    engine's prefill with response 0): nothing is saved for backward, so a layer holds at most its
    input plus its widest intermediates (the MLP's fused gate/up output and the activation of it, or
    attention's q/k/v and output; an MoE layer's normalised and permuted tokens and its dispatch
    buffers), plus on the last pipeline stage the final norm's tensors, the logits and, over
    `response` positions, the log-prob (and entropy) working set."""
    e, sb, h = BYTES_PER_ELEMENT[dtype], seq * micro, arch.hidden_size
    q, kv = arch.num_attention_heads * arch.head_dim, arch.num_key_value_heads * arch.head_dim
    widest = sb * max(3 * arch.intermediate_size, 2 * q + 2 * kv) / tp * e
    if arch.is_moe:
        moe = (1 + arch.moe_topk) * sb * h * e + dispatch_bytes(arch, seq, micro, tp, ep, dtype)
        widest = max(sb * (2 * q + 2 * kv) / tp * e, moe)
    head = 0.0
    if last_stage:
        head = 3 * sb * h * e
        if not scalar_head:
            head += sb * arch.padded_vocab(tp) / tp * e
            head += loss_side_bytes(arch, seq, response, micro, tp, dtype, False) if response else 0.0
    return sb * h * e + widest + head


def dispatch_bytes(arch: Arch, seq: int, micro: int, tp: int, ep: int, dtype: str) -> float:
    """Buffers of one MoE layer's dispatch and combine that are never saved (one layer at a time;
    backward's gradients of them are as large): at EP > 1 the EP group's gathered tokens (megatron's
    global buffer), routing weights and map; the local tokens' routing weights and map; then the
    largest of: the expert outputs as a list beside one expert's fc1 / activation outputs (k·s·b·ep/E
    tokens each when balanced), the list and its concatenation, the concatenation and the EP group's
    combined output, and (EP > 1) that output with its fp32 copy for the reduce-scatter and the
    result. 0 for a dense model."""
    if not arch.is_moe:
        return 0.0
    e, sb, h, k, n = BYTES_PER_ELEMENT[dtype], seq * micro, arch.hidden_size, arch.moe_topk, arch.num_experts
    gathered = sb * ep * (h * e + 5 * n) if ep > 1 else 0.0
    outputs = k * sb * h * e
    one_expert = k * sb * ep / n * 5 * arch.moe_intermediate_size / tp * e
    combined = sb * ep * h * e
    reduce_scatter = (combined + (sb * ep * h * 4 if e < 4 else 0) + sb * h * 4) if ep > 1 else 0.0
    return gathered + 5 * sb * n + max(outputs + one_expert, 2 * outputs, outputs + combined, reduce_scatter)


def largest_tensor_params(arch: Arch, tp: int) -> int:
    """Elements of the largest full (TP-merged) megatron tensor: the padded embedding / head, fused
    QKV, fused gate/up or down projection (of one expert in an MoE layer), or the router; the weight
    stream's working set holds one of them."""
    q, kv = arch.num_attention_heads * arch.head_dim, arch.num_key_value_heads * arch.head_dim
    h = arch.hidden_size
    f = arch.moe_intermediate_size if arch.is_moe else arch.intermediate_size
    return max(arch.padded_vocab(tp) * h, (q + 2 * kv) * h, 2 * f * h, arch.num_experts * h)


def kv_bytes_per_token(arch: Arch, tp: int, pp: int, dtype: str) -> float:
    """K and V of one token over the layers of one rank; KV heads are split over TP (replicated
    when TP exceeds them, as vLLM does)."""
    e = BYTES_PER_ELEMENT[dtype]
    kv_heads = max(arch.num_key_value_heads // tp, 1)
    return 2 * (arch.num_layers // pp) * kv_heads * arch.head_dim * e
