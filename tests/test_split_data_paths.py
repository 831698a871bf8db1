"""Split placement's data paths: each trainer DP group receives only its own rows (trimmed, int32 token ids),
the bytes that cross between roles (`perf/rows_bytes`, `perf/weight_sync_bytes`) against their formula, the
weights of each pipeline stage from a sender of its own, `perf/overlap` / `perf/idle/*` against a hand
computation from the run's own span timeline, and those late figures in the run's offline W&B history at the
step they belong to."""
import glob
import os
import re
import subprocess
import sys

import pytest
import torch

import wandb_files
from test_split_placement import _hf_weights
from test_trainer import ROOT, TINY, _overrides, _torchrun, read_scalars

from hybridrl.rollout.base import RolloutOutput
from hybridrl.trainer.rollout_rows import compact_rows, full_rows, group_messages, merge_messages, tensor_bytes

PAD = 0


def bytes_by_stream(hf: dict, num_layers: int, pp: int, num_experts: int = 0, ep: int = 1) -> dict:
    """{(stage, EP rank): bytes of the HF tensors its weight stream carries}, by hand from the names: layer i
    on stage i // (num_layers / pp), the embedding on the first stage, the final norm and the head on the
    last; expert e from EP rank e // (num_experts / ep), everything else from EP rank 0."""
    out = {}
    for name, t in hf.items():
        layer, expert = re.match(r"model\.layers\.(\d+)\.", name), re.search(r"\.experts\.(\d+)\.", name)
        stage = int(layer.group(1)) // (num_layers // pp) if layer else 0 if "embed_tokens" in name else pp - 1
        key = (stage, int(expert.group(1)) // (num_experts // ep) if expert else 0)
        out[key] = out.get(key, 0) + t.numel() * t.element_size()
    return out


def shard_bytes_by_stream(hf: dict, num_layers: int, pp: int, tp: int) -> dict:
    """{(stage, TP rank): bytes of the megatron shards its weight stream carries} (shard to shard: trainer TP =
    rollout TP), by hand from the HF tensors: the embedding and the head padded to a multiple of 128 x tp rows,
    norms whole on every TP rank, every other tensor split evenly over TP."""
    out = {}
    for (stage, _), _ in bytes_by_stream(hf, num_layers, pp).items():
        for rank in range(tp):
            out[(stage, rank)] = 0
    for name, t in hf.items():
        (stage, _), = bytes_by_stream({name: t}, num_layers, pp)
        size = t.numel() * t.element_size()
        if "embed_tokens" in name or name == "lm_head.weight":
            size = -(-t.shape[0] // (128 * tp)) * 128 * tp * t.shape[1] * t.element_size()
        for rank in range(tp):
            out[(stage, rank)] += size if "norm" in name else size // tp
    return out


def _output(lengths, width=6):
    """Rows whose response i holds lengths[i] real tokens (ids 10 + column), right-padded to `width`."""
    rows = len(lengths)
    mask = torch.tensor([[1.0 if j < n else 0.0 for j in range(width)] for n in lengths])
    ids = torch.where(mask > 0, torch.arange(width).expand(rows, width) + 10, torch.full((rows, width), PAD))
    routes = torch.arange(rows * (3 + width), dtype=torch.int16).reshape(rows, 3 + width, 1, 1)  # 3 prompt columns
    return RolloutOutput(ids.long(), mask, torch.randn(rows, width) * mask, {"rollout/generated_tokens": 9},
                         routed_experts=routes)


def test_each_dp_group_gets_its_rows_trimmed_and_int32():
    """A chunk of prompts 1..4 (n = 2) cut for DP groups of prompts [0, 2) and [2, 5): rows of prompts
    1 and 2, 3 and 4 each, cut at their own widest row, token ids int32 and masks bool; merged back, the
    whole chunk as the engine gave it (the checkpoint of an in-flight batch)."""
    out = _output([1, 2, 1, 1, 5, 3, 2, 1])
    msg = {"lo": 1, "hi": 5, "n": 2, "version": 3, "last": True, "out": out, "spans": []}
    parts = dict(group_messages(msg, [2, 3]))
    a, b = parts[0], parts[1]
    assert (a["lo"], a["hi"], b["lo"], b["hi"]) == (1, 2, 2, 5)
    assert a["out"].responses.shape == (2, 2) and b["out"].responses.shape == (6, 5)
    assert a["out"].responses.dtype == torch.int32 and a["out"].response_mask.dtype == torch.bool
    torch.testing.assert_close(full_rows(b["out"]).responses, out.responses[2:, :5])
    torch.testing.assert_close(full_rows(b["out"]).log_probs, out.log_probs[2:, :5])
    torch.testing.assert_close(a["out"].routed_experts, out.routed_experts[:2, :3 + 2])  # prompt + its 2 columns
    # bytes: 2 x 2 and 6 x 5 tokens of 4 (ids) + 1 (mask) + 4 (log-prob) bytes, routes 2 bytes a column
    routes = (2 * 5 + 6 * 8) * 2
    assert tensor_bytes(a["out"]) + tensor_bytes(b["out"]) == (2 * 2 + 6 * 5) * 9 + routes
    whole = merge_messages([[a], [b]], PAD)[0]
    assert (whole["lo"], whole["hi"]) == (1, 5)
    torch.testing.assert_close(whole.pop("out").responses, out.responses[:, :5])
    # a group without prompts in the chunk gets an empty message (it still learns the answer ended)
    empty = dict(group_messages(msg, [1, 4, 0]))[2]
    assert empty["lo"] == empty["hi"] and empty["out"].responses.shape[0] == 0
    assert compact_rows(_output([0, 0])).responses.shape == (2, 0)


def test_a_group_of_rows_crosses_without_the_rest_of_its_batch():
    """torch.save writes a view's whole storage: one DP group's message of a 64-row chunk (2 of its rows), and a
    critic DP group's half of the batch columns, serialize to about their own tensor bytes, not the batch's."""
    from hybridrl.parallel.split_world import serialize
    from hybridrl.trainer.split_critic import _rows_of

    msg = {"lo": 0, "hi": 32, "n": 2, "version": 0, "last": True, "out": _output([4] * 64, width=256), "spans": []}
    mine = dict(group_messages(msg, [1, 31]))[0]  # the chunk's log-probs alone are 64 x 256 x 4 = 64 KiB
    assert serialize(mine).numel() < tensor_bytes(mine["out"]) + 8192
    columns = {"values": (torch.randn(64, 512), torch.float32), "input_ids": (torch.ones(64, 512).int(), torch.long)}
    half = _rows_of({"kind": "values", "batch": columns}, 2, 1)
    torch.testing.assert_close(half["batch"]["values"][0], columns["values"][0][32:])
    assert serialize(half).numel() < 32 * 512 * 8 + 8192


# 2 trainers (DP 2) + 2 rollout ranks (one engine at rollout TP 2), staleness 1, 3 steps: rows per DP group,
# the weights once per update, the timeline written for the hand computation of the overlap, an offline W&B run
DP2_TP2 = ["placement.mode=split", "placement.rollout_world_size=2", "rollout.tensor_model_parallel_size=2",
           "async_training.staleness_threshold=1", "trainer.total_training_steps=3",
           "trainer.logger=[console,tensorboard,wandb]"]


@pytest.fixture(scope="module")
def dp2_tp2(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("dp2_tp2")
    _torchrun(tmp, 4, DP2_TP2 + [f"trainer.timeline_dir={tmp}/tl", f"trainer.export_hf_dir={tmp}/hf"],
              env={"WANDB_MODE": "offline"})
    return tmp


@pytest.mark.slow
def test_bytes_between_roles_follow_their_formula(dp2_tp2):
    """perf/rows_bytes: 4 prompts x n 2 = 8 rows, each trainer rank (one per DP group) receives its 4 rows of
    4 response tokens (max_response_length; some row of each group reaches it), 9 bytes a token (int32 id,
    bool mask, fp32 log-prob): 8 x 4 x 9 = 288 bytes, where the whole batch as int64/float32 to every member
    of the control bridge (3) was 8 x 4 x 16 x 3 = 1536 (torch.save headers aside). perf/weight_sync_bytes:
    every HF tensor once, as the exported model holds them, for each update that went out: update 2's never
    did (batch 3 was already generated, and update 3's replaced it before any batch needed it)."""
    scalars = read_scalars(dp2_tp2)
    assert scalars["response_length/max"] == {1: 4.0, 2: 4.0, 3: 4.0}
    assert scalars["perf/rows_bytes"] == {1: 288.0, 2: 288.0, 3: 288.0}
    weights = sum(t.numel() * t.element_size() for t in _hf_weights(dp2_tp2 / "hf").values())
    assert scalars["perf/weight_sync_bytes"] == {1: weights, 2: 0.0, 3: weights}
    assert set(scalars["perf/weight_sync_sender_max_bytes"].values()) == {weights}  # one stage: one sender (DP 0)


def _shares_by_hand(events, step):
    """(overlap, idle trainer, idle rollout) of `step` on trainer rank 0, by sweeping the elementary
    segments between all span edges: a rank computes in a segment when a span covers it whose name is not a
    wait or the weight transfer, and no such wait or transfer span covers it."""
    marks = {e["name"]: e["ts"] for e in events if e["ph"] == "i" and e["tid"] == 0}
    lo, hi = marks[f"step {step}"], marks[f"step {step} end"]
    spans = [(e["tid"], e["name"], e["ts"], e["ts"] + e["dur"]) for e in events if e["ph"] == "X"]
    rollout = {tid for tid, _, _, _ in spans if tid >= 2}
    assert rollout == {2, 3}
    edges = sorted({lo, hi} | {t for _, _, s, e in spans for t in (s, e) if lo < t < hi})

    def computes(tid, t):
        idle = [n.startswith("wait") or n == "update_weights" for r, n, s, e in spans if r == tid and s <= t < e]
        return bool(idle) and not any(idle)

    both = mine = theirs = 0.0
    for s, e in zip(edges, edges[1:]):
        mid = (s + e) / 2
        t, r = computes(0, mid), any(computes(tid, mid) for tid in rollout)
        both, mine, theirs = both + (e - s) * (t and r), mine + (e - s) * t, theirs + (e - s) * r
    width = hi - lo
    return both / width, 1 - mine / width, 1 - theirs / width, width


@pytest.mark.slow
def test_overlap_and_idle_by_hand_from_the_timeline(dp2_tp2):
    """Every step's perf/overlap and perf/idle/* (logged under that step, the last one too) equal the hand
    computation over that step's window on the run's timeline; the rollout ranks did compute while the
    trainer did (staleness 1), and weights in transit count as no one's compute."""
    from hybridrl.timeline import read_trace

    scalars = read_scalars(dp2_tp2)
    events = read_trace(str(dp2_tp2 / "tl" / "timeline.json"))
    assert {e["name"] for e in events if e["ph"] == "X" and e["tid"] >= 2} >= {"gen", "update_weights"}
    for step in (1, 2, 3):
        overlap, idle_trainer, idle_rollout, width = _shares_by_hand(events, step)
        # timestamps are epoch microseconds in float64 (a quantum of 0.25 us near 1.7e15): the run's sums and these,
        # over the same spans, may differ by a few quanta; 4 us over the window, a few parts in 1e5 of a step
        tol = max(1e-6, 4.0 / width)
        assert scalars["perf/overlap"][step] == pytest.approx(overlap, abs=tol)
        assert scalars["perf/idle/trainer"][step] == pytest.approx(idle_trainer, abs=tol)
        assert scalars["perf/idle/rollout"][step] == pytest.approx(idle_rollout, abs=tol)
    assert max(scalars["perf/overlap"].values()) > 0
    assert all(0 < scalars["perf/idle/trainer"][s] < 1 for s in (1, 2, 3))
    assert os.path.exists(dp2_tp2 / "hf")


@pytest.mark.slow
def test_late_figures_reach_wandb_at_their_step(dp2_tp2):
    """perf/overlap, perf/idle/* and perf/weight_sync_bytes of step k are logged after step k+1's row: the
    offline W&B run holds them at training/global_step k, the x axis of every chart, equal to TensorBoard's
    like every other scalar (`run.log(step=k)` below W&B's current step dropped those of steps 1 and 2)."""
    runs = glob.glob(str(dp2_tp2 / "tb" / "**" / "offline-run-*" / "run-*.wandb"), recursive=True)
    assert len(runs) == 1, runs
    history, scalars = wandb_files.history(runs[0]), read_scalars(dp2_tp2)
    assert sorted(history) == [1, 2, 3]
    for tag, by_step in scalars.items():
        for step, value in by_step.items():
            assert history[step][tag] == pytest.approx(value, rel=1e-6), (tag, step)
    late = {"perf/overlap", "perf/idle/trainer", "perf/idle/rollout", "perf/weight_sync_bytes"}
    assert all(late <= set(history[step]) for step in (1, 2, 3))
    axes = wandb_files.step_metrics(runs[0])  # define_metric: every chart's x is the logged global step
    assert axes["*"] == "training/global_step" and set(axes.values()) == {"training/global_step"}, axes


PP2_SPLIT = ["placement.mode=split", "placement.rollout_world_size=1", "parallel.pipeline_model_parallel_size=2",
             "model.tie_word_embeddings=false"]


@pytest.mark.slow
def test_each_pipeline_stage_sends_its_own_weights(tmp_path):
    """Trainers at PP 2 (2 ranks) and one rollout rank, synchronous, 2 steps: each stage's DP-0/TP-0 rank sends
    its own stage's tensors over a bridge of its own, both at once, verified by the rollout rank (fingerprints
    of what it received and of what its engine stored), in buckets of 20 KiB: many per stream, two in flight.
    At TP 1 on both sides they go shard to shard: megatron tensors as the engine holds them (the vocabulary
    padded to 128 rows). Per update the two streams carry every tensor once
    and the larger one exactly the larger stage's bytes by hand (stage 1: layer 1, the norm and the head; with
    the total that pins both: rank 0 no longer sends stage 1's tensors; that no stage receives another's is
    test_reshard's stage-stream test). Batch 2, generated with update 1's weights, agrees with the trainer's
    log-probs as batch 1 does (the engine holds them)."""
    _torchrun(tmp_path, 3, PP2_SPLIT + ["trainer.total_training_steps=2", "rollout.update_weights_bucket_mb=0.02",
                                        f"trainer.export_hf_dir={tmp_path}/hf"])
    scalars = read_scalars(tmp_path)
    streams = shard_bytes_by_stream(_hf_weights(tmp_path / "hf"), 2, 2, 1)
    assert set(streams) == {(0, 0), (1, 0)} and streams[(1, 0)] > streams[(0, 0)], streams
    assert scalars["perf/weight_sync_bytes"] == {1: sum(streams.values()), 2: sum(streams.values())}
    assert scalars["perf/weight_sync_sender_max_bytes"] == {1: streams[(1, 0)], 2: streams[(1, 0)]}
    # 20 KiB buckets: each stream's ~160 KB go in >= 6 buckets (the embedding or the head, fc1 and fc2 alone, the
    # rest between them) through its two buffers, each reused after a wait (13 in all)
    assert min(scalars["perf/weight_sync_buckets"].values()) >= 12, scalars["perf/weight_sync_buckets"]
    assert max(scalars["rollout/logprob_diff_mean"].values()) < 1e-4, scalars["rollout/logprob_diff_mean"]


@pytest.mark.slow
@pytest.mark.parametrize("rollout_tp,verdict", [(1, "differs from what was sent"),  # shard to shard
                                                (2, "differs from what it received")])  # HF tensors, resharded
def test_a_bad_store_of_one_stage_stops_every_trainer_rank(tmp_path, rollout_tp, verdict):
    """PP 2 in split placement, one rank a process (as srun starts them), the engine storing one tensor of stage 1
    wrongly (tests/corrupt_store.py): the first sync stops both trainer ranks, each with the same one `error:`
    line naming that tensor; stage 0's sender learns it from the rollout ranks' verdict like stage 1's. At
    rollout TP 1 the shards go as they are, at rollout TP 2 (two rollout ranks) as HF tensors."""
    from dist_helper import free_port

    bad = "model.layers.1.mlp.down_proj.weight"
    script = [os.path.join(os.path.dirname(__file__), "corrupt_store.py"), "--config", TINY]
    env = dict(os.environ, OMP_NUM_THREADS="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()),
               CORRUPT_TENSOR=bad)
    os.makedirs(tmp_path, exist_ok=True)
    world = 2 + rollout_tp
    layout = PP2_SPLIT + [f"placement.rollout_world_size={rollout_tp}",
                          f"rollout.tensor_model_parallel_size={rollout_tp}"]
    logs = [tmp_path / f"out{r}.log" for r in range(world)]
    procs = [subprocess.Popen([sys.executable] + script + _overrides(tmp_path, layout), cwd=ROOT,
                              stdout=open(logs[r], "w"), stderr=subprocess.STDOUT,
                              env=dict(env, RANK=str(r), WORLD_SIZE=str(world), LOCAL_RANK=str(r)))
             for r in range(world)]
    try:
        codes = [p.wait(timeout=240) for p in procs[:2]]
    finally:
        for p in procs:
            p.kill()
    errors = [[line for line in log.read_text().splitlines() if line.startswith("error:")] for log in logs[:2]]
    assert codes[0] != 0 and codes[1] != 0, codes
    assert len(errors[0]) == 1 and errors[0] == errors[1], errors
    assert errors[0][0].startswith(f"error: engine's stored copy of '{bad}'"), errors  # not "rollout rank 2 died"
    assert verdict in errors[0][0], errors


class _RecordingCritic:
    """The critic ranks' worker as `_serve` drives it: values of zeros, the update's batch kept."""

    def compute_values(self, batch, batching):
        return torch.zeros(batch["response_mask"].shape)

    def update_critic(self, batch, rows, batching, apply):
        self.batch = batch
        return {}


def test_the_remote_critic_trains_on_the_mask_rejection_left():
    """Trainer side (RemoteCritic's requests) and critic side (`_serve`) of one step, the bridge left out: the
    values request, then rejection sampling replacing the response mask (trainer/rollout_correction.py), then
    the update. The critic's update must see the replaced mask (it saw the one from before the rejection, held
    from the values request); with the mask unchanged only the returns cross again."""
    import types

    from hybridrl.trainer.split_critic import RemoteCritic, _serve

    groups = types.SimpleNamespace(dp=1, dp_rank=0, device=torch.device("cpu"))
    batching = types.SimpleNamespace(critic_values=None, critic_update=None)
    for rejected in (True, False):
        critic, sent = RemoteCritic.__new__(RemoteCritic), []
        critic.groups, critic.sent, critic.sent_mask, critic.on_wait = groups, None, None, None
        critic._send = sent.append
        mask = torch.ones(2, 3)
        batch = {"input_ids": torch.arange(12).view(2, 6), "attention_mask": torch.ones(2, 6), "response_mask": mask}
        critic.request_values(batch)
        if rejected:
            batch["response_mask"] = torch.tensor([[1.0, 1.0, 1.0], [0.0, 0.0, 0.0]])
        batch["returns"] = torch.randn(2, 3)
        critic.request_update(batch)
        worker, held = _RecordingCritic(), {}
        for msg in sent:
            _serve(msg, worker, groups, held, batching, 2)
        assert set(sent[1]["batch"]) == ({"returns", "response_mask"} if rejected else {"returns"})
        torch.testing.assert_close(worker.batch["response_mask"], batch["response_mask"])
        torch.testing.assert_close(worker.batch["returns"], batch["returns"])
