"""3D resharding: training TP=2 x PP=2 (4 gloo processes) -> rollout engines at TP 1 and 2.

One launch does every handoff; the tests check bit-exact weights against the HF export, checksum
verification (and its failure modes), the measured peak memory bound, and that the vLLM adapter's
load_weights receives exactly the stream the native engine consumes.
"""
import types

import pytest
import torch

from dist_helper import run_distributed

BUCKET_MB = 40 / 1024  # 40 KiB: several tensors share a bucket; the (vocab-padded) embedding is alone
PROMPTS = [[5, 6, 7], [1, 2, 3, 4, 5, 6, 7], [9]]


class _CorruptingEngine:
    """Reports a wrong checksum for one tensor, or drops one tensor from its report."""

    def __init__(self, engine, name, mode):
        self.engine, self.name, self.mode = engine, name, mode

    def load_weights(self, weights):
        got = self.engine.load_weights(weights)
        if self.name in got:
            if self.mode == "drop":
                del got[self.name]
            else:
                got[self.name] = "0" * 32
        return got


class _FakeWorker:
    """Stands in for a vLLM worker: `model_runner.model.load_weights` records what it gets."""

    def __init__(self):
        self.received = []
        self.model_runner = types.SimpleNamespace(model=types.SimpleNamespace(load_weights=self._load))

    def _load(self, weights):
        self.received += [(n, t.clone()) for n, t in weights]
        return {n for n, _ in self.received}


class _FakeLLM:
    def __init__(self):
        self.worker = _FakeWorker()

    def collective_rpc(self, method, timeout=None, args=(), kwargs=None):
        return [method(self.worker, *args, **(kwargs or {}))]

    def reset_prefix_cache(self):
        return True


def _expected_shards(export, spec, tp, tp_rank):
    from hybridrl.models import hf_convert as hc

    reader = hc.DictReader(export)
    return {g: hc.read_shard(g, reader, spec, tp, tp_rank) for _, g in hc.stage_names(spec, 1, 0)}


def _handoffs(folder, tied_folder):
    from hybridrl import reshard
    from hybridrl.models.hf_checkpoint import SafetensorsReader, mcore_to_hf_stream, model_from_hf
    from hybridrl.parallel.distributed import init_model_parallel
    from hybridrl.rollout.base import SamplingParams
    from hybridrl.rollout.native import NativeEngine
    from hybridrl.rollout.vllm import VLLMEngine

    groups = init_model_parallel(2, 2)
    model, spec = model_from_hf(folder, groups)
    export = {n: t.clone() for n, t in mcore_to_hf_stream(model, spec, groups)}
    reader = SafetensorsReader(folder)
    res = {"export_is_checkpoint": all(torch.equal(t, reader.read(n)) for n, t in export.items()),
           "buckets": [[(n, t.clone()) for n, t in b]
                       for b in reshard.iter_hf_weights(model, spec, groups, int(BUCKET_MB * 2**20))],
           "export": export, "rank": groups.pp_rank * 2 + groups.tp_rank}
    for tp in (1, 2):
        engine = NativeEngine(spec, tp)
        res[f"report_tp{tp}"] = reshard.update_engine_weights(engine, model, spec, groups, BUCKET_MB)
        expected = _expected_shards(export, spec, tp, engine.groups.tp_rank)
        res[f"bit_exact_tp{tp}"] = all(torch.equal(engine.params[g], t) for g, t in expected.items())
        res[f"greedy_tp{tp}"] = engine.generate(PROMPTS, SamplingParams(temperature=0, max_new_tokens=6)).responses
    victim = "model.layers.1.self_attn.k_proj.weight"
    for mode in ("corrupt", "drop"):
        try:
            reshard.update_engine_weights(_CorruptingEngine(engine, victim, mode), model, spec, groups, BUCKET_MB)
            res[f"{mode}_error"] = None
        except reshard.HandoffError as e:
            res[f"{mode}_error"] = str(e)
    fake = _FakeLLM()
    res["vllm_report"] = reshard.update_engine_weights(VLLMEngine("unused", llm=fake), model, spec, groups, BUCKET_MB)
    res["vllm_received"] = fake.worker.received
    tied_model, tied_spec = model_from_hf(tied_folder, groups)
    tied_engine = NativeEngine(tied_spec, 2)
    reshard.update_engine_weights(tied_engine, tied_model, tied_spec, groups, BUCKET_MB)
    tied_export = dict(mcore_to_hf_stream(tied_model, tied_spec, groups))
    tied_expected = _expected_shards(tied_export, tied_spec, 2, tied_engine.groups.tp_rank)
    res["tied_bit_exact"] = all(torch.equal(tied_engine.params[g], t) for g, t in tied_expected.items())
    res["spec"] = spec
    return res


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    from hybridrl.models.hf_checkpoint import random_hf_model_folder

    folder = random_hf_model_folder(str(tmp_path_factory.mktemp("qwen2")), "qwen2", seed=5, num_hidden_layers=4)
    tied = random_hf_model_folder(str(tmp_path_factory.mktemp("tied")), "qwen2", seed=6, num_hidden_layers=2,
                                  tie_word_embeddings=True)
    return run_distributed(_handoffs, 4, folder, tied)


@pytest.mark.distributed
@pytest.mark.parametrize("tp", [1, 2])
def test_engine_weights_equal_hf_export_bit_for_bit(runs, tp):
    for res in runs:
        assert res["export_is_checkpoint"]
        assert res[f"bit_exact_tp{tp}"], f"rank {res['rank']}: rollout TP={tp} weights differ from the export"
        report = res[f"report_tp{tp}"]
        assert report.verified and report.num_tensors == len(res["export"])
    assert all(torch.equal(r["greedy_tp1"], runs[0]["greedy_tp1"]) for r in runs)
    assert all(torch.equal(r["greedy_tp2"], runs[0]["greedy_tp1"]) for r in runs)


