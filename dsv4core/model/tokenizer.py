"""Text in, text out: a checkpoint's `tokenizer.json` read with the `tokenizers` library (imported
only here, when a model has one), its chat template if it ships one (rendered with Jinja2), and
the built-in tiny model's tokenizer (one token per byte: 256 ids, the tiny vocabulary) with a
plain-text chat template (`TINY_CHAT_TEMPLATE`)."""

from __future__ import annotations

import json
from pathlib import Path


class TokenizerUnavailable(RuntimeError):
    pass


class ChatTemplateError(ValueError):
    """No chat template, or one that does not render; the message names the files looked at."""


#: The tiny model's chat template: one line per message, "User: ..." / "Assistant: ..." (the role
#: capitalised), and "Assistant:" to start the reply. The tiny model's weights are random, so its
#: replies are noise; the template exists so `--chat` runs end to end on it.
TINY_CHAT_TEMPLATE = ("{% for m in messages %}{{ m['role'] | capitalize }}: {{ m['content'] }}\n{% endfor %}"
                      "{% if add_generation_prompt %}Assistant:{% endif %}")


def _tokenizers():
    try:
        import tokenizers
    except ImportError as e:
        raise TokenizerUnavailable("text prompts need the `tokenizers` package (pip install tokenizers); "
                                   "token ids work without it") from e
    return tokenizers


class TextTokenizer:
    """encode(text) -> ids, decode(ids) -> text; `chat_template` is the checkpoint's template
    string (Jinja) or None, `chat_template_source` where it came from (or, when None, the files
    looked at); `special` the special tokens named in tokenizer_config.json (bos_token,
    eos_token, ...), passed to the template."""

    def __init__(self, tok, chat_template: str | None = None, source: str = "", *,
                 chat_template_source: str = "", special: dict[str, str] | None = None) -> None:
        self._tok, self.chat_template, self.source = tok, chat_template, source
        self.chat_template_source = chat_template_source
        self.special = dict(special or {})

    @property
    def eos_token_id(self) -> int | None:
        """The id of tokenizer_config.json's eos_token, or None (none named, or not in the vocabulary)."""
        eos = self.special.get("eos_token")
        return self._tok.token_to_id(eos) if eos else None

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        """The conversation `messages` ([{"role": "user", "content": "..."}, ...]) as the prompt
        text the model was trained on, rendered with the chat template (Jinja2, sandboxed);
        `add_generation_prompt` ends it where the assistant's reply starts. A ChatTemplateError
        names the files looked at when there is no template."""
        if self.chat_template is None:
            raise ChatTemplateError(f"no chat template: {self.chat_template_source or self.source} has none "
                                    f"(give the prompt as plain text without --chat)")
        return render_chat(self.chat_template, messages, add_generation_prompt=add_generation_prompt,
                           special=self.special, source=self.chat_template_source)

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str) -> list[int]:
        if not isinstance(text, str):
            raise TypeError(f"encode: expected a str, got {type(text).__name__}")
        return self._tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids) -> str:
        return self._tok.decode(list(map(int, ids)), skip_special_tokens=False)

    def __repr__(self) -> str:
        return f"TextTokenizer({self.source or 'in memory'}, {self.vocab_size} tokens)"


