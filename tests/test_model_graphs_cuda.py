"""Device-graph decode on a CUDA device: the replayed step equals the eager one on the same
backend (fp32 tiny model; bound 2e-5 x max|logit|: the two differ only in shapes — bucket padding,
every token an emission candidate, wider entry tables — hence in summation order, measured ~1e-7).
Needs a CUDA device and the `cuda` plugin; skipped (reported as skipped) elsewhere."""

from __future__ import annotations

import pytest
import torch

import dsv4core

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def _run(model, prompts, steps):
    sts = [model.new_state() for _ in prompts]
    for st, p in zip(sts, prompts):
        model.forward_batch(torch.tensor(p), torch.arange(len(p)), torch.zeros(len(p), dtype=torch.long), [st])
    out, tok = [], torch.tensor([p[-1] for p in prompts])
    for _ in range(steps):
        lg = model.forward_batch(tok, torch.tensor([s.length for s in sts]), torch.arange(len(sts)), sts)
        out.append(lg)
        tok = lg.argmax(-1).cpu()
    for s in sts:
        s.release()
    return torch.stack(out)


@pytest.mark.parametrize("backend", ["cuda", "reference"])
def test_graph_replayed_decode_equals_eager(backend):
    model = dsv4core.load_model("tiny", backend=backend, device="cuda")
    model.configure_cache(max_requests=8, max_tokens=8192, max_request_tokens=1024)
    status = model.graph_status()
    if status:
        pytest.skip(f"graphs off for backend {backend!r}: {status}")
    prompts = [list(range(3, 3 + n)) for n in (5, 17, 30)]
    graph = _run(model, prompts, 40)
    assert model._graphs.replays == 40 and not model._graphs.failed
    # a new cache (its graphs recorded afresh, in a fresh memory pool) decodes the same
    model.configure_cache(max_requests=8, max_tokens=8192, max_request_tokens=1024)
    again = _run(model, prompts, 40)
    assert model._graphs.replays == 40 and not model._graphs.failed
    assert torch.equal(again, graph)
    model.use_graphs = False
    eager = _run(model, prompts, 40)
    scale = eager.abs().max()
    assert (graph - eager).abs().max() <= 2e-5 * scale


def test_queued_decode_never_waits_for_the_device_and_equals_the_serial_one():
    """Steps fed `greedy_tokens` (ids left on the device) are queued without one host/device
    synchronisation (torch's sync debug mode turns any into an error: a read-back, a blocking
    copy, an `.item()`), replayed from graphs, and give bit for bit the logits of steps fed host ids."""
    model = dsv4core.load_model("tiny", backend="cuda", device="cuda")
    # small blocks: the 23 queued steps cross window and compressed block boundaries, so block
    # tables are uploaded (queued) under the sync check too
    model.configure_cache(max_requests=8, max_tokens=8192, max_request_tokens=1024, window_block=8, block_tokens=32)
    if model.graph_status():
        pytest.skip(f"graphs off: {model.graph_status()}")
    prompts = [list(range(3, 3 + n)) for n in (5, 17, 30)]
    serial = _run(model, prompts, 24)
    sts = [model.new_state() for _ in prompts]
    for st, p in zip(sts, prompts):
        model.forward_batch(torch.tensor(p), torch.arange(len(p)), torch.zeros(len(p), dtype=torch.long), [st])
    out = []
    tok = torch.tensor([p[-1] for p in prompts])
    lg = model.forward_batch(tok, torch.tensor([s.length for s in sts]), torch.arange(3), sts)
    out.append(lg)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(23):
            lg = model.forward_batch(model.greedy_tokens(lg), torch.tensor([s.length for s in sts]),
                                     torch.arange(3), sts)
            out.append(lg)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    for s in sts:
        s.release()
    assert torch.equal(torch.stack(out), serial)


def test_speculative_generate_replays_draft_graphs():
    """Speculative generation whose MTP draft steps replay graphs: the tokens of plain greedy
    decoding (the verifier's guarantee, whatever the drafts), the draft graphs replayed, none of
    their recordings failed."""
    model = dsv4core.load_model("tiny-mtp", backend="cuda", device="cuda")
    model.configure_cache(max_requests=4, max_tokens=8192, max_request_tokens=1024)
    if model.graph_status():
        pytest.skip(f"graphs off: {model.graph_status()}")
    prompts = [list(range(3, 3 + n)) for n in (5, 17, 30, 2, 9)]
    model.use_graphs = False
    want = model.generate(prompts, 12)
    model.use_graphs = True
    for k in (1, 3):
        model.configure_cache(max_requests=4, max_tokens=8192, max_request_tokens=1024)
        got = model.generate(prompts, 12, speculative_tokens=k)
        assert got == want and got.speculation["rounds"] > 0
        assert model._graphs.variants["mtp_draft"].replays > 0 and not model.graph_failures()


@pytest.mark.parametrize("backend", ["cuda", "reference"])
def test_sampled_decode_draws_inside_the_graphs_without_waiting(backend):
    """Sampled decode steps replay drawing graphs (the draw recorded with the step) and are queued
    without one host/device synchronisation (sync debug mode "error"); `generate` with sampling
    gives the eager path's tokens for the same seed (the draw is one formula of logits, seed and
    position; the logits differ by ~1e-7 relative, below the gaps the draw decides on)."""
    from dsv4core.model.sampling import RowSampling, SamplingParams, request_seed

    model = dsv4core.load_model("tiny", backend=backend, device="cuda")
    model.configure_cache(max_requests=8, max_tokens=8192, max_request_tokens=1024, window_block=8, block_tokens=32)
    if model.graph_status():
        pytest.skip(f"graphs off for backend {backend!r}: {model.graph_status()}")
    prompts = [list(range(3, 3 + n)) for n in (5, 17, 30)]
    kw = dict(temperature=0.9, top_p=0.9, top_k=50, seed=3)
    got = model.generate(prompts, 24, **kw)
    assert model._graphs.replays > 0 and not model.graph_failures()
    assert all(k[-1] == "draw-filtered" for k in model._graphs.graphs)
    model.use_graphs = False
    assert model.generate(prompts, 24, **kw) == got
    model.use_graphs = True
    sts = [model.new_state() for _ in prompts]
    for st, p in zip(sts, prompts):     # all but the last prompt token: the first draw is a decode step's
        model.forward_batch(torch.tensor(p[:-1]), torch.arange(len(p) - 1), torch.zeros(len(p) - 1, dtype=torch.long),
                            [st])
    rows = RowSampling(SamplingParams(0.9, 0.9, 50), [request_seed(3, i) for i in range(3)])
    toks = model.forward_batch(torch.tensor([p[-1] for p in prompts]), torch.tensor([s.length for s in sts]),
                               torch.arange(3), sts, sample=rows)
    out = [toks.tolist()]
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        seq = []
        for _ in range(23):
            toks = model.forward_batch(toks, torch.tensor([s.length for s in sts]), torch.arange(3), sts, sample=rows)
            seq.append(toks)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    out += [t.tolist() for t in seq]
    for s in sts:
        s.release()
    assert [list(r) for r in zip(*out)] == got     # generate's draws: the same seeds and positions
