"""Tensor and expert parallelism (dsv4core.model.parallel) on CPU over gloo, ranks spawned by the
test: tp=2, ep=2, tp=2 x ep=2 and tp=4 against the single-process model in float32.

Each rank builds the single-process model and the parallel one from the same seed (the parallel
one holds its slices of the same weights), then compares: prefill logits, decode-with-cache ==
the single model's recompute, greedy tokens, a batch == each request alone. The gloo timeout is
short, so a rank that fails leaves the others an error, never a hang.
"""

from __future__ import annotations

import datetime
import json
import os
import socket
import time

import pytest
import torch
import torch.multiprocessing as mp

from dsv4core.model import DSV4Config
from dsv4core.model.api import TINY_CONFIG, build_model
from dsv4core.model.parallel import Parallel, ParallelError, check_layout, setup, shard_state_dict
from _model_hf import CONFIG_A, CONFIG_B

# float32 logits, relative to max|logit|: a parallel step sums the same products in another order
# (o_b_proj over head groups, the MoE over ranks, one extra rounding per all_reduce), ~1e-7
# relative per layer (measured max ~3e-7 over these configs); 1e-5 is the bound.
REL = 1e-5
STEP_TIMEOUT_S = 12    # the bad-input test's gloo timeout: it also bounds the ranks' skew while both build models
                       # (4 s failed on a machine at load 9); rank 1 then sleeps past it
TIMEOUT_S = 30          # gloo collective timeout: a rank that fails makes the others fail in <= 30 s

LAYOUTS = {  # world size -> [(config name, tp, ep)]
    2: [("A", 2, 1), ("official", 1, 2)],   # official: a quantised checkpoint, each rank reading its experts
    4: [("tiny", 2, 2), ("B", 4, 1)],
}
CONFIGS = {"tiny": TINY_CONFIG, "A": CONFIG_A, "B": CONFIG_B}
# tiny with cuts on quantisation-block boundaries at tp=2 x ep=2 (q_b_proj 128 rows, o_b_proj 128
# columns, shared expert 128 rows a rank for the FP8 128x128 blocks; routed experts 256 of their
# intermediate size for the FP4 32-groups), so an official (quantised) checkpoint can be cut
ALIGNED = {**TINY_CONFIG, "o_lora_rank": 128, "moe_intermediate_size": 512}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max())


def _check_layout(name: str, tp: int, ep: int, rank: int, out_dir: str) -> dict:
    if name == "official":
        import dsv4core

        path = os.path.join(out_dir, "official")
        ref = dsv4core.load_model(path, backend="reference", dtype="float32")
        par = dsv4core.load_model(path, backend="reference", dtype="float32", tp=tp, ep=ep)
        V = ALIGNED["vocab_size"]
    else:
        kw = CONFIGS[name]
        V = kw["vocab_size"]
        ref = build_model(kw, backend="reference", seed=5)
        par = build_model(kw, backend="reference", seed=5, tp=tp, ep=ep)
    g = torch.Generator().manual_seed(7)
    seq = torch.randint(0, V, (44,), generator=g).tolist()
    assert par.parallel.tp == tp and par.parallel.ep == ep and par.parallel.rank == rank
    full = ref.logits(seq)
    got = par.logits(seq)
    r_prefill = _rel(got, full)
    # decode with the parallel model's cache == the single model's recompute
    P = 34
    st = par.new_state()
    out = [par.forward_batch(torch.tensor(seq[:P]), torch.arange(P), torch.zeros(P, dtype=torch.long), [st])]
    for i in range(P, len(seq)):
        out.append(par.forward_batch(torch.tensor([seq[i]]), torch.tensor([i]), torch.tensor([0]), [st]))
    st.release()
    r_decode = _rel(torch.cat(out), full)
    # greedy tokens, a batch of two == each alone (single model)
    prompts = [seq[:13], seq[20:37]]
    want = [ref.generate([p], 6)[0] for p in prompts]
    batch = par.generate(prompts, 6)
    sampled = par.generate(prompts, 4, temperature=1.0, top_p=0.9)   # no seed: rank 0's fresh one on every rank
    return dict(layout=f"{name} tp={tp} ep={ep}", rank=rank, prefill=r_prefill, decode=r_decode,
                greedy_equal=batch == want, tokens=[batch, sampled])


