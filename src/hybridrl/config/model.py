"""Sections data, model and parallel: what is trained on, which network, how it is split."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

from hybridrl.config.checks import check, one_of

SYNTHETIC_TASKS = ("arith", "arith_tools")


@dataclass(frozen=True)
class DataConfig:
    train_files: List[str] = field(default_factory=lambda: ["data/tiny_arith/train.parquet"])
    """Parquet files of training prompts in verl's layout."""
    val_files: List[str] = field(default_factory=lambda: ["data/tiny_arith/test.parquet"])
    """Parquet files of validation prompts."""
    apply_chat_template_kwargs: Dict[str, Any] = field(default_factory=dict)
    """Extra variables of the tokenizer's chat template (verl's key), e.g. {enable_thinking: false} for Qwen3:
    used for prompts, multi-turn continuations and SFT trajectories alike."""
    prompt_key: str = "prompt"
    """Column holding the prompt: a list of chat messages or a plain string."""
    tokenizer: str = ""
    """HF tokenizer folder, a SentencePiece .model file, or builtin:tiny / builtin:tiny_tools (the project's own);
    empty (the default, as verl's null): model.path's own tokenizer, builtin:tiny where model.path has none."""
    max_prompt_length: int = 32
    """Longest prompt in tokens; longer ones are filtered or truncated."""
    max_response_length: int = 16
    """Most new tokens per response."""
    train_batch_size: int = 16
    """Prompts per training step (before rollout.n)."""
    val_batch_size: Optional[int] = 64
    """Prompts per validation batch; null (verl's default, where the key is deprecated): the whole set at once."""
    filter_overlong_prompts: bool = True
    """Drop (and count) prompts longer than max_prompt_length."""
    truncation: str = "error"
    """When not filtering: left, right, or error for prompts that are too long."""
    shuffle: bool = True
    """Reshuffle the training prompts every epoch (seeded)."""
    seed: Optional[int] = 1
    """Seed of the per-epoch shuffle; null (verl's default): drawn at random once per run, the same on every rank,
    and kept in checkpoints, so a resumed run goes on with the order it started with."""
    synthetic_task: str = ""
    """arith or arith_tools: generate that synthetic task into missing train/val files (the CPU demos); empty: a
    missing file is an error."""

    def __post_init__(self):
        check(self.max_prompt_length > 0, "data.max_prompt_length must be > 0")
        check(self.max_response_length > 0, "data.max_response_length must be > 0")
        check(self.train_batch_size > 0, "data.train_batch_size must be > 0")
        check(self.val_batch_size is None or self.val_batch_size > 0, "data.val_batch_size must be > 0 or null")
        one_of("data.truncation", self.truncation, ("left", "right", "error"))
        check(self.synthetic_task in ("",) + SYNTHETIC_TASKS,
              f"data.synthetic_task={self.synthetic_task!r} is not one of {', '.join(SYNTHETIC_TASKS)}, or empty "
              "(no generated data: a missing data file is an error)")


ARCHITECTURES = ("qwen2", "qwen3", "llama", "qwen3_moe", "mixtral")
MOE_ARCHITECTURES = ("qwen3_moe", "mixtral")


