"""A lean forward for decoding over a megatron-core GPTModel's own weight tensors (its rollout-TP shard).

What megatron's static inference path costs per step and this one does not: re-rotating every cached
key, repeating K/V over the query heads, copying through its cache wrappers, logits of every prompt
position. Here, per generate call, one zeroed KV cache `[layers, 2, slots, kv_groups, length, dim]`
and the rotary cos/sin of positions [0, length) are made once (`DecodeCache`); per layer and step:
RMSNorm, the fused column-parallel QKV, rotary on the new query and key only, the key and value
written in place at each row's own position, SDPA with `enable_gqa=True` on the unrepeated cache,
the row-parallel output projection and one all-reduce, RMSNorm, fused gate/up, down projection and
one all-reduce. Logits are computed for the last position only and gathered over rollout TP.

Weights are read, never written: `LeanGPT` holds references to the model's parameters (filled by
`NativeEngine.load_weights`), so it must be rebuilt after the parameters are replaced, not after
their values change. No scheduling here (`continuous_batching.py`), no torch.distributed
(`parallel/tp_collectives.py`).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from hybridrl.parallel.tp_collectives import all_gather_last_dim, all_reduce_


@dataclass(frozen=True)
class LayerWeights:
    """One transformer layer's local shards (column-parallel qkv/fc1, row-parallel proj/fc2).

    The matrices are held transposed ([in, out] views of megatron's [out, in] parameters), so a
    projection is one `mm` / `addmm` with no per-call transpose.
    """
    input_norm: torch.Tensor
    qkv: torch.Tensor
    qkv_bias: torch.Tensor | None
    proj: torch.Tensor
    mlp_norm: torch.Tensor
    fc1: torch.Tensor
    fc2: torch.Tensor


def _norm_weight(norm, fused_linear) -> torch.Tensor:
    """A norm's weight: its own module (local spec) or fused into the next linear (TE spec)."""
    weight = getattr(norm, "weight", None)
    return weight if weight is not None else fused_linear.layer_norm_weight


def layer_weights(layer) -> LayerWeights:
    attn, mlp = layer.self_attention, layer.mlp
    bias = getattr(attn.linear_qkv, "bias", None)
    bias = bias if bias is not None and bias.numel() else None  # TE keeps an empty tensor for "no bias"
    return LayerWeights(_norm_weight(layer.input_layernorm, attn.linear_qkv), attn.linear_qkv.weight.t(),
                        bias, attn.linear_proj.weight.t(),
                        _norm_weight(layer.pre_mlp_layernorm, mlp.linear_fc1), mlp.linear_fc1.weight.t(),
                        mlp.linear_fc2.weight.t())


def _matmul(x: torch.Tensor, weight_t: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., in] @ weight_t [in, out] (+ bias): a linear layer on a transposed weight."""
    flat = x if x.dim() == 2 else x.reshape(-1, x.shape[-1])
    out = torch.mm(flat, weight_t) if bias is None else torch.addmm(bias, flat, weight_t)
    return out if x.dim() == 2 else out.view(*x.shape[:-1], weight_t.shape[1])


def _check_supported(config) -> None:
    unsupported = {"qk_layernorm": config.qk_layernorm, "rotary_interleaved": config.rotary_interleaved,
                   "add_bias_linear": config.add_bias_linear, "gated_linear_unit": not config.gated_linear_unit,
                   "normalization": config.normalization != "RMSNorm"}
    bad = [name for name, on in unsupported.items() if on]
    if bad:
        raise ValueError(f"the lean decode path supports Qwen2/Llama-shaped models only, not {bad}; "
                         "use NativeEngine(decode='megatron')")


class DecodeCache:
    """What one generate call allocates once: the KV cache and the per-position rotary tables."""

    def __init__(self, lean: "LeanGPT", slots: int, length: int):
        self.slots, self.length = slots, length
        # zeros, not empty: a masked key still meets its value in the softmax @ V product (0 * NaN)
        self.kv = torch.zeros(len(lean.layers), 2, slots, lean.groups_per_rank, length, lean.dim,
                              dtype=lean.dtype, device=lean.device)
        self.keys, self.values = list(self.kv[:, 0].unbind(0)), list(self.kv[:, 1].unbind(0))  # per layer
        self.cos, self.sin = lean.rotary_tables(length)
        self.positions = torch.arange(length, device=lean.device)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor) -> torch.Tensor:
    """RoPE, rotate-half form: x*cos + rotate_half(x)*sin == x*cos + roll(x, D/2)*sin_signed."""
    return torch.addcmul(x * cos, x.roll(x.shape[-1] // 2, -1), sin_signed)


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
        """x [*lead, H] -> rotated q [*lead, heads, D], rotated k and v [*lead, groups, D]."""
        lead = x.shape[:-1]
        qkv = _matmul(self._norm(x, w.input_norm), w.qkv, w.qkv_bias)
        qkv = qkv.view(*lead, self.groups_per_rank, self.rep + 2, self.dim)  # per group: [q heads; k; v]
        qk = _rotate(qkv[..., :self.rep + 1, :], cos, sin)
        return qk[..., :self.rep, :].reshape(*lead, self.heads, self.dim), qk[..., self.rep, :], qkv[..., -1, :]

    def _finish_layer(self, w: LayerWeights, x, attn):
        """x + proj(attn), then the MLP half; one all-reduce per half (row-parallel partial sums)."""
        x = x.add_(all_reduce_(_matmul(attn, w.proj), self.tp_group, self.tp))
        gate, up = _matmul(self._norm(x, w.mlp_norm), w.fc1).chunk(2, dim=-1)
        return x.add_(all_reduce_(_matmul(F.silu(gate).mul_(up), w.fc2), self.tp_group, self.tp))

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        """[n, H] last hidden states -> [n, V] fp32 logits over the true vocabulary."""
        local = _matmul(self._norm(x, self.final_norm), self.output)
        return all_gather_last_dim(local, self.tp_group, self.tp)[:, :self.vocab].float()

    # ---- the two forwards --------------------------------------------------------------------------

    @torch.no_grad()
    def prefill(self, cache: DecodeCache, slots: torch.Tensor, tokens: torch.Tensor,
                last: torch.Tensor) -> torch.Tensor:
        """New prompts [k, P] (right-padded) into cache slots [k]; logits [k, V] at positions `last` [k].

        Causal attention within each prompt is exact for its real positions; the pads' keys land
        beyond each prompt's end, where decoding overwrites them before any query can see them.
        """
        k, length = tokens.shape
        x = self.embed(tokens)
        cos, sin = cache.cos[:length, None, None], cache.sin[:length, None, None]
        for i, w in enumerate(self.layers):
            q, key, value = self._qkv(w, x, cos, sin)
            key, value = key.transpose(1, 2), value.transpose(1, 2)  # [k, groups, P, D]
            cache.keys[i][slots, :, :length] = key
            cache.values[i][slots, :, :length] = value
            attn = F.scaled_dot_product_attention(q.transpose(1, 2), key, value, is_causal=True,
                                                  scale=self.scale, enable_gqa=True)
            x = self._finish_layer(w, x, attn.transpose(1, 2).reshape(k, length, self.heads * self.dim))
        return self.logits(x[torch.arange(k, device=x.device), last])

    @torch.no_grad()
    def decode(self, cache: DecodeCache, tokens: torch.Tensor, pos: torch.Tensor, length: int,
               masked: bool = True) -> torch.Tensor:
        """One token per slot 0..n-1 (`tokens`, `pos` [n]); keys [0, length) attended; logits [n, V].

        masked=False: every row is at position length - 1, so no key needs masking.
        """
        n = tokens.shape[0]
        rows = torch.arange(n, device=tokens.device)
        x = self.embed(tokens)
        cos, sin = cache.cos[pos][:, None, None], cache.sin[pos][:, None, None]
        mask = None
        if masked:
            mask = torch.zeros(n, length, dtype=self.dtype, device=tokens.device)
            mask = mask.masked_fill_(cache.positions[:length] > pos[:, None], float("-inf"))[:, None, None]
        for i, w in enumerate(self.layers):
            q, key, value = self._qkv(w, x, cos, sin)
            cache.keys[i][rows, :, pos] = key
            cache.values[i][rows, :, pos] = value
            attn = F.scaled_dot_product_attention(
                q[:, :, None], cache.keys[i][:n, :, :length], cache.values[i][:n, :, :length],
                attn_mask=mask, scale=self.scale, enable_gqa=True)
            x = self._finish_layer(w, x, attn.reshape(n, self.heads * self.dim))
        return self.logits(x)
