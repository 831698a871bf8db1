"""HF -> megatron conversion: logits equal transformers' at every (TP, PP), the round trip is
bit-exact, and the offline per-rank folder equals what a live model holds.

Two launches cover everything: 2 processes run (1,1) [DP=2], (2,1), (1,2); 4 processes run (2,2)
with the export round trip. The one-KV-head model runs at TP=1 only (megatron splits whole query
groups over TP). Batches are ragged with left padding; only valid positions are compared.
"""
import os

import pytest
import torch

from dist_helper import run_distributed

from models_helper import (CASES, hf_logits, make_folders, mcore_logits, ragged_batch, reinit_parallel)

from hybridrl.models import hf_convert as hc
from hybridrl.models.hf_checkpoint import SafetensorsReader
from hybridrl.models.hf_config import spec_from_hf_config

ATOL = 1e-4


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    return make_folders(str(tmp_path_factory.mktemp("hf")))


@pytest.fixture(scope="module")
def references(folders):
    out = {}
    for name, folder in folders.items():
        batch = ragged_batch(spec_from_hf_config(folder).vocab_size)
        out[name] = (batch, hf_logits(folder, batch))
    return out


def _assert_logits_match(got, batch, ref, what):
    valid = batch["attention_mask"].bool()
    diff = (got[valid] - ref[valid]).abs().max().item()
    assert diff < ATOL, f"{what}: max |megatron - transformers| = {diff:.2e} on valid positions"


def _small_layouts_run(folders, layouts):
    from hybridrl.models.hf_checkpoint import model_from_hf

    results = {}
    for tp, pp in layouts:
        groups = reinit_parallel(tp, pp)
        for name, folder in folders.items():
            if tp > 1 and not CASES[name][1]:
                continue
            model, spec = model_from_hf(folder, groups)
            for padding in ("mask", "left_align"):  # left_align: the Transformer Engine spec's path
                logits = mcore_logits(model, spec, groups, ragged_batch(spec.vocab_size), padding)
                if logits is not None and groups.dp_rank == 0:
                    results[(tp, pp, name, padding)] = logits
            if (tp, pp) == (1, 1):
                results[("inv_freq", name)] = model.rotary_pos_emb.inv_freq.clone()
    return results


@pytest.mark.distributed
def test_logits_match_transformers_tp_pp_up_to_2(folders, references):
    layouts = [(1, 1), (2, 1), (1, 2)]
    merged = {}
    for r in run_distributed(_small_layouts_run, 2, folders, layouts):
        merged.update(r)
    inv_freq = {k[1]: merged.pop(k) for k in list(merged) if k[0] == "inv_freq"}
    expected = {(tp, pp, n, padding) for tp, pp in layouts for n in folders if tp == 1 or CASES[n][1]
                for padding in ("mask", "left_align")}
    assert set(merged) == expected
    for (tp, pp, name, padding), logits in merged.items():
        batch, ref = references[name]
        _assert_logits_match(logits, batch, ref, f"{name} tp={tp} pp={pp} padding={padding}")
    # rope frequencies exactly as transformers computes them (llama3 scaling barely moves short logits)
    for name, freq in inv_freq.items():
        torch.testing.assert_close(freq, _hf_inv_freq(folders[name]), rtol=1e-6, atol=0, msg=name)


def _hf_inv_freq(folder):
    import transformers

    config = transformers.AutoConfig.from_pretrained(folder)
    rotary = transformers.AutoModelForCausalLM.from_config(config).model.rotary_emb
    return rotary.inv_freq


def _tp2pp2_run(folders, out_root, offline_root):
    import torch.distributed as dist

    from hybridrl.models.gpt import build_gpt
    from hybridrl.models.hf_checkpoint import mcore_to_hf_stream, model_from_hf, save_hf, weight_state
    from hybridrl.models.hf_config import load_hf_config
    from hybridrl.models.mcore_checkpoint import load_mcore_checkpoint, save_mcore_checkpoint

    groups = reinit_parallel(2, 2)
    res = {}
    for name in ("qwen2", "llama_tied"):
        folder = folders[name]
        model, spec = model_from_hf(folder, groups)
        logits = mcore_logits(model, spec, groups, ragged_batch(spec.vocab_size))
        reader = SafetensorsReader(folder)
        unequal, yielded = [], []
        for hf_name, t in mcore_to_hf_stream(model, spec, groups):
            yielded.append(hf_name)
            if not torch.equal(t, reader.read(hf_name)):
                unequal.append(hf_name)
        save_hf(os.path.join(out_root, name), mcore_to_hf_stream(model, spec, groups), load_hf_config(folder))
        save_mcore_checkpoint(model, os.path.join(out_root, name + "_mcore"), spec, groups, load_hf_config(folder))
        # the offline (pure) per-rank file loads into a live model and equals the HF-loaded one
        fresh = build_gpt(spec, 2, 2, groups.pp_rank)
        load_mcore_checkpoint(fresh, os.path.join(offline_root, name), groups)
        same = all(torch.equal(a, b) for a, b in zip(weight_state(fresh).values(), weight_state(model).values()))
        res[name] = dict(logits=logits, unequal=unequal, yielded=yielded, offline_equal=same)
    dist.barrier()
    return res