def _worker(rank: int, world: int, port: int, out_dir: str) -> None:
    torch.set_num_threads(1)
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=TIMEOUT_S))
    try:
        res = [_check_layout(name, tp, ep, rank, out_dir) for name, tp, ep in LAYOUTS[world]]
        with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
            json.dump(res, f)
    finally:
        dist.destroy_process_group()


def _spawn(fn, world: int, tmp_path, *extra) -> None:
    mp.spawn(fn, args=(world, _free_port(), str(tmp_path), *extra), nprocs=world, join=True)


@pytest.mark.parametrize("world", sorted(LAYOUTS))
def test_parallel_equals_single_process(world, tmp_path):
    if any(name == "official" for name, _, _ in LAYOUTS[world]):
        from dsv4core.checkpoint.writer import write_official

        m = build_model(ALIGNED, backend="reference", seed=5)
        write_official(m.state_dict(), m.config.to_hf_dict(), tmp_path / "official", reference=False,
                       max_shard_bytes=400_000)
    _spawn(_worker, world, tmp_path)
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(world)]
    for per_layout in zip(*ranks):
        for res in per_layout:
            print(f"[{res['layout']}] rank {res['rank']}: prefill rel {res['prefill']:.2e}, "
                  f"decode-with-cache vs recompute rel {res['decode']:.2e}, greedy equal {res['greedy_equal']}")
            assert res["prefill"] <= REL and res["decode"] <= REL, res
            assert res["greedy_equal"], res
        assert all(r["tokens"] == per_layout[0]["tokens"] for r in per_layout)  # every rank: the same tokens


# ---------------------------------------------------------------------------------------------
# bad input across ranks, a rank that fails mid-step


def _bad_input_worker(rank: int, world: int, port: int, out_dir: str) -> None:
    torch.set_num_threads(1)
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=STEP_TIMEOUT_S))
    msgs = {}
    for case, kw in (("world", dict(config=TINY_CONFIG, tp=2, ep=2)),
                     ("config", dict(config={**TINY_CONFIG, "rms_norm_eps": 1e-6 * (1 + rank)}, tp=2))):
        try:
            build_model(kw.pop("config"), backend="reference", seed=5, **kw)
            msgs[case] = "no error"
        except ParallelError as e:
            msgs[case] = str(e)
    model = build_model(TINY_CONFIG, backend="reference", seed=5, tp=2)
    dist.barrier()
    if rank == 0:
        try:
            model.logits([1, 2, 3])
            msgs["left"] = "no error"
        except RuntimeError as e:
            msgs["left"] = f"{type(e).__name__}: {e}"
    else:   # rank 1 stops taking part (stuck past the timeout): rank 0 must get an error, not hang
        time.sleep(STEP_TIMEOUT_S + 2)
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(msgs, f)
    # A process group whose peer left mid-collective cannot be torn down cleanly: gloo's
    # destructor may abort ("terminate called without an active exception", seen in CI). What
    # this test checks is written above; leave without running the C++ destructors.
    os._exit(0)


def test_bad_input_fails_every_rank_and_a_rank_leaving_fails_the_others(tmp_path):
    _spawn(_bad_input_worker, 2, tmp_path)
    r0, r1 = (json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2))
    print("rank 0:", r0)
    for r in (r0, r1):
        assert r["world"] == "tp=2 x ep=2 = 4 ranks, but the process group has world size 2"
        assert r["config"].startswith("ranks disagree on the model config or layout (rank 0: config ")
    assert r0["config"] == r1["config"]
    assert "timed out" in r0["left"].lower() or "timeout" in r0["left"].lower(), r0["left"]


# ---------------------------------------------------------------------------------------------
# layout checks and weight slicing (single process)


@pytest.mark.parametrize("tp,ep,what", [
    (3, 1, "tp=3 must divide num_attention_heads=4"),
    (4, 1, "tp=4 must divide o_groups=2"),
    (1, 3, "ep=3 must divide n_routed_experts=8"),
    (0, 1, "tp must be an int >= 1; got 0"),
    (1, 2.0, "ep must be an int >= 1; got 2.0"),
])
def test_layout_errors_name_the_value(tp, ep, what):
    with pytest.raises(ParallelError, match=what.replace("(", r"\(").replace(")", r"\)")):
        check_layout(DSV4Config.from_dict(TINY_CONFIG), tp, ep)


def test_shared_expert_split_must_divide():
    cfg = DSV4Config.from_dict({**TINY_CONFIG, "moe_intermediate_size": 24})
    check_layout(cfg, 2, 2)                                  # 24 % 2 == 0 and 24 % 4 == 0
    with pytest.raises(ParallelError, match=r"tp \* ep=16 must divide moe_intermediate_size"):
        check_layout(cfg, 2, 8)                              # 24 % 16 != 0


