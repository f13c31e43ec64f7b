"""Text in, text out: a checkpoint's `tokenizer.json` read with the `tokenizers` library (imported
only here, when a model has one), its chat template if it ships one, and the built-in tiny
model's tokenizer (one token per byte: 256 ids, the tiny vocabulary)."""

from __future__ import annotations

import json
from pathlib import Path


class TokenizerUnavailable(RuntimeError):
    pass


def _tokenizers():
    try:
        import tokenizers
    except ImportError as e:
        raise TokenizerUnavailable("text prompts need the `tokenizers` package (pip install tokenizers); "
                                   "token ids work without it") from e
    return tokenizers


class TextTokenizer:
    """encode(text) -> ids, decode(ids) -> text; `chat_template` is the checkpoint's template
    string (Jinja) or None."""

    def __init__(self, tok, chat_template: str | None = None, source: str = "") -> None:
        self._tok, self.chat_template, self.source = tok, chat_template, source

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


def _chat_template(directory: Path) -> str | None:
    jinja = directory / "chat_template.jinja"
    if jinja.is_file():
        return jinja.read_text()
    cfg = directory / "tokenizer_config.json"
    if cfg.is_file():
        t = json.loads(cfg.read_text()).get("chat_template")
        return t if isinstance(t, str) else None
    return None


def from_directory(directory: str | Path) -> TextTokenizer | None:
    """The tokenizer of a checkpoint directory, or None when it has no tokenizer.json."""
    d = Path(directory)
    path = d / "tokenizer.json"
    if not path.is_file():
        return None
    tok = _tokenizers().Tokenizer.from_file(str(path))
    return TextTokenizer(tok, _chat_template(d), str(path))


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
    return TextTokenizer(tok, None, "built-in byte tokenizer")
