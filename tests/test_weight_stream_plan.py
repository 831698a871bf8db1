"""A split-placement weight sender whose stream departs from the bucket plan it sent at the first sync (the
bucket size or the model's tensors changed): every rank ends that sync with one HandoffError naming it, none
waits forever, and the next sync that follows the plan delivers the weights again."""
from datetime import timedelta

import pytest

from dist_helper import free_port, run_distributed

BUCKET_MB = 0.05  # several buckets of the tiny model


def _split_pair(port: int):
    """Rank 0 a trainer, rank 1 a rollout rank, each the only rank of its role world, joined by one weights bridge."""
    import torch.distributed as dist

    from hybridrl.parallel import liveness
    from hybridrl.parallel.split_world import Bridge, SplitWorld

    rank = dist.get_rank()
    dist.destroy_process_group()  # the role worlds replace the launch's world, as init_split_world makes them
    store = dist.TCPStore("127.0.0.1", port, 2, rank == 0, timedelta(seconds=60))
    liveness.start(store, rank, 2, 60)
    world = SplitWorld(rank, 2, 1, store, timedelta(seconds=60))
    dist.init_process_group("gloo", store=dist.PrefixStore(f"role/{world.role}", store), rank=0, world_size=1)
    return rank, Bridge(world, "weights/0", [0, 1])


def _syncs(port: int, folder: str):
    import torch

    from hybridrl.models import hf_convert as hc
    from hybridrl.models.hf_checkpoint import SafetensorsReader, model_from_hf
    from hybridrl.models.hf_config import spec_from_hf_config
    from hybridrl.parallel import liveness
    from hybridrl.parallel.distributed import init_model_parallel
    from hybridrl.placement.readback import HandoffError
    from hybridrl.placement.transport import WeightReceiver, WeightSender
    from hybridrl.rollout.native import NativeEngine

    rank, bridge = _split_pair(port)
    try:
        if rank == 0:
            groups = init_model_parallel(1, 1)
            model, spec = model_from_hf(folder, groups)
            sender = WeightSender(bridge, (0, 0, 0), groups, spec, BUCKET_MB, "fingerprint")
            out = {"buckets": sender.send(model, 1)["perf/weight_sync_buckets"]}
            for version, bucket_bytes in ((2, 1), (3, 2 ** 30)):  # each tensor alone; the whole model in one
                sender.bucket_bytes = bucket_bytes
                try:
                    sender.send(model, version)
                    out[version] = "no error"
                except HandoffError as err:
                    out[version] = str(err)
            sender.bucket_bytes = int(BUCKET_MB * 2 ** 20)
            with torch.no_grad():
                for p in model.parameters():
                    p.add_(1.0)
            out["buckets_after"] = sender.send(model, 4)["perf/weight_sync_buckets"]
            return out
        spec = spec_from_hf_config(folder)
        engine = NativeEngine(spec, 1)
        receiver = WeightReceiver([bridge], "fingerprint")
        versions = [receiver.receive(engine) for _ in range(4)]
        reader = SafetensorsReader(folder)
        rows = lambda t: t[:spec.vocab_size]  # noqa: E731 (the HF tensors hold no vocabulary padding)
        shifted = all(torch.equal(rows(engine.params[n]), rows(hc.read_shard(n, reader, spec, 1, 0)) + 1.0)
                      for _, n in hc.stage_names(spec, 1, 0))
        return {"versions": versions, "weights_after": shifted}
    finally:
        liveness.stop()


@pytest.mark.distributed
def test_a_stream_off_its_plan_ends_the_sync_with_one_error(tmp_path):
    """Sync 2 cuts every tensor into a bucket of its own, sync 3 puts the model in one: the sender (from the
    rollout rank's verdict) names the departure, the rollout rank finishes each sync; sync 4, on the plan
    again, carries the changed weights. Before the fault path the sender raised alone at bucket 0 and the
    rollout rank waited on that bucket until the sender's process was gone."""
    from hybridrl.models.hf_checkpoint import random_hf_model_folder

    folder = random_hf_model_folder(str(tmp_path / "m"), "qwen2", num_hidden_layers=2)
    trainer, rollout = run_distributed(_syncs, 2, free_port(), folder, timeout=120)
    assert trainer["buckets"] > 2 and trainer["buckets_after"] == trainer["buckets"], trainer
    assert "departed from the bucket plan" in trainer[2] and " holds " in trainer[2], trainer[2]
    assert "departed from the bucket plan" in trainer[3] and "bucket 0 holds" in trainer[3], trainer[3]
    assert rollout == {"versions": [1, 2, 3, 4], "weights_after": True}, rollout


