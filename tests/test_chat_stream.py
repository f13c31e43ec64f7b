"""Chat templates (the checkpoint's, found where checkpoints ship them, or the tiny model's) and
streamed output: `generate(on_token=...)` reports every kept token in order, and
`dsv4core generate --stream` writes the same text `--json` reports."""

from __future__ import annotations

import io
import json

import pytest

from dsv4core import load_model
from dsv4core.cli import main
from dsv4core.model import tokenizer as tk

tokenizers = pytest.importorskip("tokenizers")
pytest.importorskip("jinja2")


@pytest.fixture(scope="module")
def tiny():
    return load_model("tiny", backend="reference")


def _tokenizer_dir(d, config: dict | None = None, jinja: str | None = None):
    vocab = {"<s>": 0, "</s>": 1, "hello": 2, "world": 3, "[UNK]": 4}
    t = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="[UNK]"))
    t.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    t.save(str(d / "tokenizer.json"))
    if config is not None:
        (d / "tokenizer_config.json").write_text(json.dumps(config))
    if jinja is not None:
        (d / "chat_template.jinja").write_text(jinja)
    return d


def test_the_tiny_chat_template_is_one_line_per_message(tiny):
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    assert tiny.tokenizer.apply_chat_template(msgs) == "System: Be brief.\nUser: Hi\nAssistant:"
    assert tiny.tokenizer.apply_chat_template(msgs, add_generation_prompt=False) == "System: Be brief.\nUser: Hi\n"


def test_a_checkpoint_template_gets_its_special_tokens_and_eos(tmp_path):
    template = ("{{ bos_token }}{% for m in messages %}<{{ m.role }}>{{ m.content | tojson }}{% endfor %}"
                "{% if add_generation_prompt %}<assistant>{% endif %}")
    d = _tokenizer_dir(tmp_path, {"chat_template": template, "bos_token": {"content": "<s>"},
                                  "eos_token": "</s>", "add_bos_token": True})
    tok = tk.from_directory(d)
    assert tok.special == {"bos_token": "<s>", "eos_token": "</s>"} and tok.eos_token_id == 1
    assert tok.apply_chat_template([{"role": "user", "content": "é"}]) == '<s><user>"é"<assistant>'
    # chat_template.jinja is read before tokenizer_config.json's entry
    (tmp_path / "chat_template.jinja").write_text("J{{ messages[0].content }}")
    assert tk.from_directory(d).apply_chat_template([{"role": "user", "content": "x"}]) == "Jx"


def test_a_named_template_list_uses_its_default_entry(tmp_path):
    d = _tokenizer_dir(tmp_path, {"chat_template": [{"name": "tool_use", "template": "T"},
                                                    {"name": "default", "template": "D{{ messages | length }}"}]})
    assert tk.from_directory(d).apply_chat_template([{"role": "user", "content": "x"}]) == "D1"


def test_no_template_is_an_error_naming_the_files_looked_at(tmp_path):
    tok = tk.from_directory(_tokenizer_dir(tmp_path, {"eos_token": "</s>"}))
    assert tok.chat_template is None
    with pytest.raises(tk.ChatTemplateError) as e:
        tok.apply_chat_template([{"role": "user", "content": "x"}])
    msg = str(e.value)
    assert str(tmp_path / "chat_template.jinja") in msg and str(tmp_path / "tokenizer_config.json") in msg
    assert "no chat_template" in msg


def test_a_template_that_raises_or_bad_messages_are_errors(tmp_path):
    tok = tk.from_directory(_tokenizer_dir(tmp_path, jinja="{{ raise_exception('only user turns') }}"))
    with pytest.raises(tk.ChatTemplateError, match="refused the messages: only user turns"):
        tok.apply_chat_template([{"role": "user", "content": "x"}])
    with pytest.raises(tk.ChatTemplateError, match="list of"):
        tok.apply_chat_template([{"role": "user"}])


