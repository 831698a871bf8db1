"""One small tokenizer interface over HF tokenizer folders, SentencePiece models and `builtin:tiny`.

`load_tokenizer(spec)` returns a `Tokenizer` with `encode`, `decode`, `apply_chat_template`,
`continuation_text`, `pad_token_id`, `eos_token_id`, `eos_token_ids`, `vocab_size`; the rest of
hybridrl uses only these. `eos_token_ids` are all the ids that end a response: the tokenizer's eos
plus every `eos_token_id` of a `generation_config.json` beside it or in the model folder
(Qwen2-Instruct ends turns with <|im_end|> and also stops on <|endoftext|>). `builtin:tiny` is a
character-level vocabulary (digits, arithmetic signs, lowercase letters, a little punctuation) built
with the `tokenizers` library and wrapped as an HF fast tokenizer, so it takes the same code path as
a real HF folder; `save_tiny_tokenizer(folder)` writes it out as one. `builtin:tiny_tools` adds the
characters of JSON tool calls and the Hermes tags (`<tool_call>`, `</tool_call>`, `<tool_response>`,
`</tool_response>`, one token each, as in Qwen's vocabulary).
This module never downloads anything: HF folders are loaded with local files only.
"""
from __future__ import annotations

import json
import os
from typing import Any, Dict, List, Sequence

TINY_SPEC = "builtin:tiny"
TINY_TOOLS_SPEC = "builtin:tiny_tools"
TINY_SPECIAL_TOKENS = ("<pad>", "<eos>", "<bos>", "<unk>")  # ids 0, 1, 2, 3
TINY_CHARS = "0123456789+-*/= abcdefghijklmnopqrstuvwxyz.,?!:()\n"
TINY_TOOLS_CHARS = '{}"_<>[]\';'  # JSON, and what tool error messages quote
TINY_TOOLS_TAGS = ("<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>")
# The tiny model sees the bare user text ("3+4="): the shortest prompt learns fastest. A tool
# message is its content between <tool_response> tags.
TINY_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{% if message['role'] == 'tool' %}<tool_response>{{ message['content'] }}</tool_response>"
    "{% else %}{{ message['content'] }}{% endif %}"
    "{% if not loop.last %}\n{% endif %}{% endfor %}"
)
_PLAIN_ROLES = {"system": "System", "user": "User", "assistant": "Assistant", "tool": "Tool"}
# Placeholders for rendering a conversation around the part we want (continuation_text).
_USER_PLACEHOLDER, _ASSISTANT_PLACEHOLDER = "hybridrl user placeholder", "hybridrl assistant placeholder"


class TokenizerError(ValueError):
    """A tokenizer spec that cannot be loaded; the message names the path and the fix."""


class ChatTemplateError(ValueError):
    """A conversation the tokenizer's chat template refuses (its raise_exception, e.g. roles that do not alternate)."""


def plain_chat_template(messages: Sequence[Dict[str, str]], add_generation_prompt: bool = True) -> str:
    """'User: ...\\nAssistant:' rendering for tokenizers that ship no chat template."""
    lines = [f"{_PLAIN_ROLES.get(m['role'], m['role'].capitalize())}: {m['content']}" for m in messages]
    return "\n".join(lines) + ("\nAssistant:" if add_generation_prompt else "")


def generation_eos_ids(folder: str) -> tuple:
    """The `eos_token_id` entries (int or list) of `folder`/generation_config.json; () if none."""
    path = os.path.join(folder, "generation_config.json") if folder else ""
    if not path or not os.path.isfile(path):
        return ()
    with open(path) as f:
        try:
            value = json.load(f).get("eos_token_id")
        except ValueError as e:
            raise TokenizerError(f"'{path}' is not valid JSON ({e}); fix or remove it") from e
    ids = value if isinstance(value, list) else [value] if value is not None else []
    return tuple(int(i) for i in ids)


