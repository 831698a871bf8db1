"""A lean forward for decoding over a megatron-core GPTModel's own weight tensors (its rollout-TP shard).

What megatron's static inference path costs per step and this one does not: re-rotating every cached
key, repeating K/V over the query heads, copying through its cache wrappers, logits of every prompt
position. Here, per generate call, one zeroed KV cache `[layers, 2, slots, kv_groups, length, dim]`
and the rotary cos/sin of positions [0, length) are made once (`DecodeCache`); per layer and step:
RMSNorm, the fused column-parallel QKV, rotary on the new query and key only, the key and value
written in place at each row's own position, attention on the unrepeated cache (SDPA with
`enable_gqa=True` in prefill, three batched matmul-class calls per step in decode), the row-parallel
output projection and one all-reduce (at TP 1 the residual add rides in the projection's addmm),
RMSNorm, fused gate/up, down projection and one all-reduce. Logits are computed for the last position only and gathered over rollout TP.
Qwen3's per-head q/k RMSNorm runs between the projection and the rotary embedding. An MoE layer
(expert parallel size 1: every expert local) routes as megatron's TopKRouter does (fp32 logits,
softmax then top-k, or top-k then softmax over the k) and runs each expert only on the tokens routed
to it (one host sync per layer for the counts, hence no CUDA graphs for MoE models); the experts'
row-parallel partial sums share one all-reduce. A caller that passes `routes=[]` gets each MoE
layer's chosen expert ids appended (megatron's `top_indices`, [tokens, topk]).

Weights are read, never written: `LeanGPT` holds references to the model's parameters (filled by
`NativeEngine.load_weights`, or aliases of the actor's own tensors after `NativeEngine.share_shards`),
so it must be rebuilt after the parameters are replaced, not after their values change (the engine
builds one per generate call). No scheduling here (`continuous_batching.py`), no torch.distributed
(`parallel/tp_collectives.py`).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from hybridrl.parallel.tp_collectives import all_gather_last_dim, all_reduce_


@dataclass(frozen=True)
class MoEWeights:
    """An MoE layer: the replicated router [E, H] and every expert's fc1 [H, 2F/tp] / fc2 [F/tp, H]."""
    router: torch.Tensor
    fc1: tuple
    fc2: tuple
    topk: int
    pre_softmax: bool
    """megatron's moe_router_pre_softmax: softmax over all experts, then top-k (no renormalisation)."""


@dataclass(frozen=True)
class LayerWeights:
    """One transformer layer's local shards (column-parallel qkv/fc1, row-parallel proj/fc2).

    The matrices are held transposed ([in, out] views of megatron's [out, in] parameters), so a
    projection is one `mm` / `addmm` with no per-call transpose. An MoE layer has `moe` and no fc1/fc2.
    """
    input_norm: torch.Tensor
    qkv: torch.Tensor
    qkv_bias: torch.Tensor | None
    proj: torch.Tensor
    mlp_norm: torch.Tensor
    fc1: torch.Tensor | None
    fc2: torch.Tensor | None
    q_norm: torch.Tensor | None = None
    k_norm: torch.Tensor | None = None
    moe: MoEWeights | None = None


def _norm_weight(norm, fused_linear) -> torch.Tensor:
    """A norm's weight: its own module (local spec) or fused into the next linear (TE spec)."""
    weight = getattr(norm, "weight", None)
    return weight if weight is not None else fused_linear.layer_norm_weight


def moe_weights(mlp, config) -> MoEWeights:
    """The router and experts of a megatron MoELayer (SequentialMLP or TE's grouped experts)."""
    experts = mlp.experts
    if hasattr(experts, "local_experts"):
        fc1 = [e.linear_fc1.weight for e in experts.local_experts]
        fc2 = [e.linear_fc2.weight for e in experts.local_experts]
    else:  # TEGroupedMLP keeps expert e as weight<e> of one grouped linear
        fc1 = [getattr(experts.linear_fc1, f"weight{e}") for e in range(experts.num_local_experts)]
        fc2 = [getattr(experts.linear_fc2, f"weight{e}") for e in range(experts.num_local_experts)]
    if len(fc1) != config.num_moe_experts:
        raise ValueError(f"the lean decode path needs every expert local (expert parallel size 1), "
                         f"this layer holds {len(fc1)} of {config.num_moe_experts}")
    return MoEWeights(mlp.router.weight, tuple(w.t() for w in fc1), tuple(w.t() for w in fc2),
                      config.moe_router_topk, config.moe_router_pre_softmax)


