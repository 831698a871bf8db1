"""A damaged checkpoint never crash-loops a requeued job: what the writer lists in meta.json at publish, how
trainer.resume_mode picks the newest intact checkpoint, what the keep rule spares, what a failed load names.

The checkpoints here are small: two gloo ranks save through CheckpointWriter with a stand-in actor part (files
named as dist_checkpointing names them) beside the real RNG streams and batch in flight; tests/test_checkpoint.py
and tests/test_checkpoint_reshard.py damage the runs they already make (colocated, split placement, TP 2 async).
"""
import json
import os
import shutil

import pytest

from hybridrl.checkpoint import CheckpointError, CheckpointManager, choose_checkpoint
from hybridrl.checkpoint.integrity import FILES, list_files, record

SHARDS = {"__0_0.distcp": 3000, "__1_0.distcp": 2000, ".metadata": 500, "common.pt": 300}


def _write_actor(folder):
    """A stand-in actor part, each rank writing its own shard as dist_checkpointing does."""
    import torch.distributed as dist

    rank = dist.get_rank()
    for name, size in SHARDS.items():
        if name.startswith(f"__{rank}_") or (rank == 0 and not name.startswith("__")):
            with open(os.path.join(folder, name), "wb") as f:
                f.write(os.urandom(size))


def _save_two_steps(root):
    from hybridrl.checkpoint import CheckpointWriter

    writer = CheckpointWriter(CheckpointManager(root))
    for step in (1, 2):
        writer.save(step, {}, {"data": {"batch_index": step}}, {"in_flight.pt": {"rows": [step]}},
                    others={"actor": _write_actor})


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """Steps 1 and 2 written by 2 ranks (actor part, rng/rank_0000{0,1}.pt, in_flight.pt, meta.json)."""
    from dist_helper import run_distributed

    root = tmp_path_factory.mktemp("saved") / "ckpt"
    run_distributed(_save_two_steps, 2, str(root))
    return root


def _copy(saved, tmp_path):
    root = tmp_path / "ckpt"
    shutil.copytree(saved, root)
    return root, CheckpointManager(str(root))


def flip_byte(path, at):
    """Invert the byte at offset `at` of a file: same size, other bytes."""
    with open(path, "r+b") as f:
        f.seek(at)
        byte = f.read(1)
        f.seek(at)
        f.write(bytes([byte[0] ^ 0xFF]))


# damage done to global_step_2, and what the warning says
DAMAGE = {
    "truncated shard": (lambda s: os.truncate(s / "actor" / "__1_0.distcp", 1000),
                        "actor/__1_0.distcp (model and optimizer shards) is 1000 bytes, 2000 were saved"),
    "missing shard": (lambda s: os.remove(s / "actor" / "__0_0.distcp"),
                      "actor/__0_0.distcp (model and optimizer shards) is missing"),
    "flipped bytes": (lambda s: flip_byte(s / "actor" / "__0_0.distcp", 1234),
                      "actor/__0_0.distcp (model and optimizer shards) holds other bytes than were saved (crc32"),
    "missing rng": (lambda s: shutil.rmtree(s / "rng"), "its rng part is gone"),
    "missing rng of one rank": (lambda s: os.remove(s / "rng" / "rank_00001.pt"),
                                "rng/rank_00001.pt (the RNG streams of rank 00001) is missing"),
    "missing optimizer part": (lambda s: os.remove(s / "actor" / "common.pt"),
                               "actor/common.pt (the optimizer's settings and step counts) is missing"),
    "missing batch in flight": (lambda s: os.remove(s / "in_flight.pt"),
                                "in_flight.pt (the batch in flight) is missing"),
    "empty step folder": (lambda s: [shutil.rmtree(s), os.makedirs(s)], "it has no meta.json; the folder is empty"),
}


def test_publish_lists_every_file_of_every_part(saved):
    """Written by both ranks (each digesting every other file), listed before the folder was renamed."""
    step = saved / "global_step_2"
    files = json.loads((step / "meta.json").read_text())[FILES]
    assert sorted(files) == list_files(str(step), skip=("meta.json",)) == [
        "actor/.metadata", "actor/__0_0.distcp", "actor/__1_0.distcp", "actor/common.pt", "in_flight.pt",
        "rng/rank_00000.pt", "rng/rank_00001.pt"]
    assert files == record(str(step), files)
    assert files["actor/__1_0.distcp"]["bytes"] == 2000