class Tokenizer:
    """The uniform interface; subclasses wrap one backend."""

    name: str
    pad_token_id: int
    eos_token_id: int
    vocab_size: int
    has_chat_template: bool = False
    extra_eos_token_ids: tuple = ()

    @property
    def eos_token_ids(self) -> tuple:
        """Every id that ends a response, the primary `eos_token_id` first."""
        rest = sorted(set(self.extra_eos_token_ids) - {self.eos_token_id})
        return (self.eos_token_id, *rest)

    def encode(self, text: str) -> List[int]:
        raise NotImplementedError

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        raise NotImplementedError

    def batch_decode(self, batch: Sequence[Sequence[int]], skip_special_tokens: bool = True) -> List[str]:
        return [self.decode(ids, skip_special_tokens) for ids in batch]

    def apply_chat_template(self, messages: Sequence[Dict[str, str]], add_generation_prompt: bool = True) -> str:
        """The conversation as text; add_generation_prompt=False renders a finished one (reward models)."""
        return plain_chat_template(messages, add_generation_prompt)

    def continuation_text(self, messages: Sequence[Dict[str, str]]) -> str:
        """The text after an assistant turn that ended with eos: `messages` (tool results, user
        turns) rendered as the chat template does inside a conversation, then the next assistant
        header. Multi-turn rollouts and SFT both join turns with it, so they see one layout."""
        return "".join(f"\n{_PLAIN_ROLES.get(m['role'], m['role'].capitalize())}: {m['content']}"
                       for m in messages) + "\nAssistant:"


class HFTokenizer(Tokenizer):
    """An HF (fast) tokenizer; its own chat template is used when it has one."""

    def __init__(self, hf, name: str):
        self.hf, self.name = hf, name
        if hf.eos_token_id is None:
            raise TokenizerError(f"tokenizer '{name}' has no eos token; set \"eos_token\" in its "
                                 "tokenizer_config.json")
        self.eos_token_id = int(hf.eos_token_id)
        # Like verl: a tokenizer without a pad token pads with eos (masked out anyway).
        self.pad_token_id = int(hf.pad_token_id) if hf.pad_token_id is not None else self.eos_token_id
        self.vocab_size = len(hf)
        self.has_chat_template = bool(getattr(hf, "chat_template", None))
        self.template_kwargs: Dict[str, Any] = {}
        """Extra variables of every chat-template rendering (data.apply_chat_template_kwargs, e.g. Qwen3's
        enable_thinking), for prompts, multi-turn continuations and SFT alike."""

    def encode(self, text: str) -> List[int]:
        # Chat templates already carry any bos text; adding special tokens would double it.
        return list(self.hf.encode(text, add_special_tokens=False))

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self.hf.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, messages: Sequence[Dict[str, str]], add_generation_prompt: bool = True) -> str:
        from jinja2 import TemplateError

        if not self.has_chat_template:
            return plain_chat_template(messages, add_generation_prompt)
        try:
            return self.hf.apply_chat_template(list(messages), tokenize=False,
                                               add_generation_prompt=add_generation_prompt, **self.template_kwargs)
        except TemplateError as e:
            raise ChatTemplateError(f"the chat template of '{self.name}' rejects messages with roles "
                                    f"{[m['role'] for m in messages]}: {e}") from e

    def continuation_text(self, messages: Sequence[Dict[str, str]]) -> str:
        if not self.has_chat_template:
            return super().continuation_text(messages)
        head = [{"role": "user", "content": _USER_PLACEHOLDER},
                {"role": "assistant", "content": _ASSISTANT_PLACEHOLDER}]
        try:
            kwargs = self.template_kwargs
            before = self.hf.apply_chat_template(head, tokenize=False, add_generation_prompt=False, **kwargs)
            after = self.hf.apply_chat_template(head + list(messages), tokenize=False, add_generation_prompt=True,
                                                **kwargs)
        except Exception as e:  # jinja raises its own types (e.g. "roles must alternate")
            raise TokenizerError(f"the chat template of '{self.name}' cannot render "
                                 f"{[m['role'] for m in messages]} messages after an assistant turn ({e}); "
                                 "use a tokenizer whose template supports tool messages") from e
        if not after.startswith(before) or _ASSISTANT_PLACEHOLDER not in before:
            raise TokenizerError(f"the chat template of '{self.name}' does not render a conversation "
                                 "incrementally (its text changes when messages are appended); multi-turn "
                                 "rollouts need a template that does")
        # what the template writes after an assistant message, less the eos the model wrote itself
        closing = before[before.rindex(_ASSISTANT_PLACEHOLDER) + len(_ASSISTANT_PLACEHOLDER):]
        eos_text = self.hf.decode([self.eos_token_id], skip_special_tokens=False)
        if eos_text and closing.startswith(eos_text):
            closing = closing[len(eos_text):]
        return closing + after[len(before):]


