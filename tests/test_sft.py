"""SFT: trajectories -> ids and assistant-only loss mask, bad data, a loss independent of TP/PP/DP, HF export."""
import os
import subprocess
import sys

import pytest
import torch

from dist_helper import run_distributed
from hybridrl.config import MultiTurnConfig, SFTConfig
from hybridrl.data.prompts import DataError, write_prompt_parquet
from hybridrl.data.tool_demos import demonstration_rows, write_demonstrations
from hybridrl.rollout.agent_loop import AgentLoop
from hybridrl.rollout.base import SamplingParams
from hybridrl.sft.data import SFTDataset, SFTLoader, tokenize_trajectory
from hybridrl.tokenizer import TINY_TOOLS_SPEC, load_tokenizer
from test_agent_loop import ScriptedEngine, calls_then_copies

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOOLS_CONFIG = os.path.join(ROOT, "configs", "tiny_cpu_tools.yaml")
TOK = load_tokenizer(TINY_TOOLS_SPEC)


def test_demonstration_is_exactly_the_agent_loop_trajectory():
    """SFT teaches the very tokens (and loss mask) a multi-turn rollout produces."""
    (row,) = demonstration_rows(1, seed=3)
    ids, mask = tokenize_trajectory(TOK, row["messages"])
    prompt = TOK.encode(TOK.apply_chat_template(row["messages"][:1]))
    loop = AgentLoop(MultiTurnConfig(enable=True), TOK)
    out = loop.generate(ScriptedEngine(calls_then_copies), [prompt], SamplingParams(max_new_tokens=100))
    n = int(out.attention_mask.sum())
    assert ids == prompt + out.responses[0, :n].tolist()
    assert mask == [0] * len(prompt) + out.response_mask[0, :n].int().tolist()


def test_turns_between_assistant_messages_and_trailing_messages():
    messages = [{"role": "system", "content": "s"}, {"role": "user", "content": "q"},
                {"role": "assistant", "content": "a"}, {"role": "tool", "content": "t"},
                {"role": "user", "content": "u"}, {"role": "assistant", "content": "b"},
                {"role": "user", "content": "ignored"}]
    ids, mask = tokenize_trajectory(TOK, messages)
    head = TOK.encode(TOK.apply_chat_template(messages[:2]))
    middle = TOK.encode(TOK.continuation_text(messages[3:5]))
    eos = TOK.eos_token_id
    assert ids == head + TOK.encode("a") + [eos] + middle + TOK.encode("b") + [eos]
    assert mask == [0] * len(head) + [1, 1] + [0] * len(middle) + [1, 1]


def _cfg(**kw):
    return SFTConfig(**{"train_batch_size": 4, "max_length": 128, **kw})


@pytest.mark.parametrize("rows,fragment", [
    ([{"messages": "hello"}], "row 0 column 'messages': must be a non-empty list"),
    ([{"messages": [{"role": "user"}]}], "message 0 needs a string 'role' and 'content'"),
    ([{"messages": [{"role": "user", "content": "q"}]}], "at least one assistant message"),
    ([{"messages": [{"role": "assistant", "content": "a"}]}], "needs a prompt message"),
    ([{"other": 1}], "has no column 'messages'"),
])
def test_bad_rows_name_file_row_and_fix(tmp_path, rows, fragment):
    path = write_prompt_parquet(rows, str(tmp_path / "bad.parquet"))
    with pytest.raises(DataError, match=fragment) as e:
        SFTDataset([path], TOK, _cfg())
    assert path in str(e.value) and ("demonstration_rows" in str(e.value) or "messages_key" in str(e.value))


def test_messages_key_names_the_column(tmp_path):
    rows = demonstration_rows(4, seed=6)
    default = write_prompt_parquet(rows, str(tmp_path / "messages.parquet"))
    renamed = write_prompt_parquet([{"conversation": r["messages"]} for r in rows], str(tmp_path / "conv.parquet"))
    with pytest.raises(DataError, match="has no column 'messages'"):
        SFTDataset([renamed], TOK, _cfg())
    want = next(iter(SFTLoader(SFTDataset([default], TOK, _cfg()), 4, 0, 1, False, 0)))
    got = next(iter(SFTLoader(SFTDataset([renamed], TOK, _cfg(messages_key="conversation")), 4, 0, 1, False, 0)))
    for key in ("input_ids", "attention_mask", "loss_mask"):
        assert torch.equal(got[key], want[key]), key