def test_setup_without_process_group_says_how_to_launch(monkeypatch):
    for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(k, raising=False)
    with pytest.raises(ParallelError, match=r"torchrun --nproc-per-node 2"):
        setup(DSV4Config.from_dict(TINY_CONFIG), 2, 1)


@pytest.mark.parametrize("kw", [TINY_CONFIG, CONFIG_A], ids=["tiny", "A"])
def test_shards_have_model_shapes_and_reassemble(kw):
    """Every rank's cut has the shapes of a model built for it, and the cuts of all ranks put
    back together (concatenated along the split dims, replicated tensors equal) give the full
    tensors back."""
    from dsv4core.model import DSV4ForCausalLM

    cfg = DSV4Config.from_dict(kw)
    full = build_model(kw, backend="reference", seed=3).state_dict()
    tp, ep = 2, 2
    shards = []
    for rank in range(tp * ep):
        par = Parallel(tp=tp, ep=ep, rank=rank)
        sd = shard_state_dict(full, cfg, par)
        with torch.device("meta"):
            want = DSV4ForCausalLM(cfg, None, parallel=par).state_dict()
        assert {k: tuple(v.shape) for k, v in sd.items()} == {k: tuple(v.shape) for k, v in want.items()}
        shards.append(sd)
    I = cfg.moe_intermediate_size
    for name, t in full.items():
        parts = [s[name] for s in shards]
        if name.endswith("experts.gate_up_proj"):       # [E, 2I, H]: ep on dim 0, tp halves of gate / up
            per_ep = [torch.cat([torch.cat([p[:, :p.shape[1] // 2] for p in parts[j * tp:(j + 1) * tp]], 1),
                                 torch.cat([p[:, p.shape[1] // 2:] for p in parts[j * tp:(j + 1) * tp]], 1)], 1)
                      for j in range(ep)]
            back = torch.cat(per_ep, 0)
        elif name.endswith("experts.down_proj"):        # [E, H, I]
            back = torch.cat([torch.cat(parts[j * tp:(j + 1) * tp], 2) for j in range(ep)], 0)
        elif "shared_experts" in name:                  # split over all 4 ranks
            back = torch.cat(parts, 1 if name.endswith("down_proj.weight") else 0)
        elif name.endswith(("q_b_proj.weight", "o_a_proj.weight", "sinks", "embed_tokens.weight", "lm_head.weight")) \
                and "compressor" not in name:
            back = torch.cat(parts[:tp], 0)             # tp ranks of ep_rank 0; ep_rank 1 holds the same
            assert all(torch.equal(parts[i], parts[i + tp]) for i in range(tp))
        elif name.endswith("o_b_proj.weight"):
            back = torch.cat(parts[:tp], 1)
        else:
            assert all(p.shape == t.shape for p in parts), name
            back = parts[0]
        assert torch.equal(back, t), name
    assert I % 4 == 0


def test_fp8_block_scales_are_cut_with_their_weights():
    cfg = DSV4Config.from_dict(TINY_CONFIG)          # q_b_proj [h*d = 256, 32]: 128 rows a tp=2 rank
    w = torch.randn(256, 32)
    sc = torch.tensor([[2.0], [4.0]])                # [256/128, ceil(32/128)]
    name = "model.layers.0.self_attn.q_b_proj.weight"
    for rank in range(2):
        sd = shard_state_dict({name: w, name + "_scale_inv": sc}, cfg, Parallel(tp=2, rank=rank))
        assert torch.equal(sd[name], w[rank * 128:(rank + 1) * 128])
        assert torch.equal(sd[name + "_scale_inv"], sc[rank:rank + 1])
    # o_b_proj [H, G*R = 32]: a tp=2 cut at column 16 splits a 128-column scale block
    ob = "model.layers.0.self_attn.o_b_proj.weight"
    with pytest.raises(ParallelError, match="o_b_proj.weight: .*splits a 128-element FP8 scale block"):
        shard_state_dict({ob: torch.randn(64, 32), ob + "_scale_inv": torch.ones(1, 1)}, cfg, Parallel(tp=2, rank=0))


def test_packed_fp4_expert_scales_are_cut_with_their_experts():
    """Packed FP4 routed experts (uint8, two values a byte in the last dim) with one scale per 32
    values: tp=2 x ep=2 rank 3 holds experts 4..7, intermediate 256..512 (ALIGNED: I = 512)."""
    cfg = DSV4Config.from_dict(ALIGNED)
    E, I, H = cfg.n_routed_experts, cfg.moe_intermediate_size, cfg.hidden_size
    g = torch.Generator().manual_seed(0)
    gu = torch.randint(0, 256, (E, 2 * I, H // 2), generator=g, dtype=torch.uint8)
    gus = torch.rand(E, 2 * I, H // 32, generator=g)
    dn = torch.randint(0, 256, (E, H, I // 2), generator=g, dtype=torch.uint8)
    dns = torch.rand(E, H, I // 32, generator=g)
    pre = "model.layers.0.mlp.experts."
    sd = shard_state_dict({pre + "gate_up_proj": gu, pre + "gate_up_proj_scale_inv": gus,
                           pre + "down_proj": dn, pre + "down_proj_scale_inv": dns}, cfg, Parallel(tp=2, ep=2, rank=3))
    rows = torch.cat([torch.arange(256, 512), torch.arange(I + 256, I + 512)])
    assert torch.equal(sd[pre + "gate_up_proj"], gu[4:8][:, rows])
    assert torch.equal(sd[pre + "gate_up_proj_scale_inv"], gus[4:8][:, rows])
    assert torch.equal(sd[pre + "down_proj"], dn[4:8, :, 128:256])
    assert torch.equal(sd[pre + "down_proj_scale_inv"], dns[4:8, :, 8:16])


def test_generate_cli_with_tp_outside_torchrun_is_a_clear_error(monkeypatch, capsys):
    from dsv4core.cli import main

    for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(k, raising=False)
    rc = main(["generate", "--model", "tiny", "--tp", "2", "--input-ids", "1,2", "--max-new-tokens", "1"])
    err = capsys.readouterr().err
    assert rc == 2 and "tp=2 ep=1 needs 2 processes" in err and "torchrun --nproc-per-node 2" in err


@pytest.mark.parametrize("fmt", ["official", "transformers"])
def test_checkpoint_cut_reads_equal_cuts_of_the_full_load(fmt, tmp_path):
    """Every rank of tp=2 x ep=2 reads only its slices (Checkpoint.load_into(cut=)); they equal
    the cuts of the full load exactly (dequantisation is elementwise within a block)."""
    import dsv4core
    from dsv4core.checkpoint import open_checkpoint
    from dsv4core.checkpoint.writer import write_official, write_transformers
    from dsv4core.model import DSV4ForCausalLM
    from dsv4core.model.parallel import RankCut

    m = build_model(ALIGNED, backend="reference", seed=5)
    path = tmp_path / fmt
    if fmt == "official":
        write_official(m.state_dict(), m.config.to_hf_dict(), path, reference=False, max_shard_bytes=400_000)
    else:
        write_transformers(m.state_dict(), m.config.to_hf_dict(), path, max_shard_bytes=400_000)
    full = dsv4core.load_model(str(path), backend="reference", dtype="float32").state_dict()
    cfg = m.config
    ckpt = open_checkpoint(path)
    for rank in range(4):
        par = Parallel(tp=2, ep=2, rank=rank)
        with torch.device("meta"):
            local = DSV4ForCausalLM(cfg, None, dtype=torch.float32, parallel=par)
        ckpt.load_into(local, device="cpu", cut=RankCut(cfg, par))
        want = shard_state_dict(full, cfg, par)
        got = local.state_dict()
        assert got.keys() == want.keys()
        bad = [k for k in want if not torch.equal(got[k], want[k])]
        assert not bad, bad[:5]


def test_checkpoint_cut_inside_a_scale_block_is_a_clear_error(tmp_path):
    from dsv4core.checkpoint import CheckpointError, open_checkpoint
    from dsv4core.checkpoint.writer import write_official
    from dsv4core.model import DSV4ForCausalLM
    from dsv4core.model.parallel import RankCut

    m = build_model(TINY_CONFIG, backend="reference", seed=5)       # o_b_proj: 32 columns, one FP8 block
    write_official(m.state_dict(), m.config.to_hf_dict(), tmp_path, reference=False)
    par = Parallel(tp=2, rank=1)
    with torch.device("meta"):
        local = DSV4ForCausalLM(m.config, None, parallel=par)
    with pytest.raises(CheckpointError, match="splits a 128-element FP8 scale block"):
        open_checkpoint(tmp_path).load_into(local, cut=RankCut(m.config, par))