@pytest.mark.parametrize("damage", list(DAMAGE))
def test_auto_skips_a_damaged_newest_checkpoint(saved, tmp_path, capsys, damage):
    root, ckpt = _copy(saved, tmp_path)
    hurt, reason = DAMAGE[damage]
    hurt(root / "global_step_2")
    assert choose_checkpoint(ckpt, "auto", digests=True) == str(root / "global_step_1")
    warnings = [line for line in capsys.readouterr().err.splitlines() if line.startswith("warning:")]
    assert len(warnings) == 1 and f"{root / 'global_step_2'} ({reason}" in warnings[0], warnings
    assert f"resuming from {root / 'global_step_1'}" in warnings[0]
    assert (root / "global_step_2").is_dir()  # never deleted


def test_digests_switch_and_sizes_always(saved, tmp_path):
    root, ckpt = _copy(saved, tmp_path)
    flip_byte(root / "global_step_2" / "actor" / "__0_0.distcp", 7)
    assert choose_checkpoint(ckpt, "auto", digests=False) == str(root / "global_step_2")  # same size: not seen
    os.truncate(root / "global_step_2" / "actor" / "common.pt", 10)
    assert choose_checkpoint(ckpt, "auto", digests=False) == str(root / "global_step_1")


def test_explicit_damaged_and_none_intact(saved, tmp_path):
    root, ckpt = _copy(saved, tmp_path)
    os.truncate(root / "global_step_2" / "rng" / "rank_00000.pt", 5)
    with pytest.raises(CheckpointError, match=r"global_step_2 is damaged: rng/rank_00000.pt \(the RNG streams of "
                       r"rank 00000\) is 5 bytes, .*; intact checkpoints there \(file sizes checked\): "
                       rf"{root / 'global_step_1'}; pass one, or trainer.resume_mode=auto"):
        choose_checkpoint(ckpt, str(root / "global_step_2"), digests=True)
    shutil.copytree(root / "global_step_1", root / "global_step_3")
    shutil.rmtree(root / "global_step_3" / "rng")
    with pytest.raises(CheckpointError, match=r"global_step_3 is damaged: its rng part is gone; intact checkpoints "
                       rf"there \(file sizes checked\): {root / 'global_step_1'}; pass one"):
        choose_checkpoint(ckpt, str(root / "global_step_3"), digests=True)
    shutil.rmtree(root / "global_step_3")
    os.makedirs(root / "global_step_3")
    with pytest.raises(CheckpointError, match=r"global_step_3 is damaged: it has no meta.json; the folder is empty; "
                       r"intact checkpoints there"):
        choose_checkpoint(ckpt, str(root / "global_step_3"), digests=True)
    shutil.rmtree(root / "global_step_3")
    os.remove(root / "global_step_1" / "in_flight.pt")
    with pytest.raises(CheckpointError, match=r"global_step_2 is damaged: .*; no other checkpoint there is intact"):
        choose_checkpoint(ckpt, str(root / "global_step_2"), digests=True)
    with pytest.raises(CheckpointError, match=rf"no intact checkpoint under trainer.default_local_dir={root} to "
                       r"resume from: global_step_2: rng/rank_00000.pt .*; global_step_1: in_flight.pt \(the batch "
                       r"in flight\) is missing; move them aside"):
        choose_checkpoint(ckpt, "auto", digests=True)
    assert choose_checkpoint(CheckpointManager(str(tmp_path / "none")), "auto", digests=True) is None  # a fresh start


def test_checkpoint_without_a_file_list_loads_unverified(saved, tmp_path, capsys):
    root, ckpt = _copy(saved, tmp_path)
    meta = json.loads((root / "global_step_2" / "meta.json").read_text())
    del meta[FILES]
    (root / "global_step_2" / "meta.json").write_text(json.dumps(meta))
    os.truncate(root / "global_step_2" / "actor" / "common.pt", 10)  # unseen until it is loaded
    assert choose_checkpoint(ckpt, "auto", digests=True) == str(root / "global_step_2")
    note = "global_step_2 was saved before checkpoints listed their files: loading it unverified"
    assert note in capsys.readouterr().out