def test_bad_files_long_rows_and_small_data(tmp_path):
    with pytest.raises(DataError, match="does not exist; fix sft.train_files or set sft.synthetic_task"):
        SFTDataset([str(tmp_path / "missing.parquet")], TOK, _cfg())
    (tmp_path / "text.parquet").write_text("not parquet")
    with pytest.raises(DataError, match="is not a parquet file"):
        SFTDataset([str(tmp_path / "text.parquet")], TOK, _cfg())
    path = write_demonstrations(str(tmp_path / "demo.parquet"), n=6, seed=1)
    with pytest.raises(DataError, match="no trajectories left .* raise sft.max_length"):
        SFTDataset([path], TOK, _cfg(max_length=20))
    dataset = SFTDataset([path], TOK, _cfg())
    with pytest.raises(DataError, match="fewer than one batch of 8"):
        SFTLoader(dataset, 8, 0, 1, True, 0)
    with pytest.raises(DataError, match="not divisible by the data parallel size 4"):
        SFTLoader(dataset, 6, 0, 4, True, 0)
    fixed, drawn = SFTLoader(dataset, 2, 0, 1, True, 5), SFTLoader(dataset, 2, 0, 1, True, 9, seed_drawn=True)
    fixed.resume_seed(5)
    drawn.resume_seed(5)
    assert fixed.seed == drawn.seed == 5  # the same seed resumes; a drawn one takes the checkpoint's
    with pytest.raises(DataError, match=r"shuffled with seed 7, this run has data.seed=5; resume with data.seed=7"):
        fixed.resume_seed(7)


def test_loader_slices_are_the_global_batch(tmp_path):
    dataset = SFTDataset([write_demonstrations(str(tmp_path / "demo.parquet"), n=8, seed=2)], TOK, _cfg())
    whole = next(iter(SFTLoader(dataset, 4, 0, 1, True, 3)))
    halves = [next(iter(SFTLoader(dataset, 4, r, 2, True, 3))) for r in (0, 1)]
    for key in ("input_ids", "attention_mask", "loss_mask"):
        assert torch.equal(whole[key], torch.cat([h[key] for h in halves])), key
    assert (whole["loss_mask"] <= whole["attention_mask"]).all() and whole["loss_mask"].sum() > 0


def test_missing_data_is_one_error_line(tmp_path):
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "train_sft.py"), "--config", TOOLS_CONFIG,
                           f"sft.train_files=[{tmp_path}/none.parquet]", "sft.synthetic_task=''",
                           f"trainer.default_local_dir={tmp_path}/ckpt"],
                          capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "error: SFT data file" in proc.stderr and "Traceback" not in proc.stderr


# ---- distributed: the same loss at every layout, and an HF folder transformers loads ------------------

STEPS = 3


def _sft_overrides(root):
    return [f"sft.train_files=[{root}/demo.parquet]", "sft.train_batch_size=16", "sft.micro_batch_size_per_gpu=4",
            "sft.max_length=128", f"trainer.default_local_dir={root}/init", "trainer.logger=[console]"]


def _sft_steps(root, layouts, export_layout=None):
    """For each (tp, pp): SFT losses and grad norms of STEPS steps from one init; HF export at one layout."""
    import torch.distributed as dist

    from hybridrl.config.io import load_config
    from hybridrl.sft.trainer import SFTTrainer, sft_loader
    from models_helper import mcore_logits, reinit_parallel

    cfg = load_config(TOOLS_CONFIG, _sft_overrides(root))
    out = {}
    for tp, pp in layouts:
        groups = reinit_parallel(tp, pp)
        torch.manual_seed(0)
        trainer = SFTTrainer(cfg, groups, TOK, STEPS)
        loader = iter(sft_loader(cfg, TOK, groups))
        metrics = [trainer.step(next(loader)) for _ in range(STEPS)]
        out[(tp, pp)] = [(m["sft/loss"], m["sft/grad_norm"], m["sft/tokens"]) for m in metrics]
        if (tp, pp) == export_layout:
            trainer.save(f"{root}/hf")
            held_out = sft_loader(cfg, TOK, groups, [f"{root}/val.parquet"])  # verl's val/loss of the saved weights
            out["val_loss"] = trainer.validate(held_out.one_pass())["val/loss"]
            out["val_batches"] = [{k: b[k] for k in ("input_ids", "attention_mask", "loss_mask")}
                                  for b in held_out.one_pass()]
            raw = next(loader)
            batch = {"input_ids": raw["input_ids"], "attention_mask": raw["attention_mask"].long()}
            out["batch"], out["loss_mask"] = batch, raw["loss_mask"]
            out["logits"] = mcore_logits(trainer.engine.module, trainer.spec, groups, batch)
            out["loss"] = trainer.step(raw)["sft/loss"]  # the loss of the saved weights (it steps after)
    return out if dist.get_rank() == 0 else None


