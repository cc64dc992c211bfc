"""Tokenizer and chat template from a model's own metadata.

Why the Hugging Face ``tokenizers`` library: it is well kept, fast (Rust), and its BPE model
with the ``ByteLevel`` pre-tokenizer and decoder has exactly GPT-2's byte-level semantics
(byte-to-unicode table, merge ranks, regex split), which is what GGUF ``gpt2``-model
vocabularies are. Building it from the file's ``tokens`` and ``merges`` needs no network and
no ``tokenizer.json``. Chat templates are Jinja; they come from the model file, so they are
rendered in jinja2's immutable *sandboxed* environment.
"""

from __future__ import annotations

import uuid
from pathlib import Path

from treeattn.llm.errors import ModelError
from treeattn.llm.formats.hf_folder import read_tokenizer_config

# llama.cpp's names for the pre-tokenizer (GGUF tokenizer.ggml.pre) -> the regex split that
# goes before the byte-level mapping. None means GPT-2's own regex (ByteLevel use_regex).
_GPT2 = None
_LLAMA3 = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# smollm (StarCoder family): single digits split off first, then GPT-2's regex.
PRE_TOKENIZERS = {
    "default": ("plain", _GPT2),
    "gpt-2": ("plain", _GPT2),
    "smollm": ("digits", _GPT2),
    "starcoder": ("digits", _GPT2),
    "refact": ("digits", _GPT2),
    "llama-bpe": ("plain", _LLAMA3),
    "llama3": ("plain", _LLAMA3),
}
_CONTROL_TYPES = (3, 4)  # GGUF token types CONTROL and USER_DEFINED: matched whole


class Tokenizer:
    """Encode/decode text and render the chat template.

    Attributes: ``bos_id``, ``eos_id`` (ints or None), ``chat_template`` (str or None).
    """

    def __init__(self, backend, bos_id=None, eos_id=None, chat_template=None, add_bos=False):
        self.backend = backend
        self.bos_id, self.eos_id = bos_id, eos_id
        self.chat_template = chat_template
        self.add_bos = add_bos

    def encode(self, text: str, specials: bool = False) -> list[int]:
        """Token ids of ``text``; BOS first when the model wants it and the text lacks it.

        User text is text: ``<|im_end|>`` typed in a prompt is encoded as its characters,
        not as the control token (``specials=False``). Only the chat template's own text is
        encoded with ``specials=True`` (:meth:`encode_chat`).
        """
        self.backend.encode_special_tokens = not specials  # True: specials read as text
        try:
            ids = self.backend.encode(text, add_special_tokens=False).ids
        finally:
            self.backend.encode_special_tokens = False
        if self.add_bos and self.bos_id is not None and ids[:1] != [self.bos_id]:
            ids = [self.bos_id, *ids]
        return ids

    def encode_chat(self, prompt: str) -> list[int]:
        """Token ids of the chat-formatted ``prompt``: the template's text may hold control
        tokens, the user's text never does.

        The template is rendered with a marker in place of the prompt; the parts around it
        are encoded with control tokens, the prompt itself as plain text.
        """
        marker = f"\ue000treeattn-prompt-{uuid.uuid4().hex}\ue000"
        rendered = self.render_chat(marker)
        if rendered.count(marker) == 1:
            before, after = rendered.split(marker)
            ids = self.encode(before, specials=True)
            bos, self.add_bos = self.add_bos, False
            try:
                return ids + self.encode(prompt) + self.encode(after, specials=True)
            finally:
                self.add_bos = bos
        rendered = self.render_chat(prompt)  # the template transformed the content
        if self.encode(rendered, specials=True) != self.encode(rendered):
            specials = self.encode(prompt, specials=True) != self.encode(prompt)
            if specials:
                raise ModelError("the prompt contains control-token text (such as "
                                 "<|im_end|>) that this chat template cannot keep apart")
        return self.encode(rendered, specials=True)

    def decode(self, ids: list[int]) -> str:
        return self.backend.decode(list(ids), skip_special_tokens=True)

    def render_chat(self, prompt: str) -> str:
        """The chat-formatted text of a single user turn, ready for the assistant's answer."""
        if not self.chat_template:
            raise ModelError("this model has no chat template; drop --chat")
        from treeattn.llm.formats.chat_template import render_chat_template

        token = self.backend.id_to_token
        return render_chat_template(
            self.chat_template,
            messages=[{"role": "user", "content": prompt}],
            add_generation_prompt=True,
            bos_token=token(self.bos_id) if self.bos_id is not None else "",
            eos_token=token(self.eos_id) if self.eos_id is not None else "",
        )