def _publish(ckpt, step):
    """A published step whose meta.json lists its files, as CheckpointWriter writes it."""
    tmp = ckpt.prepare(step)
    os.makedirs(os.path.join(tmp, "actor"))
    open(os.path.join(tmp, "actor", "shard"), "w").write(f"step {step}")
    ckpt.publish(step, {"roles": ["actor"], FILES: record(tmp, list_files(tmp))})


def test_keep_rule_counts_only_intact_checkpoints(tmp_path):
    """max_actor_ckpt_to_keep=2 keeps two intact actors; a damaged one between them is neither counted nor deleted."""
    ckpt = CheckpointManager(str(tmp_path), keep={"actor": 2})
    for step in (2, 4, 6):
        _publish(ckpt, step)
    os.truncate(tmp_path / "global_step_6" / "actor" / "shard", 1)
    _publish(ckpt, 8)
    assert sorted(ckpt.complete_steps()) == [4, 6, 8]


def test_keep_rule_spares_the_newest_intact_while_a_newer_one_is_damaged(tmp_path):
    """Step 4 is damaged before the prune after its publication runs: step 2, the newest intact, stays."""
    ckpt = CheckpointManager(str(tmp_path), keep=None)
    for step in (2, 4):
        _publish(ckpt, step)
    os.remove(tmp_path / "global_step_4" / "actor" / "shard")
    ckpt.keep = {"actor": 1}
    ckpt.prune(newest=4)
    assert sorted(ckpt.complete_steps()) == [2, 4] and os.listdir(tmp_path / "global_step_2" / "actor") == ["shard"]


def test_a_failed_load_names_step_part_and_file(saved, tmp_path):
    """What torch's loaders raise (EOFError inside a CheckpointException, a torn zip, a missing file) becomes one
    CheckpointError naming the step, the part and the file: from meta.json's list, else from the shard index of a
    checkpoint saved before files were listed, else from the error; any other error goes on unchanged."""
    import torch
    import torch.distributed.checkpoint as dcp

    from hybridrl.checkpoint import naming_damage

    root, _ = _copy(saved, tmp_path)
    step = root / "global_step_2"
    os.truncate(step / "in_flight.pt", 20)
    with pytest.raises(CheckpointError, match=rf"could not load the in_flight.pt part of {step}: in_flight.pt \(the "
                       r"batch in flight\) is 20 bytes, \d+ were saved; resume from another checkpoint"):
        with naming_damage(str(step), "in_flight.pt", path=str(step / "in_flight.pt")):
            torch.load(step / "in_flight.pt", weights_only=False)
    legacy = tmp_path / "legacy" / "global_step_1"  # meta.json without a file list, a real torch_dist shard
    dcp.save({"w": torch.arange(1000.0)}, checkpoint_id=str(legacy / "actor"), no_dist=True)
    os.truncate(legacy / "actor" / "__0_0.distcp", 100)
    (legacy / "meta.json").write_text("{}")
    with pytest.raises(CheckpointError, match=r"actor part of .*global_step_1: actor/__0_0.distcp \(model and "
                       r"optimizer shards\) is 100 bytes, its index needs \d+; pass another"):
        with naming_damage(str(legacy), "actor", "pass another"):
            dcp.load({"w": torch.zeros(1000)}, checkpoint_id=str(legacy / "actor"), no_dist=True)
    os.makedirs(legacy / "rng")
    (legacy / "rng" / "rank_00000.pt").write_bytes(b"PK\x03\x04 torn")
    with pytest.raises(CheckpointError, match=r"rng/rank_00000.pt \(the RNG streams of rank 00000\) cannot be read "
                       r"\(RuntimeError: PytorchStreamReader failed"):
        with naming_damage(str(legacy), "rng", path=str(legacy / "rng" / "rank_00000.pt")):
            torch.load(legacy / "rng" / "rank_00000.pt", weights_only=False)
    with pytest.raises(CheckpointError, match=r"could not load the actor part of .*: actor/common.pt \(the optimizer's "
                       r"settings and step counts\) is missing"):
        with naming_damage(str(legacy), "actor"):
            open(legacy / "actor" / "common.pt", "rb")
    with pytest.raises(KeyError, match="a bug"):
        with naming_damage(str(legacy), "actor"):
            raise KeyError("a bug")