class SentencePieceTokenizer(Tokenizer):
    """A SentencePiece `.model` file; always the plain chat template."""

    def __init__(self, path: str):
        import sentencepiece as spm

        self.name = path
        self.sp = spm.SentencePieceProcessor(model_file=path)
        if self.sp.eos_id() < 0:
            raise TokenizerError(f"SentencePiece model '{path}' has no eos piece; retrain it with "
                                 "eos_id >= 0 (SentencePieceTrainer.train(..., eos_id=2))")
        self.eos_token_id = int(self.sp.eos_id())
        self.pad_token_id = int(self.sp.pad_id()) if self.sp.pad_id() >= 0 else self.eos_token_id
        self.vocab_size = int(self.sp.get_piece_size())

    def encode(self, text: str) -> List[int]:
        return list(self.sp.encode(text))

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        ids = [int(i) for i in ids]
        if skip_special_tokens:
            return self.sp.decode(ids)  # SentencePiece drops control pieces itself
        out, run = [], []
        for i in ids:
            if self.sp.is_control(i) or self.sp.is_unknown(i):
                out += [self.sp.decode(run), self.sp.id_to_piece(i)]
                run = []
            else:
                run.append(i)
        return "".join(out + [self.sp.decode(run)])


def build_tiny_hf_tokenizer(tools: bool = False):
    """builtin:tiny (or, with `tools`, builtin:tiny_tools) as a transformers fast tokenizer (no files,
    no download). The tools vocabulary extends the plain one: shared characters keep their ids."""
    from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers
    from tokenizers import Tokenizer as RawTokenizer
    from transformers import PreTrainedTokenizerFast

    chars = TINY_CHARS + (TINY_TOOLS_CHARS if tools else "")
    vocab = {tok: i for i, tok in enumerate(TINY_SPECIAL_TOKENS + tuple(chars))}
    raw = RawTokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    raw.normalizer = normalizers.Lowercase()  # "User" still tokenizes; decode gives "user"
    raw.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")  # one char each
    raw.decoder = decoders.Fuse()  # join characters without spaces
    if tools:  # matched before the per-character split; not special, so decode keeps them
        raw.add_tokens([AddedToken(tag, normalized=False) for tag in TINY_TOOLS_TAGS])
    hf = PreTrainedTokenizerFast(tokenizer_object=raw, pad_token="<pad>", eos_token="<eos>",
                                 bos_token="<bos>", unk_token="<unk>")
    hf.chat_template = TINY_CHAT_TEMPLATE
    return hf


def save_tiny_tokenizer(folder: str, tools: bool = False) -> str:
    """Write builtin:tiny (or tiny_tools) as an HF tokenizer folder (tokenizer.json + config)."""
    os.makedirs(folder, exist_ok=True)
    build_tiny_hf_tokenizer(tools).save_pretrained(folder)
    return folder


def _generic_fast_tokenizer(folder: str) -> bool:
    """True when the folder's tokenizer is a plain tokenizer.json (builtin:tiny written out, e.g. by
    train_sft.py): AutoTokenizer would pick the class of config.json's model_type (Qwen2Tokenizer)
    and replace the file's own pre-tokenizer and normalizer with that class's."""

    try:
        with open(os.path.join(folder, "tokenizer_config.json")) as f:
            return json.load(f).get("tokenizer_class") in ("TokenizersBackend", "PreTrainedTokenizerFast")
    except (OSError, ValueError):
        return False


