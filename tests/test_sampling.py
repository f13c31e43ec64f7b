"""Sampling for `generate` against direct formulas (top-k / top-p keep sets, the drawn
distribution), seeds that reproduce, temperature 0 = greedy, and text in / text out through the
tokenizer a checkpoint ships (or the tiny model's byte tokenizer)."""

from __future__ import annotations

import json
import math

import pytest
import torch

from dsv4core import load_model
from dsv4core.model.model import InputError
from dsv4core.model.sampling import SamplingParams, masked_logits, make_generator, sample


@pytest.fixture(scope="module")
def tiny():
    return load_model("tiny", backend="reference")


def _keep_direct(row: list[float], temperature: float, top_k: int, top_p: float) -> set[int]:
    """The tokens sampling may draw, from the definition, in float64 Python arithmetic."""
    q = [z / temperature for z in row]
    keep = set(range(len(q)))
    if 0 < top_k < len(q):
        kth = sorted(q, reverse=True)[top_k - 1]
        keep = {j for j in keep if q[j] >= kth}
    if top_p < 1:
        m = max(q[j] for j in keep)
        w = {j: math.exp(q[j] - m) for j in keep}
        total = sum(w.values())
        mass, chosen = 0.0, set()
        for j in sorted(keep, key=lambda j: -q[j]):     # most likely first; stop once the mass reached top_p
            if mass >= top_p:
                break
            chosen.add(j)
            mass += w[j] / total
        keep = chosen
    return keep


@pytest.mark.parametrize("temperature, top_k, top_p", [(1.0, 5, 1.0), (0.7, 0, 0.5), (1.3, 8, 0.9), (1.0, 0, 0.999),
                                                       (2.0, 1, 1.0), (1.0, 0, 1e-6)])
def test_the_masks_keep_what_the_definition_keeps(temperature, top_k, top_p):
    g = torch.Generator().manual_seed(7)
    # spread-out logits (no near-ties at the top-p boundary: float32 and float64 agree on the set)
    logits = torch.randn(16, 40, generator=g, dtype=torch.float64).mul(3).float()
    got = masked_logits(logits, SamplingParams(temperature, top_p, top_k))
    for r in range(logits.shape[0]):
        want = _keep_direct(logits[r].double().tolist(), temperature, top_k, top_p)
        assert set(torch.isfinite(got[r]).nonzero().flatten().tolist()) == want, r
        kept = sorted(want)   # the kept values are the tempered logits (float32 division)
        assert torch.equal(got[r, kept], logits[r, kept] / temperature)


def test_draws_follow_the_masked_softmax():
    """20000 draws of one row: every token's frequency within 5 binomial standard deviations of
    softmax(z / T) renormalised over the top-k set; masked tokens are never drawn."""
    z = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0, -3.0])
    p = SamplingParams(temperature=0.8, top_k=4, seed=11)
    n = 20000
    toks = sample(z.expand(n, -1).contiguous(), p, make_generator(p, torch.device("cpu")))
    counts = torch.bincount(toks, minlength=6).tolist()
    w = [math.exp(v / 0.8) for v in z.tolist()[:4]]
    probs = [x / sum(w) for x in w] + [0.0, 0.0]
    for c, q in zip(counts, probs):
        assert abs(c / n - q) <= 5 * math.sqrt(q * (1 - q) / n) + 1e-12, (counts, probs)


def test_bad_parameters_are_refused_naming_them(tiny):
    for kw, name in (({"temperature": -1}, "temperature"), ({"top_p": 0}, "top_p"), ({"top_p": 1.5}, "top_p"),
                     ({"top_k": -2}, "top_k"), ({"seed": 1.5}, "seed")):
        with pytest.raises(InputError, match=name):
            tiny.generate([[1, 2]], 2, **kw)


def test_temperature_zero_is_greedy_bit_for_bit(tiny):
    prompts = [[0, 17, 42, 7], [5, 6]]
    greedy = tiny.generate(prompts, 6)
    assert tiny.generate(prompts, 6, temperature=0, top_k=3, top_p=0.5, seed=9) == greedy
    # and greedy is the argmax of a full prefill at every step
    seq = list(prompts[0])
    for tok in greedy[0]:
        assert int(tiny.logits(seq)[-1].argmax()) == tok
        seq.append(tok)


def test_a_seed_reproduces_and_another_seed_differs(tiny):
    prompts = [[0, 17, 42, 7], [5, 6]]
    kw = dict(temperature=1.0, top_p=0.95, top_k=50)
    a = tiny.generate(prompts, 12, seed=1, **kw)
    assert tiny.generate(prompts, 12, seed=1, **kw) == a
    assert tiny.generate(prompts, 12, seed=2, **kw) != a
    assert tiny.generate(prompts, 12, seed=1, top_k=1, temperature=1.0) == tiny.generate(prompts, 12)  # top-1 = argmax


def test_text_prompts_through_the_tiny_byte_tokenizer(tiny):
    tok = tiny.tokenizer
    assert tok.vocab_size == tiny.config.vocab_size == 256
    assert tok.encode("Hé!") == list("Hé!".encode()) and tok.decode(list(b"ok \xc3\xa9")) == "ok é"
    assert tiny.generate(["Hé!"], 4) == tiny.generate([list("Hé!".encode())], 4)


def test_a_checkpoint_tokenizer_and_chat_template_are_picked_up(tiny, tmp_path):
    tokenizers = pytest.importorskip("tokenizers")
    from dsv4core.checkpoint.writer import write_transformers
    from dsv4core.model.api import TINY_CONFIG

    write_transformers(tiny.state_dict(), dict(TINY_CONFIG, dtype="float32"), tmp_path)
    vocab = {"<s>": 0, "</s>": 1, "hello": 2, "world": 3, "[UNK]": 4}
    t = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="[UNK]"))
    t.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    t.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": "{{ messages }}"}))
    m = load_model(tmp_path, backend="reference", dtype="float32")
    assert m.tokenizer.encode("hello world") == [2, 3] and m.tokenizer.chat_template == "{{ messages }}"
    assert m.generate(["hello world"], 3) == tiny.generate([[2, 3]], 3)
    (tmp_path / "tokenizer.json").unlink()
    m = load_model(tmp_path, backend="reference", dtype="float32")
    assert m.tokenizer is None and "no tokenizer.json" in m.tokenizer_why
    with pytest.raises(InputError, match="no tokenizer"):
        m.generate(["hello"], 2)


def test_cli_prompt_prints_text_and_sampling_is_reproducible(capsys):
    from dsv4core.cli import main

    argv = ["generate", "--model", "tiny", "--backend", "reference", "--prompt", "Hi", "--max-new-tokens", "5",
            "--temperature", "0.9", "--top-p", "0.9", "--seed", "4", "--json", "--no-progress"]
    assert main(argv) == 0
    a = json.loads(capsys.readouterr().out)
    assert main(argv) == 0
    b = json.loads(capsys.readouterr().out)
    assert a["new_tokens"] == b["new_tokens"] and len(a["new_tokens"][0]) == 5
    assert a["new_text"][0] == bytes(a["new_tokens"][0]).decode("utf-8", errors="replace")
    assert a["prompts"] == ["Hi"] and a["sampling"]["seed"] == 4
