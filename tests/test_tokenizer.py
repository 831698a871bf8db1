"""Tests of hybridrl.tokenizer: builtin:tiny, HF folders (with/without chat template), SentencePiece."""
import json
import os

import pytest

from hybridrl.tokenizer import (TINY_SPEC, TINY_TOOLS_SPEC, HFTokenizer, TokenizerError, build_tiny_hf_tokenizer,
                                load_tokenizer, plain_chat_template, save_tiny_tokenizer)

USER = [{"role": "user", "content": "3+4="}]


@pytest.fixture(scope="module")
def tiny():
    return load_tokenizer(TINY_SPEC)


def test_tiny_vocab_and_special_ids(tiny):
    assert tiny.vocab_size == 54 <= 64
    assert (tiny.pad_token_id, tiny.eos_token_id) == (0, 1)
    assert (tiny.hf.bos_token_id, tiny.hf.unk_token_id) == (2, 3)


def test_tiny_round_trip_is_one_token_per_char(tiny):
    text = "hello 3+4=7\nok, (a-b)*c/d? yes!: 9."
    ids = tiny.encode(text)
    assert len(ids) == len(text) and min(ids) >= 4
    assert tiny.decode(ids) == text
    assert tiny.decode(tiny.encode("User: Hi")) == "user: hi"  # lowercased, not <unk>


def test_tiny_decode_special_tokens(tiny):
    ids = tiny.encode("7") + [tiny.eos_token_id, tiny.pad_token_id]
    assert tiny.decode(ids) == "7"
    assert tiny.decode(ids, skip_special_tokens=False) == "7<eos><pad>"
    assert tiny.batch_decode([ids, tiny.encode("12")]) == ["7", "12"]


def test_tiny_chat_template_is_bare_content(tiny):
    assert tiny.has_chat_template
    assert tiny.apply_chat_template(USER) == "3+4="


def test_tiny_saves_and_loads_as_hf_folder(tiny, tmp_path):
    folder = save_tiny_tokenizer(str(tmp_path / "tiny"))
    assert os.path.isfile(os.path.join(folder, "tokenizer.json"))
    again = load_tokenizer(folder)
    text = "12+30=42 done."
    assert again.encode(text) == tiny.encode(text)
    assert (again.vocab_size, again.pad_token_id, again.eos_token_id) == (54, 0, 1)
    assert again.apply_chat_template(USER) == "3+4="
    assert load_tokenizer(os.path.join(folder, "tokenizer.json")).vocab_size == 54


def test_an_unset_data_tokenizer_is_the_models_own(tmp_path):
    """data.tokenizer empty (the default, verl's null): model.path's tokenizer where the folder has one, so a real
    checkpoint is never read with the tiny tokenizer (it was builtin:tiny whatever model.path said); builtin:tiny
    without a model.path or for a folder without a tokenizer; a set value is used as given."""
    from hybridrl.config.io import load_config
    from hybridrl.tokenizer import tokenizer_source

    model = save_tiny_tokenizer(str(tmp_path / "model"), tools=True)  # a model folder with its own tokenizer
    bare = tmp_path / "bare"
    bare.mkdir()
    assert load_config("", []).data.tokenizer == ""
    assert tokenizer_source("", model) == model
    assert load_tokenizer(tokenizer_source("", model)).vocab_size == load_tokenizer(TINY_TOOLS_SPEC).vocab_size != 54
    assert tokenizer_source("", str(bare)) == tokenizer_source("", "") == TINY_SPEC
    assert tokenizer_source(TINY_SPEC, model) == TINY_SPEC


THINKING = ("{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}{% if add_generation_prompt %}<assistant>"
            "{% if enable_thinking is defined and not enable_thinking %}<nothink>{% endif %}{% endif %}")


def test_chat_template_kwargs_reach_every_rendering(tmp_path):
    """data.apply_chat_template_kwargs (verl's key; Qwen3's enable_thinking=false): the prompt and the multi-turn
    continuation render with them; from the config's dotted override; refused for a tokenizer without a template."""
    from hybridrl.config.io import load_config

    cfg = load_config("", ["data.apply_chat_template_kwargs.enable_thinking=false"])
    assert cfg.data.apply_chat_template_kwargs == {"enable_thinking": False}
    folder = _hf_folder(tmp_path, THINKING)
    plain, quiet = load_tokenizer(folder), load_tokenizer(folder, "", cfg.data.apply_chat_template_kwargs)
    assert plain.apply_chat_template(USER) == "<user>3+4=<assistant>"
    assert quiet.apply_chat_template(USER) == "<user>3+4=<assistant><nothink>"
    tool = [{"role": "tool", "content": "7"}]
    assert plain.continuation_text(tool) == "<tool>7<assistant>" and quiet.continuation_text(tool) == "<tool>7<assistant><nothink>"
    with pytest.raises(TokenizerError, match="needs a tokenizer with a chat template"):
        load_tokenizer(_hf_folder(tmp_path / "none"), "", {"enable_thinking": False})