def test_loss_equal_at_tp2_pp2_dp2_and_hf_export(tmp_path):
    write_demonstrations(str(tmp_path / "demo.parquet"), n=64, seed=5)
    write_demonstrations(str(tmp_path / "val.parquet"), n=40, seed=6)  # 2 batches of 16 (8 rows left out)
    (reference,) = run_distributed(_sft_steps, 1, str(tmp_path), [(1, 1)])
    parallel = run_distributed(_sft_steps, 2, str(tmp_path), [(1, 1), (2, 1), (1, 2)], (2, 1))[0]
    ref = reference[(1, 1)]
    assert ref[-1][0] < ref[0][0]  # it learns
    for layout in ((1, 1), (2, 1), (1, 2)):  # DP 2, TP 2, PP 2
        for step, ((loss, norm, tokens), (ref_loss, ref_norm, ref_tokens)) in enumerate(zip(parallel[layout], ref)):
            tol = 1e-5 if step == 0 else 1e-4  # later steps carry the first one's rounding through Adam
            assert tokens == ref_tokens
            assert loss == pytest.approx(ref_loss, rel=tol), (layout, step)
            assert norm == pytest.approx(ref_norm, rel=tol * 10), (layout, step)
    # the folder written at TP 2 loads in transformers (model and tokenizer) with the same logits
    from models_helper import hf_logits

    folder = str(tmp_path / "hf")
    expected = hf_logits(folder, parallel["batch"])
    real = parallel["batch"]["attention_mask"].bool()
    assert torch.allclose(parallel["logits"][real], expected[real], atol=1e-4, rtol=1e-4)
    # the SFT loss is the cross-entropy of the next token, averaged over the assistant tokens of the batch
    targets, mask = parallel["batch"]["input_ids"][:, 1:], parallel["loss_mask"][:, 1:].double()
    nll = -torch.log_softmax(expected[:, :-1].double(), -1).gather(-1, targets[..., None]).squeeze(-1)
    assert 0 < mask.sum() < real[:, 1:].sum()  # prompts and tool output are not trained on
    assert parallel["loss"] == pytest.approx(((nll * mask).sum() / mask.sum()).item(), rel=1e-5)
    # val/loss: the same cross-entropy over every assistant token of the held-out batches, weighted by their tokens
    nll_sum = tokens = 0.0
    assert len(parallel["val_batches"]) == 2
    for b in parallel["val_batches"]:
        logits = hf_logits(folder, {"input_ids": b["input_ids"], "attention_mask": b["attention_mask"].long()})
        lp = torch.log_softmax(logits[:, :-1].double(), -1).gather(-1, b["input_ids"][:, 1:, None]).squeeze(-1)
        nll_sum, tokens = nll_sum - (lp * b["loss_mask"][:, 1:]).sum().item(), tokens + b["loss_mask"][:, 1:].sum().item()
    assert parallel["val_loss"] == pytest.approx(nll_sum / tokens, rel=1e-5)
    saved = load_tokenizer(folder)
    assert saved.encode('<tool_call>{"a": 1}</tool_call>') == TOK.encode('<tool_call>{"a": 1}</tool_call>')
    assert not os.path.exists(folder + ".tmp") and not os.path.exists(folder + ".old")


def test_epochs_decide_the_length_unless_steps_are_set():
    """As verl's SFT trainer (total_training_steps null): sft.total_epochs alone sets the run's length; a set
    sft.total_training_steps decides alone (it was 100 by default, so total_epochs=3 ran 100 steps)."""
    from hybridrl.sft.trainer import sft_steps

    assert sft_steps(_cfg(total_epochs=3), batches_per_epoch=2) == 6
    assert sft_steps(_cfg(total_epochs=3, total_training_steps=5), batches_per_epoch=2) == 5


def test_sft_run_ends_when_its_epochs_do_as_verls_loop():
    """verl's SFT trainer loops over total_epochs and returns at total_training_steps: whichever comes first (the
    data was reused past the epochs here); the LR schedule spans total_training_steps; 4 epochs by default."""
    from hybridrl.sft.trainer import sft_run_steps, sft_steps

    assert (sft_run_steps(_cfg(total_epochs=1, total_training_steps=10), 7),
            sft_steps(_cfg(total_epochs=1, total_training_steps=10), 7)) == (7, 10)
    assert sft_run_steps(_cfg(total_epochs=2, total_training_steps=10), 7) == 10
    assert sft_run_steps(_cfg(), 7) == 28


def test_openai_tool_calls_are_trained_as_the_agent_loops_text():
    """An assistant turn with OpenAI-style `tool_calls` (content None) tokenizes as the same turn with the Hermes
    <tool_call> text the agent loop parses (they were dropped: an empty turn was trained); a malformed call is one
    DataError naming it."""
    from hybridrl.data.prompts import DataError
    from hybridrl.data.tool_demos import tool_call_text
    from hybridrl.sft.data import _check_messages, tokenize_trajectory
    from hybridrl.tokenizer import load_tokenizer

    tok = load_tokenizer("builtin:tiny_tools")
    tail = [{"role": "tool", "content": "391"}, {"role": "assistant", "content": "391"}]
    openai = [{"role": "user", "content": "23*17="},
              {"role": "assistant", "content": None, "tool_calls": [
                  {"type": "function", "function": {"name": "calculator", "arguments": '{"expression": "23*17"}'}}]}]
    hermes = [{"role": "user", "content": "23*17="}, {"role": "assistant", "content": tool_call_text("23*17")}]
    got = tokenize_trajectory(tok, _check_messages(openai + tail, "row 0"))
    assert got == tokenize_trajectory(tok, _check_messages(hermes + tail, "row 0"))
    assert sum(got[1]) > 2 * len("391")  # the call's text is trained, not only the two answers
    bad = [openai[0], {"role": "assistant", "content": None, "tool_calls": [{"function": {"arguments": "{"}}]}]
    with pytest.raises(DataError, match="row 0: message 1: tool call .* needs a function name"):
        _check_messages(bad, "row 0")
