"""Build a megatron-core GPTModel (Qwen2/Qwen3/Llama shape, dense or MoE) for this rank's TP/PP/EP slice.

`GPTSpec` holds the architecture in HF vocabulary plus the megatron layer spec it is built with;
`build_gpt` turns it into a `TransformerConfig` + layer spec (RMSNorm, SwiGLU, RoPE, GQA, optional
QKV bias, optional per-head q/k RMSNorm, optional top-k routed SwiGLU experts in megatron's MoELayer). Layer specs: "local" (plain torch modules, explicit [B, 1, S, S] attention masks; the CPU
path) and "te" (Transformer Engine: fused kernels, flash attention, causal masks only, layernorms
fused into the following linear, hence other state-dict names: see `hf_convert`).
`default_layer_spec()` picks "te" on CUDA when Transformer Engine is installed.
The model knows nothing about RL; parallelism comes from megatron-core's parallel_state.
"""
from __future__ import annotations

import dataclasses
import importlib.util
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from hybridrl.parallel import cpu_compat
from hybridrl.parallel.cpu_compat import cuda_to_cpu

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
LAYER_SPECS = ("local", "te")


def default_layer_spec() -> str:
    """"te" on CUDA with Transformer Engine installed, else "local"."""
    if torch.cuda.is_available() and importlib.util.find_spec("transformer_engine") is not None:
        return "te"
    return "local"


def transformer_layer_spec(kind: str, qk_norm: bool = False, num_experts: int = 0):
    """megatron's layer spec; MoE layers use SequentialMLP experts locally, grouped GEMM with TE.
    The local spec's core attention is `SDPAttention` (torch's fused attention kernels) instead of
    megatron's unfused DotProductAttention; the rest of the layer, and every weight name, is megatron's."""
    from megatron.core.models.gpt import gpt_layer_specs

    from hybridrl.models.norms import RMSNorm
    from hybridrl.models.sdpa_attention import SDPAttention

    experts = num_experts or None
    if kind == "te":
        return gpt_layer_specs.get_gpt_layer_with_transformer_engine_spec(
            num_experts=experts, moe_grouped_gemm=bool(experts), qk_layernorm=qk_norm)
    spec = gpt_layer_specs.get_gpt_layer_local_spec(num_experts=experts, moe_grouped_gemm=False,
                                                    qk_layernorm=qk_norm, normalization="RMSNorm")
    attention = spec.submodules.self_attention.submodules
    norms = dict(q_layernorm=RMSNorm, k_layernorm=RMSNorm) if qk_norm else {}
    spec.submodules.self_attention.submodules = dataclasses.replace(attention, core_attention=SDPAttention, **norms)
    spec.submodules = dataclasses.replace(spec.submodules, input_layernorm=RMSNorm, pre_mlp_layernorm=RMSNorm)
    return spec


def block_spec(spec: "GPTSpec", config, pp_rank: int):
    """The decoder block of this pipeline stage: `transformer_layer_spec` per layer, and for the local spec
    its own final norm (megatron's default local norm refuses sequence parallelism, `models/norms.py`)."""
    from hybridrl.models.norms import RMSNorm
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules, get_num_layers_to_build

    layer = transformer_layer_spec(spec.layer_spec, spec.qk_norm, spec.num_experts)
    if spec.layer_spec == "te":
        return layer
    layers = get_num_layers_to_build(config, pp_rank=pp_rank)
    return TransformerBlockSubmodules(layer_specs=[layer] * layers, layer_norm=RMSNorm)