@pytest.mark.distributed
def test_tied_embeddings_reshard(runs):
    assert all(r["tied_bit_exact"] for r in runs)


@pytest.mark.distributed
def test_buckets_are_bounded_and_cover_the_export(runs):
    from hybridrl.models import hf_convert as hc

    spec, cap = runs[0]["spec"], int(BUCKET_MB * 2**20)
    to_mcore = hc.mcore_to_hf_name_map(spec)
    for res in runs:
        flat = [pair for bucket in res["buckets"] for pair in bucket]
        assert [n for n, _ in flat] == list(res["export"]), "the stream must yield every HF tensor once, in order"
        assert all(torch.equal(t, res["export"][n]) for n, t in flat)
        for bucket in res["buckets"]:
            owners = {to_mcore[n][0] for n, _ in bucket}
            size = sum(torch.Size(hc.mcore_full_shape(g, spec, 2)).numel() * 4 for g in owners)
            assert size <= cap or len(owners) == 1, f"bucket of {size} bytes holds {len(owners)} tensors"
        assert any(len(b) > 3 for b in res["buckets"]) and any(len(b) == 1 for b in res["buckets"])


@pytest.mark.distributed
@pytest.mark.parametrize("tp", [1, 2])
def test_peak_memory_within_one_bucket_plus_largest_tensor(runs, tp):
    from hybridrl.models import hf_convert as hc

    spec, cap = runs[0]["spec"], int(BUCKET_MB * 2**20)
    largest = max(torch.Size(hc.mcore_full_shape(g, spec, 2)).numel() * 4 for g in hc.hf_to_mcore_name_map(spec))
    for res in runs:
        report = res[f"report_tp{tp}"]
        assert report.largest_tensor_bytes == largest
        assert 0 < report.peak_extra_bytes <= max(cap, report.max_bucket_bytes) + largest, report
        assert report.max_bucket_bytes <= max(cap, largest)


@pytest.mark.distributed
def test_checksum_mismatch_names_the_tensor(runs):
    for res in runs:
        assert "checksum mismatch" in res["corrupt_error"]
        assert "model.layers.1.self_attn.k_proj.weight" in res["corrupt_error"]
        assert "did not report" in res["drop_error"] and "k_proj" in res["drop_error"]


@pytest.mark.distributed
def test_vllm_adapter_receives_the_native_stream(runs):
    for res in runs:
        assert res["vllm_report"].verified
        received = res["vllm_received"]
        assert [n for n, _ in received] == list(res["export"])
        assert all(torch.equal(t, res["export"][n]) for n, t in received)


def test_live_tensor_meter_counts_storages_not_views():
    from hybridrl.reshard import LiveTensorMeter

    base = torch.zeros(1000)
    with LiveTensorMeter() as meter:
        a = torch.empty(256)            # 1 KiB new
        view = a[10:20]                 # a view: nothing new
        base.add_(1)                    # in place on an outside tensor: nothing new
        b = torch.cat([a, a])           # 2 KiB new
        del a, view
        c = b.clone()                   # 2 KiB new while b is alive (a is gone)
        del b, c
    assert meter.peak == 2048 + 2048 and meter.current == 0


def test_lean_tp_merge_equals_hf_convert_merge(monkeypatch):
    """reshard's in-buffer TP merges give hf_convert.merge_tp's layout for every split kind."""
    from hybridrl import reshard
    from hybridrl.models import hf_convert as hc

    g = torch.Generator().manual_seed(0)
    for name, shape in (("decoder.layers.0.mlp.linear_fc1.weight", (12, 5)),
                        ("decoder.layers.0.self_attention.linear_qkv.weight", (8, 5)),
                        ("decoder.layers.0.mlp.linear_fc2.weight", (5, 6))):
        shards = [torch.randn(shape, generator=g) for _ in range(2)]
        # a stand-in all-gather: rank-order concatenation along dim 0, as the collective does
        monkeypatch.setattr(reshard, "_all_gather_single", lambda out, shard, group: out.copy_(torch.cat(shards)))
        merged = reshard._gather_tp(name, shards[0], types.SimpleNamespace(tp=2, tp_group=None))
        assert torch.equal(merged, hc.merge_tp(name, shards)), name


def _join_cases():
    import torch.distributed as dist

    from hybridrl.reshard import join_requests, new_rollout_groups

    rank, groups = dist.get_rank(), new_rollout_groups(4)
    shard = [[10 + rank // 2, 1], [20 + rank // 2]]  # ranks (0, 1) and (2, 3): two training-DP shards
    seeds = [rank // 2, 100 + rank // 2]
    peers = join_requests(shard, seeds, groups)  # training TP 2 < rollout TP 4: peers bring the same
    one_source = join_requests(shard if rank % 2 == 0 else [], seeds if rank % 2 == 0 else [], groups)
    return peers, one_source


@pytest.mark.distributed
def test_join_requests_generates_each_contribution_once():
    out = run_distributed(_join_cases, 4)
    joint = [[10, 1], [20], [11, 1], [21]]
    for rank, (peers, one_source) in enumerate(out):
        assert peers[0] == joint and peers[1] == [0, 100, 1, 101]
        assert peers[2] == ((0, 2) if rank < 2 else (2, 4))
        assert one_source[0] == joint and one_source[1] == [0, 100, 1, 101]
        lo, hi = one_source[2]
        if rank % 2 == 0:
            assert (lo, hi) == ((0, 2) if rank == 0 else (2, 4))
        else:  # a rank that receives the result by broadcast owns an empty slice
            assert lo == hi
