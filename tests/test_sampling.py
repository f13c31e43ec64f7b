"""Sampling for `generate` against direct formulas (top-k / top-p keep sets, the drawn
distribution), seeds that reproduce, temperature 0 = greedy, the draw inside decode graphs
(replayed through a CPU stand-in capture) equal to the eager one, and text in / text out through
the tokenizer a checkpoint ships (or the tiny model's byte tokenizer)."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch

from dsv4core import load_model
from dsv4core.model.model import InputError
from dsv4core.model.sampling import RowSampling, SamplingParams, _keep, draw, masked_logits, request_seed


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


#: chi-square quantiles at 1 - 1e-6 (scipy.stats.chi2.isf(1e-6, df)): a draw that follows the
#: expected distribution exceeds them with probability 1e-6 (the draws are deterministic: seeded)
_CHI2_1E6 = {2: 27.63, 3: 30.66, 4: 33.38, 5: 35.89, 6: 38.26, 7: 40.52, 35: 89.95}


def _chi2(counts: list[int], probs: list[float]) -> float:
    n = sum(counts)
    return sum((c - n * q) ** 2 / (n * q) for c, q in zip(counts, probs))


def _softmax_direct(row: list[float], temperature: float, keep: set[int]) -> list[float]:
    m = max(row[j] / temperature for j in keep)
    w = [math.exp(row[j] / temperature - m) if j in keep else 0.0 for j in range(len(row))]
    return [x / sum(w) for x in w]


# per-row parameter sets drawn together in one batch (rows interleaved): temperature, top_k, top_p
_MIXED = [(0.8, 4, 1.0), (1.0, 0, 0.7), (1.7, 6, 0.9), (0.5, 0, 1.0)]


def test_draws_follow_the_reference_distribution():
    """40000 draws of one row of 8 logits, 10000 for each of four parameter sets interleaved in one
    batch (each row its own temperature / top-k / top-p, seed and counter; 3 to 8 tokens kept, each
    expected >= 39 times): never a token outside the definition's keep set, and the kept tokens'
    counts pass a chi-square test against the fp64
    softmax(z / T) over that set at the 1 - 1e-6 quantile (the 23-bit uniforms shift a probability
    by < 1e-6, far below the test's resolution of ~1e-2 / sqrt(10000))."""
    z = [1.5, 1.0, 0.6, 0.2, 0.0, -0.3, -0.7, -1.0]
    n = 40000
    params = [SamplingParams(t, p, k) for t, k, p in _MIXED]
    rows = RowSampling([params[r % 4] for r in range(n)], [request_seed(5, r % 13) for r in range(n)])
    toks = draw(torch.tensor(z).expand(n, -1), torch.from_numpy(rows.pack(np.arange(n) // 13)), rows.filtered)
    for g, (t, k, p) in enumerate(_MIXED):
        keep = _keep_direct(z, t, k, p)
        counts = torch.bincount(toks[g::4], minlength=8).tolist()
        assert all(counts[j] == 0 for j in range(8) if j not in keep), (g, counts, keep)
        kept = sorted(keep)
        probs = _softmax_direct(z, t, keep)
        stat = _chi2([counts[j] for j in kept], [probs[j] for j in kept])
        assert stat < _CHI2_1E6[len(kept) - 1], (g, stat, counts, probs)


def test_draws_of_neighbouring_counters_and_seeds_are_independent():
    """Uniform logits over 6 tokens: the pairs (draw at counter 2c, at 2c + 1) of one seed and
    (seed i, seed i + 1) at one counter fill the 36 cells uniformly (chi-square, 35 degrees of
    freedom, 1 - 1e-6 quantile): the hash leaves no correlation between neighbouring draws."""
    n = 36000
    zeros = torch.zeros(2 * n, 6)
    p = SamplingParams(temperature=1.0)
    for seeds, counters in (([request_seed(3, 0)] * (2 * n), np.arange(2 * n)),
                            ([request_seed(3, i) for i in range(2 * n)], np.arange(2 * n) // 2)):
        rows = RowSampling(p, seeds)
        t = draw(zeros, torch.from_numpy(rows.pack(counters)), rows.filtered)
        counts = torch.bincount(t[0::2] * 6 + t[1::2], minlength=36).tolist()
        assert _chi2(counts, [1 / 36] * 36) < _CHI2_1E6[35], counts


def test_the_fixed_shape_keep_set_is_the_definition_row_by_row():
    """`draw`'s keep set (one sort of each row, each row its own top-k / top-p) equals the
    definition for every row of a batch mixing the parameter sets, and temperature 0 rows draw
    the argmax."""
    g = torch.Generator().manual_seed(7)
    logits = torch.randn(16, 40, generator=g, dtype=torch.float64).mul(3).float()
    sets = [(1.0, 5, 1.0), (0.7, 0, 0.5), (1.3, 8, 0.9), (1.0, 0, 0.999), (2.0, 1, 1.0), (1.0, 0, 1e-6),
            (1.0, 0, 1.0), (0.9, 40, 0.3)]
    params = [SamplingParams(*sets[r % 8][:1], sets[r % 8][2], sets[r % 8][1]) for r in range(16)]
    rows = RowSampling(params, range(16))
    packed = torch.from_numpy(rows.pack(np.zeros(16)))
    temp = torch.tensor([p.temperature for p in params]).unsqueeze(-1)
    keep = _keep(logits / temp, packed[1], torch.tensor([p.top_p for p in params]).float().unsqueeze(-1))
    for r in range(16):
        t, k, p = sets[r % 8]
        assert set(keep[r].nonzero().flatten().tolist()) == _keep_direct(logits[r].double().tolist(), t, k, p), r
    greedy = RowSampling([SamplingParams(0.0, 0.5, 3)] * 16, range(16))
    assert torch.equal(draw(logits, torch.from_numpy(greedy.pack(np.arange(16)))), logits.argmax(-1))


class _ReplayByRerun:
    """A stand-in graph capture for the CPU: the 'replay' re-runs the recorded function, which
    reads the static input buffer and refills the static outputs, as a device graph would."""

    def new_pool(self, device):
        return None

    def capture(self, fn, device, pool=None):
        out = fn()
        return (lambda: out.copy_(fn())), out


def _with_graphs(model):
    model._graph_why = ((id(model.ops), model.device), "", _ReplayByRerun())
    model.use_graphs = True
    return model


def test_a_decode_graph_replay_draws_what_draw_gives_for_its_logits():
    """A sampled decode step replays a drawing graph (recorded with padding only, so every value
    comes from the static buffer written before the replay), and its tokens equal `draw` applied
    to the logits the logits graph of the same bucket computes for the same step (twin forks):
    per-row parameters (a greedy row among them), permuted logits rows, a batch smaller than its
    bucket."""
    m = _with_graphs(load_model("tiny", backend="reference"))
    base = [m.new_state() for _ in range(3)]
    for i, st in enumerate(base):
        p = [(7 * i + j) % 250 + 2 for j in range(5 + 6 * i)]
        m.forward_batch(torch.tensor(p), torch.arange(len(p)), torch.zeros(len(p), dtype=torch.long), [st])
    a, b = [s.fork() for s in base], [s.fork() for s in base]
    params = [SamplingParams(0.9, 0.8, 0), SamplingParams(0.0), SamplingParams(1.2, 1.0, 5)]
    toks = [3, 4, 5]
    for step, rows in enumerate([None, [2, 0, 1], [1, 1], None]):
        n = 3 if rows is None else len(rows)
        rs = RowSampling([params[(r + step) % 3] for r in range(n)], [request_seed(step, r) for r in range(n)])
        pos = torch.tensor([s.length for s in a])
        lr = None if rows is None else torch.tensor(rows)
        got = m.forward_batch(torch.tensor(toks), pos, torch.arange(3), a, logits_rows=lr, sample=rs)
        lg = m.forward_batch(torch.tensor(toks), pos, torch.arange(3), b, logits_rows=lr)
        counters = (pos if lr is None else pos[lr]).numpy() + 1
        assert torch.equal(got.tensor, draw(lg, torch.from_numpy(rs.pack(counters)), rs.filtered)), step
        greedy_rows = [r for r in range(n) if params[(r + step) % 3].greedy]
        assert torch.equal(got.tensor[greedy_rows], lg[greedy_rows].argmax(-1))
        toks = [int(t) for t in lg[:3].argmax(-1)] if rows is None else toks
    keys = set(m._graphs.graphs)
    assert {(4, 256, "draw-filtered"), (4, 256)} <= keys and m._graphs.replays == 8 and not m.graph_failures()
    assert [s.length for s in a] == [s.length for s in b]


@pytest.mark.parametrize("kw", [dict(temperature=0.9), dict(temperature=1.1, top_p=0.8, top_k=20)])
def test_sampled_generate_replays_graphs_and_equals_eager(kw):
    """`generate` with sampling: the decode steps replay drawing graphs and give the tokens of the
    eager steps for the same seed (the draw is one formula of (logits, seed, position) on both
    paths; the logits differ only in fp32 rounding, ~1e-6 relative, far below the gaps the draw
    decides on here)."""
    m = _with_graphs(load_model("tiny", backend="reference"))
    prompts = [[0, 17, 42, 7], [5, 6], list(range(2, 30))]
    got = m.generate(prompts, 10, seed=21, **kw)
    mode = "draw-filtered" if "top_p" in kw else "draw"
    assert m._graphs.replays >= 8 and all(k[-1] == mode for k in m._graphs.graphs)
    m.use_graphs = False
    assert m.generate(prompts, 10, seed=21, **kw) == got
    assert m.generate(prompts[:2], 10, seed=21, **kw) == got[:2]      # a request's draws: its seed and positions


def test_bad_sample_rows_are_refused_with_nothing_changed(tiny):
    st = tiny.new_state()
    tiny.forward_batch(torch.tensor([3, 4]), torch.arange(2), torch.zeros(2, dtype=torch.long), [st])
    one = RowSampling(SamplingParams(1.0), [1])
    for kw, msg in ((dict(sample=RowSampling(SamplingParams(1.0), [1, 2])), r"one entry per logits row \(1\)"),
                    (dict(sample=one, hidden_rows=torch.tensor([0])), "without hidden_rows"),
                    (dict(sample=SamplingParams(1.0)), "sample must be a RowSampling; got SamplingParams")):
        with pytest.raises(InputError, match=msg):
            tiny.forward_batch(torch.tensor([5]), torch.tensor([2]), torch.tensor([0]), [st], **kw)
    assert st.length == 2
    with pytest.raises(InputError, match="2 parameter sets for 1 seeds"):
        RowSampling([SamplingParams(1.0)] * 2, [1])
    with pytest.raises(InputError, match="row 0: the seed must be an int; got 1.5"):
        RowSampling(SamplingParams(1.0), [1.5])
    with pytest.raises(InputError, match="row 1: expected SamplingParams, got dict"):
        RowSampling([SamplingParams(1.0), {}], [1, 2])
    got = tiny.forward_batch(torch.tensor([5]), torch.tensor([2]), torch.tensor([0]), [st], sample=one)
    assert len(got) == 1 and st.length == 3
    st.release()


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