def layer_weights(layer) -> LayerWeights:
    attn, mlp, config = layer.self_attention, layer.mlp, layer.config
    bias = getattr(attn.linear_qkv, "bias", None)
    bias = bias if bias is not None and bias.numel() else None  # TE keeps an empty tensor for "no bias"
    q_norm, k_norm = (attn.q_layernorm.weight, attn.k_layernorm.weight) if config.qk_layernorm else (None, None)
    common = dict(input_norm=_norm_weight(layer.input_layernorm, attn.linear_qkv), qkv=attn.linear_qkv.weight.t(),
                  qkv_bias=bias, proj=attn.linear_proj.weight.t(), q_norm=q_norm, k_norm=k_norm)
    if config.num_moe_experts:
        return LayerWeights(mlp_norm=layer.pre_mlp_layernorm.weight, fc1=None, fc2=None,
                            moe=moe_weights(mlp, config), **common)
    return LayerWeights(mlp_norm=_norm_weight(layer.pre_mlp_layernorm, mlp.linear_fc1),
                        fc1=mlp.linear_fc1.weight.t(), fc2=mlp.linear_fc2.weight.t(), **common)


def _matmul(x: torch.Tensor, weight_t: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., in] @ weight_t [in, out] (+ bias): a linear layer on a transposed weight."""
    flat = x if x.dim() == 2 else x.reshape(-1, x.shape[-1])
    out = torch.mm(flat, weight_t) if bias is None else torch.addmm(bias, flat, weight_t)
    return out if x.dim() == 2 else out.view(*x.shape[:-1], weight_t.shape[1])


def route(h: torch.Tensor, m: MoEWeights) -> tuple[torch.Tensor, torch.Tensor]:
    """(expert ids [N, k], routing weights [N, k] fp32) of tokens h [N, H], as megatron's TopKRouter with
    fp32 router logits and the softmax score function; ids in descending score order."""
    logits = torch.mm(h.float(), m.router.t().float())
    if m.pre_softmax:
        probs, top = torch.softmax(logits, dim=-1).topk(m.topk, dim=-1)
        return top, probs
    scores, top = logits.topk(m.topk, dim=-1)
    return top, torch.softmax(scores, dim=-1)


def _check_supported(config) -> None:
    unsupported = {"rotary_interleaved": config.rotary_interleaved,
                   "add_bias_linear": config.add_bias_linear, "gated_linear_unit": not config.gated_linear_unit,
                   "normalization": config.normalization != "RMSNorm"}
    if config.num_moe_experts:  # the router options the lean routing does not reproduce
        unsupported.update({
            "moe_router_score_function": config.moe_router_score_function != "softmax",
            "moe_shared_expert_intermediate_size": config.moe_shared_expert_intermediate_size,
            "moe_router_topk_scaling_factor": config.moe_router_topk_scaling_factor,
            "moe_router_num_groups": config.moe_router_num_groups,
            "moe_router_enable_expert_bias": config.moe_router_enable_expert_bias,
            "moe_router_load_balancing_type": config.moe_router_load_balancing_type == "sinkhorn",
            "moe_input_jitter_eps": config.moe_input_jitter_eps})
    bad = [name for name, on in unsupported.items() if on]
    if bad:
        raise ValueError(f"the lean decode path supports Qwen2/Qwen3/Llama/Mixtral-shaped models only, not "
                         f"{bad}; use NativeEngine(decode='megatron')")


class DecodeCache:
    """What one generate call allocates once: the KV cache and the per-position rotary tables."""

    def __init__(self, lean: "LeanGPT", slots: int, length: int):
        self.slots, self.length = slots, length
        # zeros, not empty: a masked key still meets its value in the softmax @ V product (0 * NaN)
        self.kv = torch.zeros(len(lean.layers), 2, slots, lean.groups_per_rank, length, lean.dim,
                              dtype=lean.dtype, device=lean.device)
        self.keys, self.values = list(self.kv[:, 0].unbind(0)), list(self.kv[:, 1].unbind(0))  # per layer
        # the same storage as rows of one D-vector each, so a decode step writes its keys with one
        # index_copy_ per layer (advanced-index assignment costs several times more per call)
        self.key_rows = [k.view(-1, lean.dim) for k in self.keys]
        self.value_rows = [v.view(-1, lean.dim) for v in self.values]
        groups = torch.arange(lean.groups_per_rank, device=lean.device)
        self.row_base = (torch.arange(slots, device=lean.device)[:, None] * lean.groups_per_rank + groups) * length
        """[slots, groups]: the row of (slot, group, position 0) in key_rows / value_rows."""
        self.cos, self.sin = lean.rotary_tables(length)
        self.positions = torch.arange(length, device=lean.device)

    def write_rows(self, pos: torch.Tensor) -> torch.Tensor:
        """[n * groups]: where slots 0..n-1 (at positions pos [n]) write their new key / value rows."""
        return (self.row_base[:pos.shape[0]] + pos[:, None]).view(-1)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor) -> torch.Tensor:
    """RoPE, rotate-half form: x*cos + rotate_half(x)*sin == x*cos + roll(x, D/2)*sin_signed."""
    half = x.shape[-1] // 2  # rolling by D/2 swaps the halves: one flip of a [.., 2, D/2] view
    swapped = x.unflatten(-1, (2, half)).flip(-2).flatten(-2)
    return torch.addcmul(x * cos, swapped, sin_signed)


class LeanGPT:
    """Prefill and decode steps over a built megatron GPTModel (pipeline size 1) at rollout TP."""

    def __init__(self, model, spec, groups):
        config = model.config
        _check_supported(config)
        self.layers = [layer_weights(layer) for layer in model.decoder.layers]
        self.embedding = model.embedding.word_embeddings.weight
        self.output = (model.shared_embedding_or_output_weight() if model.share_embeddings_and_output_weights
                       else model.output_layer.weight).t()
        self.final_norm = model.decoder.final_layernorm.weight
        self.rotary = model.rotary_pos_emb
        self.tp, self.tp_group = groups.tp, groups.tp_group
        self.groups_per_rank = spec.num_key_value_heads // groups.tp
        self.rep = spec.num_attention_heads // spec.num_key_value_heads  # query heads per K/V group
        self.heads, self.dim = self.groups_per_rank * self.rep, spec.kv_channels
        self.scale = config.softmax_scale or self.dim ** -0.5
        self.eps, self.hidden, self.vocab = config.layernorm_epsilon, spec.hidden_size, spec.vocab_size
        self.vocab_start = groups.tp_rank * self.embedding.shape[0]
        self.device, self.dtype = self.embedding.device, self.embedding.dtype
        self.moe_layers = sum(w.moe is not None for w in self.layers)
        self.topk = config.moe_router_topk if self.moe_layers else 0
        """MoE layers and experts per token: the shape [.., moe_layers, topk] of recorded routes."""

    def rotary_tables(self, length: int):
        """(cos, sin_signed) [length, dim] in the weight dtype, from the model's own RotaryEmbedding."""
        freqs = self.rotary(length).reshape(length, -1).float()
        if freqs.shape[-1] != self.dim:
            raise ValueError(f"rotary over {freqs.shape[-1]} of {self.dim} channels is not supported")
        cos, sin = freqs.cos().to(self.dtype), freqs.sin().to(self.dtype)
        half = self.dim // 2
        return cos, torch.cat([-sin[:, :half], sin[:, half:]], dim=-1)

    # ---- pieces shared by prefill and decode -------------------------------------------------------

    def _norm(self, x, weight):
        return F.rms_norm(x, (self.hidden,), weight, self.eps)

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        if self.tp == 1:
            return F.embedding(tokens, self.embedding)
        local = tokens - self.vocab_start  # vocab-parallel: rows outside this shard come from its peers
        outside = (local < 0) | (local >= self.embedding.shape[0])
        x = F.embedding(local.masked_fill(outside, 0), self.embedding).masked_fill_(outside[..., None], 0.0)
        return all_reduce_(x, self.tp_group, self.tp)

    def _qkv(self, w: LayerWeights, x, cos, sin):
        """x [*lead, H] -> rotated q [*lead, groups, rep, D] (query heads by K/V group), rotated k and
        v [*lead, groups, D]."""
        lead = x.shape[:-1]
        qkv = _matmul(self._norm(x, w.input_norm), w.qkv, w.qkv_bias)
        qkv = qkv.view(*lead, self.groups_per_rank, self.rep + 2, self.dim)  # per group: [q heads; k; v]
        if w.q_norm is None:
            qk = _rotate(qkv[..., :self.rep + 1, :], cos, sin)
            q, k = qk[..., :self.rep, :], qk[..., self.rep, :]
        else:  # per-head RMSNorm before RoPE, each with its own weight (as megatron's q/k_layernorm)
            q = _rotate(F.rms_norm(qkv[..., :self.rep, :], (self.dim,), w.q_norm, self.eps), cos, sin)
            k = _rotate(F.rms_norm(qkv[..., self.rep, :], (self.dim,), w.k_norm, self.eps), cos[..., 0, :],
                        sin[..., 0, :])
        return q, k, qkv[..., -1, :]

    def _finish_layer(self, w: LayerWeights, x, attn, routes: list | None = None):
        """x + proj(attn), then the MLP half; one all-reduce per half (row-parallel partial sums)."""
        x = self._residual(x, attn, w.proj)
        h = self._norm(x, w.mlp_norm)
        if w.moe is not None:
            return x.add_(all_reduce_(self._experts(w.moe, h, routes), self.tp_group, self.tp))
        gate, up = _matmul(h, w.fc1).chunk(2, dim=-1)
        return self._residual(x, F.silu(gate).mul_(up), w.fc2)

    def _residual(self, x, a, weight_t):
        """x + a @ weight_t: one addmm at TP 1 (no separate add over the hidden states); at TP > 1 the
        row-parallel partial product is all-reduced before the add."""
        if self.tp == 1:
            return torch.addmm(x.view(-1, x.shape[-1]), a.reshape(-1, a.shape[-1]), weight_t).view_as(x)
        return x.add_(all_reduce_(_matmul(a, weight_t), self.tp_group, self.tp))

    def _experts(self, m: MoEWeights, h, routes: list | None):
        """This rank's partial sum of sum_k prob_k * expert_k(h) for h [*lead, H] (before the all-reduce)."""
        flat = h.reshape(-1, h.shape[-1])
        top, probs = route(flat, m)
        if routes is not None:
            routes.append(top)
        # the (token, k) assignments grouped by expert: each expert sees only its own tokens
        order = top.reshape(-1).argsort(stable=True)
        counts = torch.bincount(top.reshape(-1), minlength=len(m.fc1)).tolist()  # one host sync per layer
        token, prob = order // m.topk, probs.reshape(-1)[order]
        out, start = torch.zeros_like(flat), 0
        for e, count in enumerate(counts):
            if count:
                rows = token[start:start + count]
                gate, up = _matmul(flat.index_select(0, rows), m.fc1[e]).chunk(2, dim=-1)
                # megatron scales the activation by the fp32 routing weight, back in the model dtype
                act = (F.silu(gate).mul_(up) * prob[start:start + count, None]).to(flat.dtype)
                out.index_add_(0, rows, _matmul(act, m.fc2[e]))
            start += count
        return out.view_as(h)

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        """[n, H] last hidden states -> [n, V] fp32 logits over the true vocabulary."""
        local = _matmul(self._norm(x, self.final_norm), self.output)
        return all_gather_last_dim(local, self.tp_group, self.tp)[:, :self.vocab].float()

    # ---- the two forwards --------------------------------------------------------------------------

    @torch.no_grad()
    def prefill(self, cache: DecodeCache, slots: torch.Tensor, tokens: torch.Tensor,
                last: torch.Tensor, routes: list | None = None) -> torch.Tensor:
        """New prompts [k, P] (right-padded) into cache slots [k]; logits [k, V] at positions `last` [k].
        routes: a list to which each MoE layer appends its expert ids [k * P, topk] (row-major).

        Causal attention within each prompt is exact for its real positions; the pads' keys land
        beyond each prompt's end, where decoding overwrites them before any query can see them.
        """
        k, length = tokens.shape
        x = self.embed(tokens)
        cos, sin = cache.cos[:length, None, None], cache.sin[:length, None, None]
        for i, w in enumerate(self.layers):
            q, key, value = self._qkv(w, x, cos, sin)
            q = q.reshape(k, length, self.heads, self.dim)
            key, value = key.transpose(1, 2), value.transpose(1, 2)  # [k, groups, P, D]
            cache.keys[i][slots, :, :length] = key
            cache.values[i][slots, :, :length] = value
            attn = F.scaled_dot_product_attention(q.transpose(1, 2), key, value, is_causal=True,
                                                  scale=self.scale, enable_gqa=True)
            x = self._finish_layer(w, x, attn.transpose(1, 2).reshape(k, length, self.heads * self.dim), routes)
        return self.logits(x[torch.arange(k, device=x.device), last])

    @torch.no_grad()
    def decode(self, cache: DecodeCache, tokens: torch.Tensor, pos: torch.Tensor, length: int,
               masked: bool = True, routes: list | None = None) -> torch.Tensor:
        """One token per slot 0..n-1 (`tokens`, `pos` [n]); keys [0, length) attended; logits [n, V].

        masked=False: every row is at position length - 1, so no key needs masking.
        routes: a list to which each MoE layer appends its expert ids [n, topk].
        """
        n = tokens.shape[0]
        x = self.embed(tokens)
        cos, sin = cache.cos[pos][:, None, None], cache.sin[pos][:, None, None]
        write = cache.write_rows(pos)
        pairs = n * self.groups_per_rank  # (row, K/V group) pairs, each one attention problem
        mask = None
        if masked:  # [pairs, 1, length]: -inf at each row's keys beyond its position
            mask = torch.zeros(n, 1, length, dtype=self.dtype, device=tokens.device)
            mask = mask.masked_fill_(cache.positions[:length] > pos[:, None, None], float("-inf"))
            mask = mask.repeat_interleave(self.groups_per_rank, dim=0)
        for i, w in enumerate(self.layers):
            q, key, value = self._qkv(w, x, cos, sin)
            cache.key_rows[i].index_copy_(0, write, key.reshape(-1, self.dim))
            cache.value_rows[i].index_copy_(0, write, value.reshape(-1, self.dim))
            x = self._finish_layer(w, x, self._attend(q, cache.keys[i], cache.values[i], pairs, length, mask), routes)
        return self.logits(x)

    def _attend(self, q, keys, values, pairs: int, length: int, mask):
        """One query token per row: the `rep` query heads of a K/V group as `rep` query rows against that
        group's cached keys [0, length) (no repeated K/V, no GQA head mapping). q [n, groups, rep, D] ->
        [n, heads * D]. On CPU three batched calls over the (row, group) pairs: scores (scaled, mask added,
        one baddbmm), softmax (fp32), times the values: at batch 8-32 SDPA's flash kernel spends more on
        its blocking than on one query row per head (about a tenth of a decode step). CUDA keeps SDPA."""
        n, d = pairs // self.groups_per_rank, self.dim
        k, v = keys[:n, :, :length], values[:n, :, :length]
        if self.device.type != "cpu":
            attn = F.scaled_dot_product_attention(q, k, v, attn_mask=None if mask is None else mask.view(n, -1, 1, length),
                                                  scale=self.scale)
            return attn.reshape(n, self.heads * d)
        k, v, q = k.reshape(pairs, length, d), v.reshape(pairs, length, d), q.reshape(pairs, self.rep, d)
        scores = (torch.bmm(q, k.transpose(1, 2)).mul_(self.scale) if mask is None
                  else torch.baddbmm(mask, q, k.transpose(1, 2), alpha=self.scale))
        probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(v.dtype)
        return torch.bmm(probs, v).view(n, self.heads * d)
