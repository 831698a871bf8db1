"""Lean decode path: continuous batching (slot refill, request order, batch-independent sampling),
agreement with megatron's own static-inference path at rollout TP 1 and 2, and the CUDA-graph
bucket padding run eagerly on CPU.

One 2-process gloo launch computes everything; rows stop at many different lengths (a set of stop
ids), so slots free up at different steps and waiting requests are prefilled into them. Sampled, the
same requests run as one batch of 32 rows (8 prompts x 4 samples), through 4 refilled slots, one row
at a time, each prompt alone, and in a permuted order.
"""
import pytest
import torch

from dist_helper import run_distributed

PROMPTS = [[5, 6, 7], [1, 2, 3, 4, 5, 6, 7, 8, 9], [9], [40, 41, 42, 43], [100, 7], [3, 3, 3, 3, 3, 3],
           [200, 201], [17, 18, 19, 20, 21]]
NEW = 12
STOPS = tuple(range(2, 251, 9))  # ~11% of the vocabulary: rows end anywhere from 1 to NEW tokens
SAMPLED = dict(n=4, temperature=0.9, top_k=40, top_p=0.95, max_new_tokens=NEW, seed=11, stop_token_ids=STOPS)
GREEDY = dict(temperature=0.0, max_new_tokens=NEW, stop_token_ids=STOPS)


def _outputs(out):
    return {"responses": out.responses, "mask": out.response_mask, "log_probs": out.log_probs}


def _padded_buckets(engine, sampling, slots):
    """The graph path's bucket padding (slots parked beyond n), run eagerly: what CUDA replays."""
    from hybridrl.rollout.base import expand_requests
    from hybridrl.rollout.continuous_batching import SlotBatch
    from hybridrl.rollout.lean_decode import LeanGPT

    rows = expand_requests(PROMPTS, sampling)
    batch = SlotBatch(LeanGPT(engine.model, engine.spec, engine.groups), rows, sampling,
                      set(sampling.stop_token_ids), engine.pad_id, slots, graphs="padded")
    responses, mask, log_probs = batch.run()
    return {"responses": responses, "mask": mask, "log_probs": log_probs}


def _run(folder):
    from safetensors.torch import load_file

    from hybridrl.models.hf_config import load_hf_config, spec_from_hf_config
    from hybridrl.parallel.distributed import init_model_parallel
    from hybridrl.rollout.base import SamplingParams
    from hybridrl.rollout.native import NativeEngine

    init_model_parallel(1, 1)
    spec = spec_from_hf_config(load_hf_config(folder))
    weights = load_file(f"{folder}/model.safetensors")
    seeds = [SAMPLED["seed"] + i for i in range(len(PROMPTS))]
    order = [5, 2, 7, 0, 3, 6, 1, 4]
    res = {}
    for tp in (1, 2):
        engine = NativeEngine(spec, tp)
        engine.load_weights(weights.items())
        for kind, sp in (("greedy", SamplingParams(**GREEDY)), ("sampled", SamplingParams(**SAMPLED))):
            runs = res.setdefault(f"{kind}_tp{tp}", {})
            for slots in (256, 4, 1):  # all at once, refilled slots, one row at a time
                engine.max_num_seqs = slots
                runs[f"slots{slots}"] = _outputs(engine.generate(PROMPTS, sp, seeds))
            engine.max_num_seqs = 3
            runs["permuted"] = _outputs(engine.generate([PROMPTS[i] for i in order], sp, [seeds[i] for i in order]))
            runs["alone"] = [_outputs(engine.generate([p], sp, [s])) for p, s in zip(PROMPTS, seeds)]
            runs["padded"] = _padded_buckets(engine, sp, 5)
            engine.decode, engine.max_num_seqs = "megatron", 256
            runs["megatron"] = _outputs(engine.generate(PROMPTS, sp, seeds))
            engine.decode = "lean"
    res["order"] = order
    return res


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    from hybridrl.models.hf_checkpoint import random_hf_model_folder

    folder = random_hf_model_folder(str(tmp_path_factory.mktemp("qwen2")), "qwen2", seed=5, num_hidden_layers=2)
    return run_distributed(_run, 2, folder)


def _same(a, b, logp_atol=1e-5):
    assert torch.equal(a["responses"], b["responses"])
    assert torch.equal(a["mask"], b["mask"])
    torch.testing.assert_close(a["log_probs"], b["log_probs"], atol=logp_atol, rtol=0)


KEYS = [f"{kind}_tp{tp}" for kind in ("greedy", "sampled") for tp in (1, 2)]


@pytest.mark.distributed
@pytest.mark.parametrize("key", KEYS)
def test_refilled_slots_and_single_rows_match_one_batch(runs, key):
    for res in runs:
        ref = res[key]["slots256"]
        lengths = ref["mask"].sum(-1)
        assert len(set(lengths.tolist())) >= 3, f"lengths do not vary enough to exercise refill: {lengths}"
        assert (ref["responses"][ref["mask"] == 0] == 0).all() and (ref["log_probs"][ref["mask"] == 0] == 0).all()
        for slots in ("slots4", "slots1"):
            _same(res[key][slots], ref)
        rows_per_prompt = ref["responses"].shape[0] // len(PROMPTS)
        for i, alone in enumerate(res[key]["alone"]):
            _same(alone, {k: v[i * rows_per_prompt:(i + 1) * rows_per_prompt] for k, v in ref.items()})


@pytest.mark.distributed
@pytest.mark.parametrize("key", KEYS)
def test_outputs_come_back_in_request_order(runs, key):
    for res in runs:
        ref, permuted = res[key]["slots256"], res[key]["permuted"]
        n = ref["responses"].shape[0] // len(PROMPTS)
        rows = [i * n + j for i in res["order"] for j in range(n)]
        _same(permuted, {k: v[rows] for k, v in ref.items()})


@pytest.mark.distributed
@pytest.mark.parametrize("key", KEYS)
def test_lean_path_equals_megatron_static_path(runs, key):
    for res in runs:
        _same(res[key]["slots256"], res[key]["megatron"])


@pytest.mark.distributed
@pytest.mark.parametrize("key", KEYS)
def test_graph_bucket_padding_changes_nothing(runs, key):
    for res in runs:
        _same(res[key]["padded"], res[key]["slots256"])


@pytest.mark.distributed
@pytest.mark.parametrize("kind", ["greedy", "sampled"])
def test_rollout_tp2_equals_tp1(runs, kind):
    for res in runs:
        _same(res[f"{kind}_tp2"]["slots256"], res[f"{kind}_tp1"]["slots256"])


def test_bucket_choice():
    from hybridrl.rollout.cuda_graphs import bucket_for, bucket_sizes

    assert bucket_sizes(1) == [1]
    assert bucket_sizes(5) == [1, 2, 4, 5]
    assert bucket_sizes(256) == [1, 2, 4, 8, 16, 32, 64, 128, 256]
    buckets = bucket_sizes(48)
    assert [bucket_for(n, buckets) for n in (1, 2, 3, 5, 17, 32, 33, 48)] == [1, 2, 4, 8, 32, 32, 48, 48]
    with pytest.raises(ValueError, match="exceed"):
        bucket_for(49, buckets)
