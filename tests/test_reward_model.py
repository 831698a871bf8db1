"""Reward model: scores equal transformers' *ForSequenceClassification at TP 1/2 and PP 1/2 on ragged
left/right-padded batches, the same when re-encoded for the RM's own tokenizer (chat template) and
after an offload round trip; pooling, mixing, config and folder errors; preference pairs."""
from types import SimpleNamespace

import pytest
import torch

from dist_helper import run_distributed
from models_helper import reinit_parallel

from hybridrl.config import Config, ConfigError, DataConfig, RewardModelConfig
from hybridrl.models.hf_checkpoint import CheckpointMismatchError, random_hf_model_folder

LAYOUTS = [(1, 1), (2, 1), (1, 2)]
PAD = 3  # the RMs' config pad_token_id: a real token id of builtin:tiny (<unk>), so it may appear inside text
P, R = 6, 5


def _rm_tokenizer_folder(folder):
    """An HF tokenizer unlike builtin:tiny: other ids (reversed), other specials, a chat template with bos."""
    from tokenizers import Regex, decoders, models, pre_tokenizers
    from tokenizers import Tokenizer as RawTokenizer
    from transformers import PreTrainedTokenizerFast

    chars = "0123456789+-*/= abcdefghijklmnopqrstuvwxyz.,?!:()\n<>|"[::-1]
    vocab = {c: i for i, c in enumerate(chars)}
    vocab.update({t: len(vocab) + i for i, t in enumerate(("[PAD]", "[EOS]", "[BOS]", "[UNK]"))})
    raw = RawTokenizer(models.WordLevel(vocab=vocab, unk_token="[UNK]"))
    raw.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    raw.decoder = decoders.Fuse()
    hf = PreTrainedTokenizerFast(tokenizer_object=raw, pad_token="[PAD]", eos_token="[EOS]", bos_token="[BOS]",
                                 unk_token="[UNK]")
    hf.chat_template = ("{{ bos_token }}{% for m in messages %}<{{ m['role'] }}|{{ m['content'] }}>{% endfor %}"
                        "{% if add_generation_prompt %}<assistant|{% endif %}")
    hf.save_pretrained(folder)
    return folder, len(vocab), vocab["[PAD]"]


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("rm")
    kw = dict(head="score", vocab_size=60, pad_token_id=PAD)
    tok_folder, tok_vocab, tok_pad = _rm_tokenizer_folder(str(root / "rm_tokenizer"))
    return {"qwen2": random_hf_model_folder(str(root / "qwen2"), "qwen2", seed=1, num_hidden_layers=4, **kw),
            "llama": random_hf_model_folder(str(root / "llama"), "llama", seed=2, tie_word_embeddings=True, **kw),
            "qwen3_moe": random_hf_model_folder(str(root / "qwen3_moe"), "qwen3_moe", seed=6, **kw),
            "own_tokenizer": random_hf_model_folder(str(root / "own"), "qwen2", seed=3, head="score",
                                                    vocab_size=tok_vocab, pad_token_id=tok_pad),
            "tokenizer": tok_folder, "lm": random_hf_model_folder(str(root / "lm"), "qwen2", seed=4),
            "small_vocab": random_hf_model_folder(str(root / "small"), "qwen2", seed=5, head="score", vocab_size=40)}


def ppo_batch(seed=0):
    """Rows as PPO assembles them: left-padded prompts | right-padded responses, padding = PAD. Row 2's
    response ends in a real token equal to PAD (scored one token earlier), row 3's response is empty."""
    g = torch.Generator().manual_seed(seed)
    prompt_len, resp_len = torch.tensor([6, 3, 4, 2]), torch.tensor([5, 2, 4, 0])
    pmask = (torch.arange(P)[None] >= (P - prompt_len)[:, None]).long()
    rmask = (torch.arange(R)[None] < resp_len[:, None]).long()
    prompts = torch.where(pmask.bool(), torch.randint(4, 54, (4, P), generator=g), PAD)
    responses = torch.where(rmask.bool(), torch.randint(4, 54, (4, R), generator=g), PAD)
    responses[2, 3] = PAD
    return {"input_ids": torch.cat([prompts, responses], 1), "attention_mask": torch.cat([pmask, rmask], 1),
            "responses": responses, "response_mask": rmask.float()}