@dataclass(frozen=True)
class GPTSpec:
    num_layers: int
    hidden_size: int
    num_attention_heads: int
    num_key_value_heads: int
    intermediate_size: int
    vocab_size: int
    """Vocabulary of the tokenizer/HF checkpoint (unpadded)."""
    max_position_embeddings: int = 2048
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-6
    qkv_bias: bool = False
    tie_word_embeddings: bool = False
    head_dim: int = 0
    """0: hidden_size // num_attention_heads."""
    rope_scaling_factor: float = 0.0
    """Llama-3 rope scaling factor (megatron's fixed low/high frequency factors 1/4, 8192 context); 0: off."""
    layer_spec: str = "local"
    """megatron layer spec of the build, "local" or "te"; decides the state-dict names (not the maths)."""
    qk_norm: bool = False
    """RMSNorm over each query and key head after the projection, before RoPE (Qwen3)."""
    num_experts: int = 0
    """Routed experts per MoE layer; 0: a dense SwiGLU MLP in every layer."""
    moe_topk: int = 0
    """Experts each token is sent to (MoE only)."""
    moe_intermediate_size: int = 0
    """SwiGLU hidden size of one expert (MoE only)."""
    norm_topk_prob: bool = True
    """Renormalise the top-k routing weights to sum to 1 (Qwen3-MoE's flag; Mixtral always does)."""
    moe_hf_names: str = "qwen3_moe"
    """HF tensor names of router and experts: "qwen3_moe" (mlp.gate, experts.e.gate_proj) or "mixtral"."""

    def __post_init__(self):
        if self.layer_spec not in LAYER_SPECS:
            raise ValueError(f"layer_spec={self.layer_spec!r} is not one of {LAYER_SPECS}")
        if self.num_experts and not 0 < self.moe_topk <= self.num_experts:
            raise ValueError(f"moe_topk={self.moe_topk} must be in [1, num_experts={self.num_experts}]")
        if self.moe_hf_names not in ("qwen3_moe", "mixtral"):
            raise ValueError(f"moe_hf_names={self.moe_hf_names!r} is not one of ('qwen3_moe', 'mixtral')")
        if self.num_experts and self.moe_intermediate_size <= 0:
            raise ValueError("moe_intermediate_size must be > 0 for an MoE model")

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    @property
    def kv_channels(self) -> int:
        return self.head_dim or self.hidden_size // self.num_attention_heads

    def padded_vocab_size(self, tp: int, multiple: int = 128) -> int:
        """Megatron pads the vocab to a multiple of 128 x TP; padding rows are masked out of logits."""
        step = multiple * tp
        return ((self.vocab_size + step - 1) // step) * step


def for_this_machine(spec: GPTSpec) -> GPTSpec:
    """`spec` with the layer spec this machine builds (`default_layer_spec`)."""
    return dataclasses.replace(spec, layer_spec=default_layer_spec())


def moe_config(spec: GPTSpec, ep: int = 1, etp: int | None = None) -> dict:
    """TransformerConfig fields of the routed experts (empty for a dense model).

    Softmax over all experts then top-k (`pre_softmax`) is Qwen3-MoE with norm_topk_prob false;
    top-k logits then softmax equals renormalised top-k probabilities (Qwen3-MoE true, Mixtral).
    The router runs in fp32, no capacity limit (no token dropped), the allgather dispatcher (it runs
    on gloo as well as nccl). The load-balancing loss is added only when its coefficient is > 0."""
    if not spec.is_moe:
        return {}
    return dict(num_moe_experts=spec.num_experts, moe_router_topk=spec.moe_topk,
                moe_ffn_hidden_size=spec.moe_intermediate_size, moe_router_pre_softmax=not spec.norm_topk_prob,
                moe_router_score_function="softmax", moe_router_dtype="fp32", moe_token_dispatcher_type="allgather",
                moe_router_load_balancing_type="aux_loss", moe_aux_loss_coeff=0.0,
                moe_grouped_gemm=spec.layer_spec == "te", moe_permute_fusion=False, moe_router_fusion=False,
                expert_model_parallel_size=ep, expert_tensor_parallel_size=etp)


def transformer_config(spec: GPTSpec, tp: int, pp: int, dtype: str = "float32", ep: int = 1,
                       etp: int | None = None, **overrides):
    from megatron.core.transformer import TransformerConfig

    params_dtype = DTYPES[dtype]
    kwargs = dict(
        num_layers=spec.num_layers, hidden_size=spec.hidden_size,
        num_attention_heads=spec.num_attention_heads, num_query_groups=spec.num_key_value_heads,
        ffn_hidden_size=spec.intermediate_size, kv_channels=spec.kv_channels,
        normalization="RMSNorm", layernorm_epsilon=spec.rms_norm_eps, qk_layernorm=spec.qk_norm,
        gated_linear_unit=True, activation_func=F.silu, add_bias_linear=False, add_qkv_bias=spec.qkv_bias,
        hidden_dropout=0.0, attention_dropout=0.0,
        tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
        params_dtype=params_dtype, pipeline_dtype=params_dtype,
        bf16=params_dtype is torch.bfloat16, fp16=params_dtype is torch.float16,
        use_cpu_initialization=not torch.cuda.is_available(), perform_initialization=True,
        # Fused kernels need CUDA (and apex/TE); the local spec uses plain torch ops.
        bias_activation_fusion=False, bias_dropout_fusion=False, masked_softmax_fusion=False,
        persist_layer_norm=False, apply_rope_fusion=False, gradient_accumulation_fusion=False,
        attention_softmax_in_fp32=True, init_method_std=0.02,
        **moe_config(spec, ep, etp),
    )
    kwargs.update(overrides)
    return TransformerConfig(**kwargs)


def build_gpt(spec: GPTSpec, tp: int, pp: int, pp_rank: int, dtype: str = "float32", ep: int = 1,
              etp: int | None = None, **config_overrides):
    """The GPTModel chunk of pipeline stage `pp_rank` (embedding on the first, head on the last; this EP
    rank's experts); `model.layer_spec_kind` records spec.layer_spec for the forward (models/forward.py).
    `sequence_parallel` applies at TP > 1 only (megatron's meaning); `remove_padding` (not a megatron field)
    makes the forward pack each micro-batch's rows into one sequence (`model.remove_padding`)."""
    from megatron.core.models.gpt import GPTModel

    remove_padding = config_overrides.pop("remove_padding", False)
    config_overrides["sequence_parallel"] = bool(config_overrides.get("sequence_parallel")) and tp > 1

    if spec.is_moe:
        cpu_compat.without_transformer_engine_gemm()
    else:  # a role's MoE options (aux loss, routing replay) mean nothing to a dense model
        config_overrides = {k: v for k, v in config_overrides.items() if not k.startswith("moe_")}
    config = transformer_config(spec, tp, pp, dtype, ep, etp, **config_overrides)
    with cuda_to_cpu():  # tied embeddings at PP>1 call .cuda() on the output copy
        model = GPTModel(
            config=config,
            transformer_layer_spec=block_spec(spec, config, pp_rank),
            vocab_size=spec.padded_vocab_size(tp),
            max_sequence_length=spec.max_position_embeddings,
            pre_process=pp_rank == 0,
            post_process=pp_rank == pp - 1,
            share_embeddings_and_output_weights=spec.tie_word_embeddings,
            position_embedding_type="rope",
            # an integral base stays an int, as megatron types it; the frequencies are identical
            rotary_base=int(spec.rope_theta) if float(spec.rope_theta).is_integer() else spec.rope_theta,
            rope_scaling=spec.rope_scaling_factor > 0,
            rope_scaling_factor=spec.rope_scaling_factor or 8.0,
        )
    model.layer_spec_kind = spec.layer_spec
    model.remove_padding = remove_padding
    if not torch.cuda.is_available():
        return model
    return model.cuda()
