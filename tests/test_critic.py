"""Critic: values at TP=2 and PP=2 equal TP=1; a reward model's score head initialises the value head
and reproduces transformers' per-token scores; gradients flow through the pipeline schedule."""
import pytest
import torch

from dist_helper import run_distributed

from models_helper import ragged_batch, reinit_parallel

from hybridrl.models.hf_checkpoint import random_hf_model_folder

LAYOUTS = [(1, 1), (2, 1), (1, 2)]


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("critic")
    kw = dict(model_type="qwen2", num_hidden_layers=2, vocab_size=251)
    return {"lm": random_hf_model_folder(str(root / "lm"), seed=3, **kw),
            "score": random_hf_model_folder(str(root / "rm"), seed=4, head="score", **kw),
            "v_head": random_hf_model_folder(str(root / "vh"), seed=5, head="v_head", model_type="llama")}


def _critic_run(folders):
    from hybridrl.models.critic import critic_from_hf
    from hybridrl.models.forward import pipeline_forward

    out = {}
    for tp, pp in LAYOUTS:
        groups = reinit_parallel(tp, pp)
        for kind, folder in folders.items():
            model, spec, source = critic_from_hf(folder, groups, seed=7)
            batch = ragged_batch(spec.vocab_size)
            w = torch.linspace(-1, 1, batch["input_ids"].numel()).reshape(batch["input_ids"].shape)

            def loss_fn(values, mb):
                return (values * w).sum(), {"values": values.detach()}
            res = pipeline_forward(model, [batch], loss_fn, forward_only=False)
            if groups.is_last_stage and groups.tp_rank == 0 and groups.dp_rank == 0:
                head = model.output_layer.value_head
                out[(tp, pp, kind)] = dict(values=res[0]["values"], source=source, weight=head.weight.detach(),
                                           grad=head.weight.grad.clone(), dtype=res[0]["values"].dtype)
    return out


def _hf_token_scores(folder, batch):
    import transformers

    model = transformers.AutoModelForSequenceClassification.from_pretrained(folder, attn_implementation="eager")
    pos = (batch["attention_mask"].cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        h = model.model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                        position_ids=pos).last_hidden_state
        return model.score(h).squeeze(-1)


@pytest.mark.distributed
def test_critic_layouts_agree_and_reward_head_is_used(folders):
    merged = {}
    for r in run_distributed(_critic_run, 2, folders):
        merged.update(r)
    assert set(merged) == {(tp, pp, k) for tp, pp in LAYOUTS for k in folders}
    batch = ragged_batch(251)
    valid = batch["attention_mask"].bool()
    for kind in folders:
        ref = merged[(1, 1, kind)]
        assert ref["values"].shape == batch["input_ids"].shape and ref["dtype"] == torch.float32
        for tp, pp in LAYOUTS[1:]:
            got = merged[(tp, pp, kind)]
            torch.testing.assert_close(got["values"][valid], ref["values"][valid], atol=1e-5, rtol=0,
                                       msg=f"{kind} tp={tp} pp={pp}")
            torch.testing.assert_close(got["grad"], ref["grad"], atol=1e-4, rtol=1e-4, msg=f"{kind} grad")
    assert merged[(1, 1, "lm")]["source"] is None
    assert merged[(1, 1, "score")]["source"] == "score.weight"
    assert merged[(2, 1, "v_head")]["source"] == "v_head.summary.weight"
    scores = _hf_token_scores(folders["score"], batch)
    torch.testing.assert_close(merged[(1, 1, "score")]["values"][valid], scores[valid], atol=1e-4, rtol=0)


def test_value_head_rejects_multi_label_score():
    from hybridrl.models.critic import ValueHead, load_value_head
    from hybridrl.models.hf_convert import DictReader

    class Holder(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.output_layer = ValueHead(8)

    with pytest.raises(ValueError, match=r"'score\.weight' has shape \[2, 8\], expected shape \[1, 8\]"):
        load_value_head(Holder(), DictReader({"score.weight": torch.zeros(2, 8)}))