def _pre_tokenizer(pre: str):
    from tokenizers import Regex, pre_tokenizers

    if pre not in PRE_TOKENIZERS:
        known = ", ".join(PRE_TOKENIZERS)
        raise ModelError(f"unsupported pre-tokenizer {pre!r} in the model (supported: {known})")
    digits, regex = PRE_TOKENIZERS[pre]
    parts = []
    if digits == "digits":
        parts.append(pre_tokenizers.Digits(individual_digits=True))
    if regex is None:
        parts.append(pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True))
    else:
        parts.append(pre_tokenizers.Split(Regex(regex), behavior="isolated"))
        parts.append(pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False))
    return pre_tokenizers.Sequence(parts)


def tokenizer_from_gguf(meta: dict) -> Tokenizer:
    """A :class:`Tokenizer` from :func:`treeattn.llm.formats.gguf_load.tokenizer_metadata`."""
    from tokenizers import AddedToken, decoders, models
    from tokenizers import Tokenizer as HFTokenizer

    if meta.get("model") != "gpt2":
        raise ModelError(
            f"unsupported tokenizer model {meta.get('model')!r} (supported: gpt2 byte-level BPE)"
        )
    tokens, merges = meta["tokens"] or [], meta["merges"] or []
    for key in ("bos_token_id", "eos_token_id"):
        value = meta.get(key)
        if value is not None and not 0 <= int(value) < len(tokens):
            raise ModelError(f"tokenizer.ggml.{key} {value} is outside the vocabulary of "
                             f"{len(tokens)} tokens")
    vocab = {token: i for i, token in enumerate(tokens)}
    pairs = [tuple(m.split(" ", 1)) for m in merges]
    backend = HFTokenizer(models.BPE(vocab, pairs, fuse_unk=False, byte_fallback=False))
    backend.pre_tokenizer = _pre_tokenizer(meta.get("pre") or "default")
    backend.decoder = decoders.ByteLevel()
    types = meta.get("token_type") or []
    special = [tokens[i] for i, t in enumerate(types) if t in _CONTROL_TYPES]
    backend.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in special])
    return Tokenizer(
        backend,
        bos_id=meta.get("bos_token_id"),
        eos_id=meta.get("eos_token_id"),
        chat_template=meta.get("chat_template"),
        add_bos=bool(meta.get("add_bos_token")),
    )


def byte_tokenizer() -> Tokenizer:
    """A 256-token tokenizer, one token per byte (GPT-2's byte alphabet), for the debug model."""
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import decoders, models, pre_tokenizers

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    backend = HFTokenizer(models.BPE({c: i for i, c in enumerate(alphabet)}, []))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    backend.decoder = decoders.ByteLevel()
    return Tokenizer(backend)


def tokenizer_from_hf_dir(path: Path) -> Tokenizer:
    """A :class:`Tokenizer` from ``tokenizer.json`` (+ ``tokenizer_config.json``) in ``path``."""
    from tokenizers import Tokenizer as HFTokenizer

    file = path / "tokenizer.json"
    if not file.is_file():
        raise ModelError(f"{path} has no tokenizer.json")
    conf = read_tokenizer_config(path)
    try:
        backend = HFTokenizer.from_file(str(file))
    except Exception as exc:
        raise ModelError(f"cannot read the tokenizer in {path}: {exc}") from None

    def token_id(key):
        value = conf.get(key)
        value = value.get("content") if isinstance(value, dict) else value
        return backend.token_to_id(value) if isinstance(value, str) and value else None

    template = conf.get("chat_template")
    if template is not None and not isinstance(template, str):
        raise ModelError(f"tokenizer config in {path}: field chat_template: expected a string")

    return Tokenizer(
        backend,
        bos_id=token_id("bos_token"),
        eos_id=token_id("eos_token"),
        chat_template=template,
        add_bos=conf.get("add_bos_token", False) is True,
    )