@dataclass(frozen=True)
class ModelConfig:
    path: str = ""
    """HF folder with config.json (+ safetensors); empty: build from the fields below, random init."""
    architecture: str = "qwen2"
    """Family used when path is empty: qwen2, qwen3, llama, or the MoE families qwen3_moe and mixtral."""
    hidden_size: int = 64
    """Width of the residual stream (path empty)."""
    num_layers: int = 2
    """Transformer layers (path empty)."""
    num_attention_heads: int = 4
    """Query heads (path empty)."""
    num_key_value_heads: int = 2
    """Key/value heads, GQA (path empty)."""
    intermediate_size: int = 128
    """SwiGLU hidden size (path empty)."""
    vocab_size: int = 0
    """Vocabulary size (path empty); 0 takes the tokenizer's size."""
    head_dim: int = 0
    """Width of one attention head (path empty; qwen3 / qwen3_moe may differ from it); 0: hidden / heads."""
    max_position_embeddings: int = 512
    """Longest sequence (path empty)."""
    rope_theta: float = 10000.0
    """RoPE base (path empty)."""
    rms_norm_eps: float = 1e-6
    """RMSNorm epsilon (path empty)."""
    tie_word_embeddings: bool = True
    """Share input embedding and LM head (path empty)."""
    seed: int = 1234
    """Seed of the random init when path is empty."""
    params_dtype: str = "float32"
    """float32, bfloat16 or float16 for parameters and compute."""
    num_experts: int = 8
    """Routed experts per layer (path empty, MoE architectures)."""
    moe_topk: int = 2
    """Experts per token (path empty, MoE architectures)."""
    moe_intermediate_size: int = 64
    """SwiGLU hidden size of one expert (path empty, MoE architectures)."""
    norm_topk_prob: bool = True
    """Renormalise the top-k routing weights (path empty, qwen3_moe; mixtral always does)."""
    use_remove_padding: bool = True
    """Pack each micro-batch's rows into one sequence without padding (THD, verl's name) in every training and
    scoring forward; false: padded rows with an attention mask."""

    @property
    def is_moe(self) -> bool:
        return self.architecture in MOE_ARCHITECTURES

    def __post_init__(self):
        one_of("model.architecture", self.architecture, ARCHITECTURES)
        check(not self.is_moe or 0 < self.moe_topk <= self.num_experts,
              "model.moe_topk must be in [1, model.num_experts]")
        check(not self.is_moe or self.moe_intermediate_size > 0, "model.moe_intermediate_size must be > 0")
        one_of("model.params_dtype", self.params_dtype, ("float32", "bfloat16", "float16"))
        check(self.num_layers > 0 and self.hidden_size > 0, "model sizes must be > 0")
        check(self.head_dim == 0 or (self.head_dim > 0 and self.architecture.startswith("qwen3"))
              or self.head_dim * self.num_attention_heads == self.hidden_size,
              f"model.head_dim={self.head_dim}: only qwen3 / qwen3_moe set a head width other than hidden_size / "
              "num_attention_heads; set it to 0")
        check(self.num_attention_heads % max(self.num_key_value_heads, 1) == 0,
               "model.num_attention_heads must be a multiple of model.num_key_value_heads")


@dataclass(frozen=True)
class ParallelConfig:
    tensor_model_parallel_size: int = 1
    """TP of actor, critic and reference."""
    pipeline_model_parallel_size: int = 1
    """PP of actor, critic and reference; data parallel size is derived from the world size."""
    use_distributed_optimizer: bool = False
    """Shard optimizer states over DP (megatron-core's distributed optimizer)."""
    gpus_per_node: int = 8
    """Accelerators per node (layout planner and SLURM scripts)."""
    gpu_memory_gb: float = 80.0
    """Memory of one accelerator; the layout planner refuses plans that do not fit."""
    recompute_activations: bool = False
    """Full activation recomputation in the actor/critic backward (saves memory, costs a forward)."""
    expert_model_parallel_size: int = 1
    """EP: MoE experts split over this many ranks of the data-parallel dimension (dp must be a multiple)."""
    expert_tensor_parallel_size: int = 0
    """ETP: TP of each expert; 0 means tensor_model_parallel_size (the only value supported)."""
    sequence_parallel: Optional[bool] = None
    """megatron's sequence parallelism (norms, residuals and dropout split along the sequence over TP) in every
    trained and scoring model; null: on when tensor_model_parallel_size > 1 (Megatron-LM's and verl's advice)."""
    context_parallel_size: int = 1
    """CP: each sequence split over this many ranks (2·CP zig-zag chunks, keys/values all-gathered); world =
    TP x CP x PP x DP. Runs on packed sequences (model.use_remove_padding)."""

    def sequence_parallel_at(self, tp: int) -> bool:
        """Whether a model at tensor parallel size `tp` runs sequence parallel."""
        return tp > 1 and (self.sequence_parallel if self.sequence_parallel is not None else True)

    def __post_init__(self):
        check(self.context_parallel_size >= 1, "parallel.context_parallel_size must be >= 1")
        check(self.expert_model_parallel_size >= 1, "parallel.expert_model_parallel_size must be >= 1")
        check(self.expert_tensor_parallel_size in (0, self.tensor_model_parallel_size),
              f"parallel.expert_tensor_parallel_size={self.expert_tensor_parallel_size}: experts are split over TP "
              f"like the dense MLP; set it to 0 or to tensor_model_parallel_size={self.tensor_model_parallel_size}")
        check(self.tensor_model_parallel_size >= 1, "parallel.tensor_model_parallel_size must be >= 1")
        check(self.pipeline_model_parallel_size >= 1, "parallel.pipeline_model_parallel_size must be >= 1")