MESSAGES = [[{"role": "user", "content": "3+4="}], [{"role": "system", "content": "be brief"},
            {"role": "user", "content": "12+1="}], [{"role": "user", "content": "x"}], [{"role": "user", "content": "9"}]]
RESPONSES = ["7", "13 and more", "", "nine!"]


def _config(folder, tokenizer="", offload=False):
    """max_length 128 keeps every re-encoded conversation whole (the reference does not truncate)."""
    return Config(data=DataConfig(tokenizer="builtin:tiny"), reward_model=RewardModelConfig(
        enable=True, path=folder, tokenizer=tokenizer, micro_batch_size_per_gpu=2, offload_params=offload,
        max_length=128))


def _scores_run(folders):
    from hybridrl.trainer.roles import build_reward_model
    from hybridrl.tokenizer import load_tokenizer

    actor_tok = load_tokenizer("builtin:tiny")
    out = {}
    for tp, pp in LAYOUTS:
        groups = reinit_parallel(tp, pp)
        for kind in ("qwen2", "llama", "qwen3_moe"):
            worker = build_reward_model(_config(folders[kind], offload=kind == "llama"), groups, actor_tok)
            if worker.offloader is not None:  # offloaded at build; scores are the same after the round trip
                freed = all(p.untyped_storage().nbytes() == 0 for p in worker.engine.module.parameters())
                worker.offloader.onload()
                out[(tp, pp, "offload_freed")] = freed
            out[(tp, pp, kind)] = worker.compute_rm_score(ppo_batch(), MESSAGES, RESPONSES)
        reencoding = _config(folders["own_tokenizer"], tokenizer=folders["tokenizer"])
        worker = build_reward_model(reencoding, groups, actor_tok)
        out[(tp, pp, "own_tokenizer")] = worker.compute_rm_score(ppo_batch(), MESSAGES, RESPONSES)
        if (tp, pp) == (1, 2):
            out["errors"] = [_error(build_reward_model, _config(folders["small_vocab"]), groups, actor_tok),
                             _error(build_reward_model, _config(folders["qwen2"], tokenizer=folders["lm"] + "_none"),
                                    groups, actor_tok)]
    return out


def _error(fn, *args):
    try:
        fn(*args)
    except Exception as err:
        return f"{type(err).__name__}: {err}"
    return None


def _hf_scores(folder, batch):
    import transformers

    model = transformers.AutoModelForSequenceClassification.from_pretrained(folder, attn_implementation="eager")
    with torch.no_grad():
        return model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits[:, 0]


def _hf_reencoded_scores(folders):
    """Independent reference: transformers' tokenizer renders and encodes each conversation, one row at a time."""
    import transformers

    tok = transformers.AutoTokenizer.from_pretrained(folders["tokenizer"])
    model = transformers.AutoModelForSequenceClassification.from_pretrained(folders["own_tokenizer"],
                                                                            attn_implementation="eager")
    scores = []
    for messages, response in zip(MESSAGES, RESPONSES):
        text = tok.apply_chat_template(messages + [{"role": "assistant", "content": response}], tokenize=False,
                                       add_generation_prompt=False)
        ids = tok(text, add_special_tokens=False, return_tensors="pt").input_ids
        assert ids[0, 0] == tok.bos_token_id
        with torch.no_grad():
            scores.append(model(input_ids=ids).logits[0, 0])
    return torch.stack(scores)