def render_chat(template: str, messages: list[dict], *, add_generation_prompt: bool = True,
                special: dict[str, str] | None = None, source: str = "") -> str:
    """Render a chat template the way checkpoints expect: Jinja2's sandbox, blocks trimmed
    (trim_blocks, lstrip_blocks), the loop controls extension, `messages`,
    `add_generation_prompt` and the special tokens (`bos_token`, `eos_token`, ...) as variables,
    `raise_exception(msg)` and a `tojson` filter that keeps non-ASCII text as it is."""
    if not isinstance(messages, list) or not all(isinstance(m, dict) and isinstance(m.get("role"), str)
                                                 and isinstance(m.get("content"), str) for m in messages):
        raise ChatTemplateError("chat messages must be a list of {'role': str, 'content': str}; got "
                                f"{messages!r:.120}")
    try:
        import jinja2
        from jinja2.sandbox import ImmutableSandboxedEnvironment
    except ImportError as e:
        raise ChatTemplateError("chat templates need the `jinja2` package (pip install jinja2)") from e

    def raise_exception(msg):
        raise ChatTemplateError(f"the chat template{' in ' + source if source else ''} refused the messages: {msg}")

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
    env.filters["tojson"] = lambda v, indent=None: json.dumps(v, ensure_ascii=False, indent=indent)
    env.globals["raise_exception"] = raise_exception
    try:
        return env.from_string(template).render(messages=messages, add_generation_prompt=add_generation_prompt,
                                                **(special or {}))
    except jinja2.TemplateError as e:
        raise ChatTemplateError(f"the chat template{' in ' + source if source else ''} does not render: {e}") from None


def _token_text(v) -> str | None:
    """A special token as tokenizer_config.json writes it: a string or {"content": ...}."""
    if isinstance(v, dict):
        v = v.get("content")
    return v if isinstance(v, str) else None


def _chat_template(directory: Path, cfg: dict) -> tuple[str | None, str]:
    """(template, where it came from) or (None, the files looked at): `chat_template.jinja` first,
    then tokenizer_config.json's `chat_template` (a string, or the entry named "default" of a
    list of {"name", "template"})."""
    jinja = directory / "chat_template.jinja"
    if jinja.is_file():
        return jinja.read_text(), str(jinja)
    cfg_path = directory / "tokenizer_config.json"
    t = cfg.get("chat_template")
    if isinstance(t, list):
        t = next((e.get("template") for e in t if isinstance(e, dict) and e.get("name") == "default"), None)
    if isinstance(t, str):
        return t, f"{cfg_path} (chat_template)"
    return None, f"{jinja} (absent) and {cfg_path} ({'no chat_template' if cfg_path.is_file() else 'absent'})"


def from_directory(directory: str | Path) -> TextTokenizer | None:
    """The tokenizer of a checkpoint directory, or None when it has no tokenizer.json."""
    d = Path(directory)
    path = d / "tokenizer.json"
    if not path.is_file():
        return None
    tok = _tokenizers().Tokenizer.from_file(str(path))
    cfg_path = d / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text()) if cfg_path.is_file() else {}
    cfg = cfg if isinstance(cfg, dict) else {}
    special = {k: t for k, v in cfg.items() if k.endswith("_token") and (t := _token_text(v)) is not None}
    template, where = _chat_template(d, cfg)
    return TextTokenizer(tok, template, str(path), chat_template_source=where, special=special)


def _byte_chars() -> list[str]:
    """The printable character the byte-level pre-tokenizer uses for each byte 0..255: printable
    Latin-1 bytes stand for themselves, the others for code points 256, 257, ... in byte order."""
    keep = set(range(ord("!"), ord("~") + 1)) | set(range(0xA1, 0xAC + 1)) | set(range(0xAE, 0xFF + 1))
    out, extra = [], 0
    for b in range(256):
        if b in keep:
            out.append(chr(b))
        else:
            out.append(chr(256 + extra))
            extra += 1
    return out


def byte_tokenizer() -> TextTokenizer:
    """The tiny model's tokenizer: token id = byte value (UTF-8), so any text encodes into the
    256-token vocabulary and every id sequence decodes (invalid UTF-8 as U+FFFD). Built in code,
    deterministic."""
    tk = _tokenizers()
    vocab = {c: i for i, c in enumerate(_byte_chars())}
    tok = tk.Tokenizer(tk.models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = tk.pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = tk.decoders.ByteLevel()
    return TextTokenizer(tok, TINY_CHAT_TEMPLATE, "built-in byte tokenizer",
                         chat_template_source="the tiny model's built-in template (TINY_CHAT_TEMPLATE)")