def _load_hf_folder(folder: str) -> HFTokenizer:
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    try:
        cls = PreTrainedTokenizerFast if _generic_fast_tokenizer(folder) else AutoTokenizer
        hf = cls.from_pretrained(folder, local_files_only=True)
    except Exception as e:  # transformers raises many types here; one message for all
        raise TokenizerError(f"could not load the HF tokenizer folder '{folder}': {e}. It needs "
                             "tokenizer.json (+ tokenizer_config.json); fix data.tokenizer") from e
    return HFTokenizer(hf, folder)


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")
"""Any of these in a model folder: it carries its own tokenizer."""


def tokenizer_source(spec: str, model_path: str) -> str:
    """data.tokenizer as given; where it is empty (the default, verl's null), the model's: model.path when that
    folder holds a tokenizer, else builtin:tiny (a random model built from the config's fields, or a folder
    without one). A real checkpoint thus never meets the tiny tokenizer by default."""
    if spec:
        return spec
    if model_path and any(os.path.isfile(os.path.join(model_path, f)) for f in TOKENIZER_FILES):
        return model_path
    return TINY_SPEC


def load_data_tokenizer(data, model_path: str) -> Tokenizer:
    """The run's tokenizer from its data section (data.tokenizer, data.apply_chat_template_kwargs) and model.path."""
    return load_tokenizer(tokenizer_source(data.tokenizer, model_path), model_path, data.apply_chat_template_kwargs)


def load_tokenizer(spec: str, model_folder: str = "", template_kwargs: Dict[str, Any] | None = None) -> Tokenizer:
    """An HF tokenizer folder, a SentencePiece `.model` file, `builtin:tiny` or `builtin:tiny_tools`;
    the stop ids of generation_config.json in the tokenizer folder and in `model_folder` join
    `eos_token_ids`; `template_kwargs` go to every rendering of its chat template (an HF one)."""
    tok = _load(spec)
    if template_kwargs:
        if not isinstance(tok, HFTokenizer) or not tok.has_chat_template:
            raise TokenizerError(f"data.apply_chat_template_kwargs={dict(template_kwargs)} needs a tokenizer with a "
                                 f"chat template; '{spec}' has none: drop the setting or use an HF tokenizer folder")
        tok.template_kwargs = dict(template_kwargs)
    folder = spec if os.path.isdir(spec) else os.path.dirname(spec) if os.path.isfile(spec) else ""
    tok.extra_eos_token_ids = generation_eos_ids(folder) + generation_eos_ids(model_folder)
    return tok


def _load(spec: str) -> Tokenizer:
    if spec in (TINY_SPEC, TINY_TOOLS_SPEC):
        return HFTokenizer(build_tiny_hf_tokenizer(tools=spec == TINY_TOOLS_SPEC), spec)
    if spec.startswith("builtin:"):
        raise TokenizerError(f"data.tokenizer='{spec}' is not a known builtin; the builtins are "
                             f"'{TINY_SPEC}' and '{TINY_TOOLS_SPEC}'")
    if os.path.isdir(spec):
        return _load_hf_folder(spec)
    if os.path.isfile(spec):
        if spec.endswith(".model"):
            return SentencePieceTokenizer(spec)
        if os.path.basename(spec) == "tokenizer.json":
            return _load_hf_folder(os.path.dirname(spec) or ".")
        raise TokenizerError(f"data.tokenizer='{spec}' is a file but not a SentencePiece .model; "
                             "point it at an HF tokenizer folder, a .model file, or builtin:tiny")
    raise TokenizerError(f"data.tokenizer='{spec}' does not exist; point it at an HF tokenizer "
                         f"folder (with tokenizer.json), a SentencePiece .model file, or '{TINY_SPEC}'")