def _hf_folder(tmp_path, chat_template=None):
    """A tiny HF folder whose chat template (if any) lives in tokenizer_config.json."""
    folder = save_tiny_tokenizer(str(tmp_path / "hf"))
    jinja = os.path.join(folder, "chat_template.jinja")
    if os.path.exists(jinja):
        os.remove(jinja)
    cfg_path = os.path.join(folder, "tokenizer_config.json")
    with open(cfg_path) as f:
        cfg = json.load(f)
    cfg.pop("chat_template", None)
    if chat_template:
        cfg["chat_template"] = chat_template
    with open(cfg_path, "w") as f:
        json.dump(cfg, f)
    return folder


def test_tokenizer_provided_chat_template(tmp_path):
    template = ("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}"
                "{% if add_generation_prompt %}<assistant>{% endif %}")
    tok = load_tokenizer(_hf_folder(tmp_path, template))
    assert tok.has_chat_template
    assert tok.apply_chat_template(USER) == "<user>3+4=<assistant>"


def test_plain_chat_template_when_tokenizer_has_none(tmp_path):
    tok = load_tokenizer(_hf_folder(tmp_path))
    assert not tok.has_chat_template
    assert tok.apply_chat_template(USER) == "User: 3+4=\nAssistant:"
    messages = [{"role": "system", "content": "be brief"}] + USER
    assert plain_chat_template(messages) == "System: be brief\nUser: 3+4=\nAssistant:"


def test_hf_folder_without_pad_pads_with_eos(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers

    folder = tmp_path / "nopad"
    folder.mkdir()
    raw = Tokenizer(models.WordLevel({"</s>": 0, "<unk>": 1, "a": 2, "b": 3}, unk_token="<unk>"))
    raw.pre_tokenizer = pre_tokenizers.Whitespace()
    raw.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({"eos_token": "</s>"}))
    tok = load_tokenizer(str(folder))
    assert tok.eos_token_id == tok.pad_token_id == 0
    assert tok.encode("a b a") == [2, 3, 2]


def test_sentencepiece_model(tmp_path):
    import sentencepiece as spm

    lines = ["the quick brown fox jumps over the lazy dog", "three plus four is seven",
             "one two three four five six seven eight nine ten"] * 10
    prefix = str(tmp_path / "sp")
    spm.SentencePieceTrainer.train(sentence_iterator=iter(lines), model_prefix=prefix,
                                   vocab_size=50, model_type="unigram", minloglevel=2,
                                   hard_vocab_limit=False)
    tok = load_tokenizer(prefix + ".model")
    assert 20 < tok.vocab_size <= 50
    assert tok.eos_token_id == 2 and tok.pad_token_id == tok.eos_token_id  # no pad piece
    ids = tok.encode("three fox")
    assert tok.decode(ids) == "three fox"
    assert tok.decode(ids + [tok.eos_token_id]) == "three fox"
    assert tok.decode(ids + [tok.eos_token_id], skip_special_tokens=False) == "three fox</s>"
    assert tok.apply_chat_template(USER) == "User: 3+4=\nAssistant:"


@pytest.mark.parametrize("spec, fragment", [
    ("builtin:huge", "not a known builtin"),
    ("no/such/tokenizer", "does not exist"),
])
def test_bad_specs(spec, fragment):
    with pytest.raises(TokenizerError, match=fragment) as e:
        load_tokenizer(spec)
    assert spec in str(e.value) and "builtin:tiny" in str(e.value)


def test_bad_files_and_folders(tmp_path):
    (tmp_path / "vocab.txt").write_text("a\nb\n")
    with pytest.raises(TokenizerError, match="not a SentencePiece .model") as e:
        load_tokenizer(str(tmp_path / "vocab.txt"))
    assert "vocab.txt" in str(e.value)
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(TokenizerError, match="tokenizer.json") as e:
        load_tokenizer(str(empty))
    assert str(empty) in str(e.value)