def _bf16_syncs(port: int, folder: str):
    """A bf16 model of the local spec (its norms keep fp32 weights) over the HF-bucket stream, then shard to
    shard, each into a bf16 engine: the trainer's export, and the engine's tensors after each sync."""
    import torch

    from hybridrl.models.hf_checkpoint import mcore_to_hf_stream, model_from_hf
    from hybridrl.models.hf_config import spec_from_hf_config
    from hybridrl.parallel import liveness
    from hybridrl.parallel.distributed import init_model_parallel
    from hybridrl.placement.transport import WeightReceiver, WeightSender
    from hybridrl.rollout.native import NativeEngine

    rank, bridge = _split_pair(port)
    try:
        if rank == 0:
            groups = init_model_parallel(1, 1)
            model, spec = model_from_hf(folder, groups, dtype="bfloat16", layer_spec="local")
            with torch.no_grad():  # norms off the bf16 grid: a cast to bf16 on the way would change them
                for name, p in model.named_parameters():
                    p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(len(name))) * 1e-3)
            dtypes = {str(p.dtype) for p in model.parameters()}
            for shards in (False, True):
                WeightSender(bridge, (0, 0, 0), groups, spec, BUCKET_MB, "fingerprint", shards).send(model, 1)
            return {"dtypes": dtypes, "export": {k: v.clone() for k, v in mcore_to_hf_stream(model, spec, groups)}}
        spec = spec_from_hf_config(folder)
        out = {}
        for shards in (False, True):
            engine = NativeEngine(spec, 1, dtype="bfloat16")
            WeightReceiver([bridge], "fingerprint", (spec, 1, 0) if shards else None).receive(engine)
            out[shards] = {n: t.clone() for n, t in engine.params.items()}
        return out
    finally:
        liveness.stop()


@pytest.mark.distributed
def test_a_bf16_model_with_fp32_norms_arrives_exact_on_both_streams(tmp_path):
    """Each tensor travels in its own dtype: the fp32 norms beside bf16 weights arrive bit for bit on the
    HF-bucket stream and shard to shard. Before, a bucket was packed in its first tensor's dtype: the norms were
    cast to bf16 (the transport check failed) or, first in a bucket, taken for a departure from the plan."""
    import torch

    from hybridrl.models import hf_convert as hc
    from hybridrl.models.hf_checkpoint import random_hf_model_folder
    from hybridrl.models.hf_config import spec_from_hf_config

    folder = random_hf_model_folder(str(tmp_path / "m"), "qwen2", num_hidden_layers=2)
    trainer, rollout = run_distributed(_bf16_syncs, 2, free_port(), folder, timeout=120)
    assert trainer["dtypes"] == {"torch.bfloat16", "torch.float32"}, trainer["dtypes"]
    spec, reader = spec_from_hf_config(folder), hc.DictReader(trainer["export"])
    for shards, params in rollout.items():
        norms = [n for n in params if n.endswith("layernorm.weight")]
        assert norms and all(params[n].dtype == torch.float32 for n in norms), (shards, norms)
        rows = lambda t: t[:spec.vocab_size]  # noqa: E731 (the export holds no vocabulary padding)
        differ = [n for n, t in params.items() if not torch.equal(rows(t), rows(hc.read_shard(n, reader, spec, 1, 0)))]
        assert not differ, (shards, differ)


def _norms_sent_in_bf16(folder: str) -> dict:
    """What a rollout rank's checks say of a bucket from a Transformer Engine trainer in bf16 (its norms are bf16)
    stored by a bf16 engine of the local spec (whose norms are fp32): the HF stream's and the shard stream's."""
    import torch

    from hybridrl.models import hf_convert as hc
    from hybridrl.models.hf_checkpoint import SafetensorsReader
    from hybridrl.models.hf_config import spec_from_hf_config
    from hybridrl.parallel.distributed import init_model_parallel
    from hybridrl.placement.transport import WeightReceiver
    from hybridrl.rollout.native import NativeEngine

    init_model_parallel(1, 1)
    spec, reader = spec_from_hf_config(folder), SafetensorsReader(folder)
    hf_bucket = [(n, reader.read(n).to(torch.bfloat16)) for n in reader.names()]
    shard_bucket = [(g, hc.read_shard(g, reader, spec, 1, 0).to(torch.bfloat16)) for _, g in hc.stage_names(spec, 1, 0)]
    out = {}
    for key, bucket, shards in (("hf", hf_bucket, None), ("shards", shard_bucket, (spec, 1, 0))):
        engine = NativeEngine(spec, 1, dtype="bfloat16")
        out[key] = WeightReceiver([], "fingerprint", shards)._load(engine, bucket, [])
        out[key + "_norm_dtypes"] = {str(t.dtype) for g, t in engine.params.items() if g.endswith("layernorm.weight")}
    return out


def test_a_te_trainers_bf16_norms_pass_the_check_into_fp32_norms(tmp_path):
    """The rollout rank digests what it received as the engine stores it (`readback.as_stored`), as the colocated
    bucket path does: bf16 norms into the local spec's fp32 ones are exact, not a fault. Before, both checks named
    every norm (the bf16 digest against the engine's fp32 one): a GPU split run with TE failed every sync."""
    from hybridrl.models.hf_checkpoint import random_hf_model_folder

    folder = random_hf_model_folder(str(tmp_path / "m"), "qwen2", num_hidden_layers=2)
    out = run_distributed(_norms_sent_in_bf16, 1, folder, timeout=120)[0]
    assert out["hf_norm_dtypes"] == out["shards_norm_dtypes"] == {"torch.float32"}, out
    assert (out["hf"], out["shards"]) == ([], []), out