def test_on_token_reports_every_kept_token_in_order(tiny):
    prompts = [[0, 17, 42, 7], [5, 6]]
    seen: dict[int, list[int]] = {0: [], 1: []}
    out = tiny.generate(prompts, 6, on_token=lambda i, t: seen[i].append(t))
    assert [seen[0], seen[1]] == out == tiny.generate(prompts, 6)
    eos = out[0][2]                      # stops prompt 0 at its third token: no token after it is reported
    seen = {0: [], 1: []}
    out = tiny.generate(prompts, 6, eos_token_id=eos, on_token=lambda i, t: seen[i].append(t))
    assert [seen[0], seen[1]] == out and out[0][-1] == eos and len(out[0]) <= 3


class _Writes(io.StringIO):
    def __init__(self):
        super().__init__()
        self.writes: list[str] = []

    def write(self, s):
        self.writes.append(s)
        return super().write(s)


def test_the_stream_waits_for_a_whole_utf8_character_and_escapes_controls(tiny):
    from dsv4core.commands.generate import _TextStream

    out = _Writes()
    s = _TextStream(tiny.tokenizer, out)
    for b in "aé".encode() + b"\x1b\n":
        s(0, b)
    s.close()
    assert [w for w in out.writes if w] == ["a", "é", "\\x1b", "\n", "\n"]
    ids = _Writes()
    s = _TextStream(None, ids)
    for t in (3, 4, 5):
        s(0, t)
    s.close()
    assert ids.getvalue() == "3,4,5\n"


def test_cli_chat_and_stream_give_the_text_json_reports(tiny, capsys):
    base = ["generate", "--model", "tiny", "--backend", "reference", "--prompt", "Hi", "--chat",
            "--max-new-tokens", "6", "--no-progress"]
    assert main(base + ["--json"]) == 0
    j = json.loads(capsys.readouterr().out)
    assert j["chat"] is True and j["chat_prompts"] == ["User: Hi\nAssistant:"] and j["prompts"] == ["Hi"]
    assert j["new_tokens"] == tiny.generate([list(b"User: Hi\nAssistant:")], 6)
    assert main(base + ["--stream"]) == 0
    streamed = capsys.readouterr().out
    from dsv4core.commands.generate import _CONTROL

    expect = _CONTROL.sub(lambda m: repr(m.group())[1:-1], j["new_text"][0])
    assert streamed == expect + "\n"


@pytest.mark.parametrize("extra, said", [
    (["--input-ids", "1,2", "--chat"], "--chat takes text prompts"),
    (["--prompt", "a", "--stream", "--json"], "choose one"),
    (["--prompt", "a", "--prompt", "b", "--stream"], "got 2 prompts"),
    (["--prompt", "a", "--system", "s"], "give it with --chat"),
])
def test_chat_and_stream_usage_errors_exit_2_in_one_line(extra, said, capsys):
    assert main(["generate", "--model", "tiny"] + extra) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and said in err


def test_chat_without_a_tokenizer_says_why():
    from dsv4core.commands.generate import _chat_prompts

    class M:
        tokenizer, tokenizer_why = None, "/ckpt has no tokenizer.json"

    with pytest.raises(ValueError, match="/ckpt has no tokenizer.json"):
        _chat_prompts(M(), ["x"], None)


def test_chat_alone_is_a_conversation_read_from_stdin(tiny, monkeypatch, capsys):
    from dsv4core.commands.generate import _CONTROL

    def shown(ids):
        return _CONTROL.sub(lambda m: repr(m.group())[1:-1], tiny.tokenizer.decode(ids))

    monkeypatch.setattr("sys.stdin", io.StringIO("Hi\n\nHow are you?\n"))
    assert main(["generate", "--model", "tiny", "--backend", "reference", "--chat", "--system", "Be brief.",
                 "--max-new-tokens", "5"]) == 0
    out = capsys.readouterr().out
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    (r1,) = tiny.generate([tiny.tokenizer.apply_chat_template(msgs)], 5)
    msgs += [{"role": "assistant", "content": tiny.tokenizer.decode(r1)}, {"role": "user", "content": "How are you?"}]
    (r2,) = tiny.generate([tiny.tokenizer.apply_chat_template(msgs)], 5)
    assert out == shown(r1) + "\n" + shown(r2) + "\n"
    assert main(["generate", "--model", "tiny", "--chat", "--json"]) == 2
    assert "takes no --json" in capsys.readouterr().err