@pytest.mark.distributed
def test_tp2_pp2_logits_round_trip_and_export(folders, references, tmp_path):
    import transformers
    from safetensors.torch import load_file

    from hybridrl.models.mcore_checkpoint import hf_folder_to_mcore, load_rank_state

    offline = tmp_path / "offline"
    for name in ("qwen2", "llama_tied"):
        hf_folder_to_mcore(folders[name], str(offline / name), tp=2, pp=2)
    outs = run_distributed(_tp2pp2_run, 4, folders, str(tmp_path / "out"), str(offline))
    for name in ("qwen2", "llama_tied"):
        per_rank = [o[name] for o in outs]
        got = [r["logits"] for r in per_rank if r["logits"] is not None]
        assert len(got) == 1
        batch, ref = references[name]
        _assert_logits_match(got[0], batch, ref, f"{name} tp=2 pp=2")
        original = SafetensorsReader(folders[name]).names()
        for r in per_rank:
            assert r["unequal"] == [], f"{name}: round trip changed {r['unequal']}"
            assert sorted(r["yielded"]) == sorted(original)
            assert r["offline_equal"], f"{name}: offline megatron shards differ from the live model"
        # the live model's saved shards are the offline converter's shards, name for name
        for t in range(2):
            for p in range(2):
                live = load_rank_state(str(tmp_path / "out" / (name + "_mcore")), t, p)
                off = load_rank_state(str(offline / name), t, p)
                assert live.keys() == off.keys() and all(torch.equal(live[k], off[k]) for k in live)
        exported = str(tmp_path / "out" / name)
        model, info = transformers.AutoModelForCausalLM.from_pretrained(exported, output_loading_info=True)
        assert not info["missing_keys"] and not info["unexpected_keys"], info
        saved, src = load_file(os.path.join(exported, "model.safetensors")), SafetensorsReader(folders[name])
        assert all(torch.equal(saved[n], src.read(n)) for n in original) and set(saved) == set(original)


# ---- pure mapping (no processes) ------------------------------------------------------------------

def test_qkv_fusion_is_per_query_group():
    d, groups, hpg = 2, 2, 3  # head_dim 2, 2 groups of 3 query heads
    q = torch.arange(groups * hpg * d).float().unsqueeze(1)
    k = 100 + torch.arange(groups * d).float().unsqueeze(1)
    v = 200 + torch.arange(groups * d).float().unsqueeze(1)
    fused = hc.fuse_qkv(q, k, v, groups).squeeze(1).tolist()
    assert fused == [0, 1, 2, 3, 4, 5, 100, 101, 200, 201, 6, 7, 8, 9, 10, 11, 102, 103, 202, 203]
    back = hc.unfuse_qkv(hc.fuse_qkv(q, k, v, groups), groups, hpg)
    assert all(torch.equal(a, b) for a, b in zip(back, (q, k, v)))


def test_lazy_shards_equal_split_of_full_tensors(folders):
    """read_shard (sliced reads) == split_for_tp(hf_to_mcore(full)); merge_tp inverts the split."""
    for name in ("qwen2", "llama_tied", "gqa1"):
        reader = SafetensorsReader(folders[name])
        spec = spec_from_hf_config(folders[name])
        hf = {n: reader.read(n) for n in reader.names()}
        for tp in (1, 2) if CASES[name][1] else (1,):
            for pp in (1, 2):
                for pp_rank in range(pp):
                    offset = hc.layer_range(spec.num_layers, pp, pp_rank).start
                    shards = [hc.stage_state(reader, spec, tp, pp, t, pp_rank) for t in range(tp)]
                    for local in shards[0]:
                        glob = hc.local_to_global(local, offset)
                        full = hc.hf_to_mcore(glob, hf, spec, tp)
                        assert tuple(full.shape) == hc.mcore_full_shape(glob, spec, tp)
                        for t in range(tp):
                            assert torch.equal(shards[t][local], hc.split_for_tp(glob, full, tp, t)), (name, glob)
                        assert torch.equal(hc.merge_tp(glob, [s[local] for s in shards]), full)