@pytest.mark.distributed
def test_scores_equal_transformers_at_tp_pp_and_reencoded(folders):
    merged = {}
    for part in run_distributed(_scores_run, 2, folders):
        merged.update(part)
    batch = ppo_batch()
    for kind in ("qwen2", "llama", "qwen3_moe"):  # MoE at TP 2 too: the frozen reward model only runs inference
        ref = _hf_scores(folders[kind], batch)
        for tp, pp in LAYOUTS:
            torch.testing.assert_close(merged[(tp, pp, kind)], ref, atol=1e-4, rtol=0, msg=f"{kind} tp={tp} pp={pp}")
    reencoded = _hf_reencoded_scores(folders)
    for tp, pp in LAYOUTS:
        assert merged[(tp, pp, "offload_freed")]
        torch.testing.assert_close(merged[(tp, pp, "own_tokenizer")], reencoded, atol=1e-4, rtol=0)
    vocab, tokenizer = merged["errors"]
    assert vocab.startswith("ConfigError: the reward model's vocabulary (40 tokens) is smaller than the tokenizer's (54")
    assert tokenizer.startswith("TokenizerError: reward_model.tokenizer: ")


def test_score_positions_follow_transformers_pooling_rule():
    from hybridrl.workers.reward_model import score_positions

    ids = torch.tensor([[0, 0, 5, 6, 7], [5, 6, 0, 0, 0], [5, 0, 6, 0, 0], [0, 0, 0, 0, 0], [5, 6, 7, 0, 9]])
    mask = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 0, 0, 0], [1, 1, 1, 1, 0], [0, 0, 0, 0, 0], [1, 1, 1, 1, 1]])
    # transformers: the rightmost id != pad_token_id (here 0); row 2 ends in a real pad-id token
    assert score_positions(ids, mask, 0).tolist() == [4, 1, 2, 0, 4]
    hf = (torch.arange(5) * (ids != 0)).argmax(-1)
    assert score_positions(ids, mask, 0).tolist() == hf.tolist()
    # no pad id in the config: the last real token
    assert score_positions(ids, mask, None).tolist() == [4, 1, 3, 0, 4]


def test_reencoder_keeps_the_end_of_long_conversations():
    from hybridrl.tokenizer import load_tokenizer
    from hybridrl.workers.reward_model import ChatReencoder

    tok = load_tokenizer("builtin:tiny")
    enc = ChatReencoder(tok, max_length=5, pad_token_id=tok.pad_token_id)
    full = tok.encode(tok.apply_chat_template(MESSAGES[1] + [{"role": "assistant", "content": "13"}],
                                              add_generation_prompt=False))
    assert enc.encode(MESSAGES[1], "13") == full[-5:] and tok.decode(full[-2:]) == "13"
    out = enc([MESSAGES[0], MESSAGES[1]], ["7", "13"], torch.device("cpu"))
    assert out["input_ids"].shape == (2, 5) and out["attention_mask"][0].tolist() == [1, 1, 1, 1, 1]


def test_no_reencoder_for_the_runs_own_tokenizer():
    """reward_model.tokenizer naming the tokenizer the run already uses (data.tokenizer as given, or what an unset one
    resolves to) reads the actor's ids: no second tokenizer, no re-encoding (with data.tokenizer unset, an explicit
    builtin:tiny was taken for another tokenizer); a different one re-encodes."""
    from hybridrl.config.io import load_config
    from hybridrl.workers.reward_model import build_reencoder

    for same in (["reward_model.tokenizer=builtin:tiny"],
                 ["reward_model.tokenizer=builtin:tiny", "data.tokenizer=builtin:tiny"], []):
        assert build_reencoder(load_config("", same), 0) is None, same
    assert build_reencoder(load_config("", ["reward_model.tokenizer=builtin:tiny_tools"]), 0) is not None


def test_combine_scores():
    from hybridrl.rewards import RewardError, combine_scores

    rule, rm = torch.tensor([1.0, 0.0, 0.3]), torch.tensor([-2.0, 0.5, 4.0])
    assert combine_scores(None, rm, "replace").tolist() == rm.tolist()
    torch.testing.assert_close(combine_scores(rule, rm, "add"), torch.tensor([-1.0, 0.5, 4.3]))
    with pytest.raises(RewardError, match="combine=add needs one rule score per response"):
        combine_scores(rule[:2], rm, "add")


