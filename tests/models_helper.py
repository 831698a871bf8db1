"""Tiny HF models, ragged batches and distributed helpers shared by the models tests."""
from __future__ import annotations

import os

import torch

B, S = 3, 10
PADS = (0, 3, 5)  # left padding per row: ragged batch

# name -> (random_hf_model_folder kwargs, whether to run it at TP=2)
CASES = {
    # GQA (2 KV heads), q/k/v biases, odd vocab, 4 layers (2 per stage at PP=2)
    "qwen2": (dict(model_type="qwen2", num_hidden_layers=4, vocab_size=251), True),
    # tied embeddings, odd vocab, head_dim 32 != hidden/heads
    "llama_tied": (dict(model_type="llama", tie_word_embeddings=True, vocab_size=199, head_dim=32), True),
    # one KV head: megatron needs query groups divisible by TP, so TP=1 only; sharded safetensors
    "gqa1": (dict(model_type="qwen2", num_key_value_heads=1, max_shard_size="40KB"), False),
    # Llama-3 rope scaling (megatron's fixed low/high frequency factors); rope is TP-independent
    "llama3_rope": (dict(model_type="llama", max_position_embeddings=16384, rope_parameters=dict(
        rope_type="llama3", rope_theta=10000.0, factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
        original_max_position_embeddings=8192)), False),
}


def make_folders(root) -> dict[str, str]:
    from hybridrl.models.hf_checkpoint import random_hf_model_folder

    folders = {}
    for seed, (name, (kwargs, _)) in enumerate(CASES.items()):
        folders[name] = random_hf_model_folder(os.path.join(root, name), seed=seed, **kwargs)
    return folders


def ragged_batch(vocab_size: int, seed: int = 0) -> dict:
    """Left-padded token batch: input_ids [B, S] and attention_mask [B, S] (1 = token)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab_size, (B, S), generator=g)
    mask = torch.ones(B, S, dtype=torch.long)
    for row, pad in enumerate(PADS):
        mask[row, :pad] = 0
        ids[row, :pad] = 0
    return {"input_ids": ids, "attention_mask": mask}


def padded_rl_rows(vocab: int, prompt_len: list, resp_len: list, width: tuple, g: torch.Generator) -> dict:
    """Rows of a step batch with left-padded prompts and right-padded responses of the given real
    lengths (width = (prompt width, response width)): input_ids, attention_mask, responses, response_mask."""
    (P, R), n = width, len(prompt_len)
    pmask = (torch.arange(P)[None] >= (P - torch.tensor(prompt_len))[:, None]).float()
    rmask = (torch.arange(R)[None] < torch.tensor(resp_len)[:, None]).float()
    prompts = torch.randint(1, vocab, (n, P), generator=g) * pmask.long()
    responses = torch.randint(1, vocab, (n, R), generator=g) * rmask.long()
    return {"input_ids": torch.cat([prompts, responses], 1), "attention_mask": torch.cat([pmask, rmask], 1),
            "responses": responses, "response_mask": rmask}


def hf_logits(folder: str, batch: dict) -> torch.Tensor:
    """Reference logits from transformers, with HF's left-padding position ids."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32,
                                                              attn_implementation="eager")
    pos = (batch["attention_mask"].cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        return model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                     position_ids=pos).logits


def reinit_parallel(tp: int, pp: int, ep: int = 1):
    """Fresh megatron parallel_state with a new (tp, pp, ep) layout inside one launch."""
    from megatron.core import parallel_state as ps

    from hybridrl.parallel.distributed import init_model_parallel

    if ps.model_parallel_is_initialized():
        ps.destroy_model_parallel()
    return init_model_parallel(tp, pp, ep=ep)


def gather_vocab(local: torch.Tensor, groups) -> torch.Tensor:
    """Test-only: the full-vocab tensor from TP shards along the last dim."""
    import torch.distributed as dist

    if groups.tp == 1:
        return local
    parts = [torch.empty_like(local) for _ in range(groups.tp)]
    dist.all_gather(parts, local.contiguous(), group=groups.tp_group)
    return torch.cat(parts, dim=-1)


def mcore_logits(model, spec, groups, batch, padding=None) -> torch.Tensor | None:
    """Full-vocab logits [B, S, V] of the replica, on its last stage's TP rank 0 (else None)."""
    from hybridrl.models.forward import pipeline_forward

    outs = pipeline_forward(model, [batch], padding=padding)
    if not groups.is_last_stage:
        return None
    full = gather_vocab(outs[0]["output"], groups)[..., :spec.vocab_size]
    return full if groups.tp_rank == 0 else None


def hf_greedy(model, prompts: list, new: int, eos=None) -> torch.Tensor:
    """transformers generate(do_sample=False) on left-padded `prompts` (pad 0): the [n, new] generated ids;
    with no `eos` every row runs the full `new` tokens."""
    import transformers

    length = max(map(len, prompts))
    ids = torch.tensor([[0] * (length - len(p)) + p for p in prompts])
    attn = torch.tensor([[0] * (length - len(p)) + [1] * len(p) for p in prompts])
    config = transformers.GenerationConfig(do_sample=False, max_new_tokens=new, min_new_tokens=new if eos is None
                                           else 0, pad_token_id=0, eos_token_id=eos)
    with torch.no_grad():
        return model.generate(input_ids=ids, attention_mask=attn, generation_config=config)[:, length:]