def test_name_maps_and_layer_offsets():
    from hybridrl.models.gpt import GPTSpec

    spec = GPTSpec(num_layers=4, hidden_size=8, num_attention_heads=2, num_key_value_heads=1,
                   intermediate_size=16, vocab_size=10, qkv_bias=True, tie_word_embeddings=True)
    assert list(hc.layer_range(4, 2, 1)) == [2, 3]
    assert hc.local_to_global("decoder.layers.1.mlp.linear_fc2.weight", 2) == "decoder.layers.3.mlp.linear_fc2.weight"
    assert hc.owner_stage("decoder.layers.2.input_layernorm.weight", spec, 2) == 1
    last = dict(hc.stage_names(spec, 2, 1))
    assert last["output_layer.weight"] == "output_layer.weight"  # tied copy on the last stage at PP>1
    assert hc.hf_sources("output_layer.weight", spec) == ("model.embed_tokens.weight",)
    assert "output_layer.weight" not in hc.hf_to_mcore_name_map(spec)  # exported once, as the embedding
    inverse = hc.mcore_to_hf_name_map(spec)
    assert inverse["model.layers.3.self_attn.v_proj.bias"] == ("decoder.layers.3.self_attention.linear_qkv.bias", 2)
    assert inverse["model.layers.0.mlp.up_proj.weight"] == ("decoder.layers.0.mlp.linear_fc1.weight", 1)
    assert set(inverse) == set(hc.hf_shapes(spec))


# ---- the Transformer Engine layer spec's names (pure mapping: TE itself is not needed) --------------

def _te_spec(**kw):
    from hybridrl.models.gpt import GPTSpec

    return GPTSpec(num_layers=4, hidden_size=8, num_attention_heads=4, num_key_value_heads=2, intermediate_size=16,
                   vocab_size=10, qkv_bias=True, layer_spec="te", **kw)


def test_te_names_are_megatrons_local_to_te_map():
    """Our TE names == megatron's own `sharded_state_dict_keys_map` (local -> TE) applied to the local names."""
    import dataclasses

    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    keys_map = get_gpt_layer_local_spec(normalization="RMSNorm").submodules.sharded_state_dict_keys_map
    te = _te_spec()
    local = dataclasses.replace(te, layer_spec="local")

    def to_te(name):
        for old, new in keys_map.items():
            name = name.replace(f".{old}", f".{new}")
        return name

    for pp, pp_rank in ((1, 0), (2, 0), (2, 1)):
        expected = [(to_te(a), to_te(b)) for a, b in hc.stage_names(local, pp, pp_rank)]
        assert hc.stage_names(te, pp, pp_rank) == expected
    assert "decoder.layers.1.self_attention.linear_qkv.layer_norm_weight" in hc.hf_to_mcore_name_map(te)
    assert hc.hf_sources("decoder.layers.1.mlp.linear_fc1.layer_norm_weight", te) == (
        "model.layers.1.post_attention_layernorm.weight",)
    with pytest.raises(KeyError, match="te layer spec"):
        hc.hf_sources("decoder.layers.1.input_layernorm.weight", te)


@pytest.mark.parametrize("tie", [False, True])
def test_te_state_dicts_round_trip_at_tp2_pp2(tie):
    """Synthetic HF tensors -> TE-named shards of every (tp, pp) rank -> merged -> HF: bit-exact."""
    spec, tp, pp = _te_spec(tie_word_embeddings=tie), 2, 2
    g = torch.Generator().manual_seed(0)
    hf = {n: torch.randn(shape, generator=g) for n, shape in hc.hf_shapes(spec).items()}
    shards = {(t, p): hc.stage_state(hc.DictReader(hf), spec, tp, pp, t, p) for t in range(tp) for p in range(pp)}
    for (t, p), state in shards.items():
        assert not any("input_layernorm" in k or "pre_mlp_layernorm" in k for k in state)
        norm = "decoder.layers.0.mlp.linear_fc1.layer_norm_weight"
        assert torch.equal(state[norm], shards[(0, p)][norm])  # replicated over TP
    back = {}
    for glob in hc.hf_to_mcore_name_map(spec):
        owner = hc.owner_stage(glob, spec, pp)
        local = hc.global_to_local(glob, hc.layer_range(spec.num_layers, pp, owner).start)
        full = hc.merge_tp(glob, [shards[(t, owner)][local] for t in range(tp)])
        assert tuple(full.shape) == hc.mcore_full_shape(glob, spec, tp)
        back.update(hc.mcore_to_hf(glob, full, spec))
    assert set(back) == set(hf) and all(torch.equal(back[n], hf[n]) for n in hf)


def test_left_alignment_rotates_pads_and_back():
    from hybridrl.models.forward import left_align_index, restore_alignment

    mask = torch.tensor([[0, 0, 1, 1, 1, 0], [1, 1, 1, 1, 0, 0], [0, 1, 1, 1, 1, 1]])
    ids = torch.arange(18).reshape(3, 6)
    index = left_align_index(mask)
    aligned = ids.gather(1, index)
    assert aligned.tolist() == [[2, 3, 4, 5, 0, 1], [6, 7, 8, 9, 10, 11], [13, 14, 15, 16, 17, 12]]
    assert torch.equal(restore_alignment(aligned[..., None].float(), index)[..., 0], ids.float())
    with pytest.raises(ValueError, match="contiguous"):
        left_align_index(torch.tensor([[1, 0, 1, 1]]))