def test_config_and_folder_errors(folders, tmp_path):
    from hybridrl.config.io import load_config
    from hybridrl.trainer.roles import build_reward_model

    with pytest.raises(ConfigError, match="reward_model.combine='mean' is not one of replace, add"):
        load_config("", ["reward_model.combine=mean"])
    with pytest.raises(ConfigError, match="reward_model.enable=true needs reward_model.path.*train_rm.py"):
        load_config("", ["reward_model.enable=true"])
    with pytest.raises(ConfigError, match=r"reward_model.path='.*missing' has no config.json; train one"):
        build_reward_model(_config(str(tmp_path / "missing")), None, None)
    with pytest.raises(CheckpointMismatchError, match="has no reward head.*ForSequenceClassification"):
        build_reward_model(_config(folders["lm"]), None, None)


def test_preference_pairs_are_ordered_by_the_rule():
    from hybridrl.data.synthetic import arith_rows
    from hybridrl.reward_model.preference_pairs import make_pairs
    from hybridrl.rewards.arith import compute_score
    from hybridrl.tokenizer import load_tokenizer

    tok = load_tokenizer("builtin:tiny")
    rows = [SimpleNamespace(data_source=r["data_source"], ground_truth=r["reward_model"]["ground_truth"])
            for r in arith_rows(20, 0, "train")]
    pairs = make_pairs(rows, tok, 400, 6, seed=3)
    assert len(pairs) == 400
    numbers_only = 0
    for p in pairs:
        truth = rows[p.prompt].ground_truth  # ranked without the near-miss credit a policy is shaped by
        assert compute_score(tok.decode(p.chosen_ids), truth, near_miss=False) == p.chosen_score > p.rejected_score
        assert compute_score(tok.decode(p.rejected_ids), truth, near_miss=False) == p.rejected_score
        for ids in (p.chosen_ids, p.rejected_ids):  # a rollout's shape: stopped by eos, or cut at the limit
            assert 1 <= len(ids) <= 6 and (ids[-1] == tok.eos_token_id or len(ids) == 6)
            assert tok.eos_token_id not in ids[:-1] and tok.pad_token_id not in ids
        numbers_only += p.chosen_score == 1.0 and 0.1 <= p.rejected_score <= 0.3
    assert numbers_only > 100  # right vs wrong number pairs: what teaches the sum
    assert make_pairs(rows, tok, 10, 6, seed=3) == pairs[:10]


def _pp3_bf16_export(folder):
    """A local-spec bf16 reward model at PP 3 written as HF: the middle stage (its first parameter an fp32 norm)
    receives the score head from the last stage."""
    from hybridrl.models.critic import critic_from_hf, reward_model_hf_stream
    from hybridrl.models.hf_checkpoint import unwrap_model

    groups = reinit_parallel(1, 3)
    model, spec, _ = critic_from_hf(folder, groups, "bfloat16")
    first = str(next(unwrap_model(model).parameters()).dtype)
    head = unwrap_model(model).output_layer.value_head.weight.detach().clone() if groups.is_last_stage else None
    score = dict(reward_model_hf_stream(model, spec, groups))["score.weight"]
    return {"first": first, "score": score, "head": head}


def test_a_bf16_reward_model_at_pp3_exports_its_head(tmp_path):
    """Every stage gets the last stage's bf16 score head; the middle one posted an fp32 buffer before (its first
    parameter is a norm the local spec keeps in fp32), which the bf16 broadcast did not fill."""
    folder = random_hf_model_folder(str(tmp_path / "m"), "qwen2", num_hidden_layers=3)
    parts = run_distributed(_pp3_bf16_export, 3, folder, timeout=180)
    assert parts[1]["first"] == "torch.float32", parts[1]["first"]  # the case: a stage that starts with a norm
    head = parts[2]["head"]
    assert head.dtype == torch.bfloat16
    for part in parts:
        assert part["score"].dtype == torch.bfloat16 and torch.equal(part["score"], head), part["score"]