def _qwen2_like_folder(tmp_path, generation_eos):
    """A folder laid out like Qwen2-Instruct's: eos_token <|im_end|>; generation_config.json may list
    <|im_end|> and <|endoftext|> (Qwen2-Instruct's eos_token_id: [151645, 151643])."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    folder = tmp_path / "qwen2_like"
    folder.mkdir()
    vocab = {"a": 0, "b": 1, "<|endoftext|>": 2, "<|im_start|>": 3, "<|im_end|>": 4}
    raw = Tokenizer(models.WordLevel(vocab, unk_token="<|endoftext|>"))
    raw.pre_tokenizer = pre_tokenizers.Whitespace()
    raw.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps(
        {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"}))
    if generation_eos is not None:
        (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": generation_eos}))
    return str(folder)


def test_every_eos_id_of_the_generation_config_stops(tmp_path):
    tok = load_tokenizer(_qwen2_like_folder(tmp_path, [4, 2]))
    assert tok.eos_token_id == 4 and tok.eos_token_ids == (4, 2)


def test_eos_ids_from_the_model_folder_and_without_a_generation_config(tmp_path):
    folder = _qwen2_like_folder(tmp_path, None)
    assert load_tokenizer(folder).eos_token_ids == (4,)
    model = tmp_path / "model"
    model.mkdir()
    (model / "generation_config.json").write_text(json.dumps({"eos_token_id": 2}))
    assert load_tokenizer(folder, str(model)).eos_token_ids == (4, 2)
    assert load_tokenizer(TINY_SPEC).eos_token_ids == (1,)


def test_training_sampling_stops_on_every_eos(tmp_path):
    import types

    from hybridrl.config import Config
    from hybridrl.trainer.ppo import PPOTrainer

    trainer = types.SimpleNamespace(cfg=Config(), tok=load_tokenizer(_qwen2_like_folder(tmp_path, [4, 2])))
    assert set(PPOTrainer.train_sampling(trainer).stop_token_ids) == {2, 4}


# ---- builtin:tiny_tools and the text between assistant turns (multi-turn rollouts, SFT) -------------

CALL = '<tool_call>{"name": "calculator", "arguments": {"expression": "23*17"}}</tool_call>'
TOOL = [{"role": "tool", "content": "391"}]


def test_tiny_tools_extends_tiny(tiny):
    tools = load_tokenizer(TINY_TOOLS_SPEC)
    assert tools.vocab_size == tiny.vocab_size + 10 + 4
    assert tools.encode("12+3=15 ok") == tiny.encode("12+3=15 ok")  # shared characters keep their ids
    tags = tools.encode("<tool_call></tool_call><tool_response></tool_response>")
    assert len(tags) == 4 and min(tags) >= tiny.vocab_size + 10
    ids = tools.encode(CALL)
    assert len(ids) == len(CALL) - len("<tool_call></tool_call>") + 2 and 3 not in ids  # no <unk>
    assert tools.decode(ids + [tools.eos_token_id]) == CALL
    assert tools.apply_chat_template([{"role": "user", "content": "23*17="}]) == "23*17="
    # HF renders templates with trim_blocks, so the template's "\n" between messages is dropped
    assert tools.continuation_text(TOOL) == "<tool_response>391</tool_response>"


def test_plain_continuation_matches_the_plain_template():
    tok = load_tokenizer(TINY_TOOLS_SPEC)
    tok.has_chat_template = False
    turns = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}] + TOOL
    assert plain_chat_template(turns[:1]) + " a" + tok.continuation_text(TOOL) == plain_chat_template(turns)


# Qwen2.5's layout, in short: tool results go back inside one user turn, between <tool_response> tags.
QWEN_LIKE = (
    "{% for m in messages %}"
    "{% if m['role'] == 'tool' %}"
    "{% if loop.first or messages[loop.index0 - 1]['role'] != 'tool' %}{{ '<|im_start|>user' }}{% endif %}"
    "{{ '\n<tool_response>\n' + m['content'] + '\n</tool_response>' }}"
    "{% if loop.last or messages[loop.index0 + 1]['role'] != 'tool' %}{{ '<|im_end|>\n' }}{% endif %}"
    "{% else %}{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>\n' }}{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")


def _qwen_like(template=QWEN_LIKE) -> HFTokenizer:
    hf = build_tiny_hf_tokenizer(tools=True)
    hf.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    hf.eos_token = "<|im_end|>"
    hf.chat_template = template
    return HFTokenizer(hf, "qwen-like")


@pytest.mark.parametrize("results", [TOOL, TOOL + [{"role": "tool", "content": "error: division by zero"}]])
def test_continuation_is_what_the_template_renders_after_the_turn(results):
    tok = _qwen_like()
    user = [{"role": "user", "content": "23*17="}]
    conversation = user + [{"role": "assistant", "content": CALL}] + results
    full = tok.hf.apply_chat_template(conversation, tokenize=False, add_generation_prompt=True)
    # the prompt, the model's turn and its eos, then the continuation: the template's own rendering
    ids = (tok.encode(tok.apply_chat_template(user)) + tok.encode(CALL) + [tok.eos_token_id]
           + tok.encode(tok.continuation_text(results)))
    assert ids == tok.encode(full)
    assert tok.continuation_text(results).endswith("<|im_start|>assistant\n")


def test_template_without_tool_messages_fails_clearly():
    strict = "{% for m in messages %}{% if m['role'] == 'tool' %}{{ raise_exception('no tools') }}{% endif %}" \
             "{{ m['content'] }}{% endfor %}"
    with pytest.raises(TokenizerError, match="cannot render \\['tool'\\] messages after an assistant turn"):
        _qwen_like(strict).continuation_text(TOOL)
    rewrites = "{{ messages | length }}{% for m in messages %}{{ m['content'] }}{% endfor %}"
    with pytest.raises(TokenizerError, match="does not render a conversation incrementally"):
        _qwen_like(rewrites).continuation_text(TOOL)
