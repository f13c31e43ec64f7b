"""`dsv4core generate --tp/--ep` launched for real by torchrun (`python -m torch.distributed.run`,
the module behind the `torchrun` script), two CPU ranks over gloo on the tiny model.

The greedy tokens rank 0 prints must equal those of a single-process run of the same command
(the parallel model's logits are within 1e-5 relative of the single-process ones,
tests/test_model_parallel.py; greedy argmax over the tiny model's logits does not flip at that
distance, and the tokens are compared exactly). Bad layouts must end every rank with the layout
error and a non-zero exit, never a hang. Every launch runs in its own process group under a
wall-clock limit; on a timeout the whole group (torchrun and its ranks) is killed and the test
fails saying so.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys

import pytest

from dsv4core.cli import main

LAUNCH_TIMEOUT_S = 120     # one torchrun launch (about 5 s on 2 cores); a hang fails the test after this
DIST_TIMEOUT_S = "30"      # DSV4CORE_DIST_TIMEOUT of the ranks: a rank left waiting errors out by then
PROMPTS = ["0,17,42,7", "5,6"]
NEW_TOKENS = "5"


def _torchrun(nproc: int, *args: str, monitor_s: float = 0.5) -> subprocess.CompletedProcess:
    """`python -m torch.distributed.run --standalone --nproc-per-node N -m dsv4core generate ...`.
    `--standalone`: a free rendezvous port (concurrent runs do not collide). `monitor_s`: how
    often torchrun polls its ranks (a failed rank gets the others terminated at the next poll)."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc),
           "--monitor-interval", str(monitor_s), "-m", "dsv4core", "generate", "--model", "tiny",
           "--max-new-tokens", NEW_TOKENS, "--no-progress", "--json", *args]
    for p in PROMPTS:
        cmd += ["--input-ids", p]
    env = {**os.environ, "DSV4CORE_DIST_TIMEOUT": DIST_TIMEOUT_S, "OMP_NUM_THREADS": "1"}
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                            start_new_session=True)
    try:
        out, err = proc.communicate(timeout=LAUNCH_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)          # torchrun and every rank it started
        out, err = proc.communicate()
        pytest.fail(f"torchrun did not finish within {LAUNCH_TIMEOUT_S} s (a hang): {' '.join(cmd)}\n"
                    f"stderr tail:\n{err[-3000:]}")
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


def _single_process_tokens(capsys) -> list[list[int]]:
    argv = ["generate", "--model", "tiny", "--max-new-tokens", NEW_TOKENS, "--no-progress", "--json"]
    for p in PROMPTS:
        argv += ["--input-ids", p]
    assert main(argv) == 0
    return json.loads(capsys.readouterr().out)["new_tokens"]


@pytest.mark.parametrize("tp,ep", [(2, 1), (1, 2)])
def test_torchrun_generate_equals_single_process(tp, ep, capsys, monkeypatch):
    for k in ("RANK", "WORLD_SIZE"):
        monkeypatch.delenv(k, raising=False)
    want = _single_process_tokens(capsys)
    r = _torchrun(tp * ep, "--tp", str(tp), "--ep", str(ep))
    assert r.returncode == 0, f"torchrun exited {r.returncode}: {' '.join(r.args)}\nstderr tail:\n{r.stderr[-3000:]}"
    try:
        got = json.loads(r.stdout)                 # rank 0 prints one JSON document; the others nothing
    except json.JSONDecodeError:
        pytest.fail(f"stdout is not one JSON document (did more than rank 0 print?):\n{r.stdout[-3000:]}")
    assert (got["tp"], got["ep"]) == (tp, ep)
    assert got["new_tokens"] == want, f"tp={tp} ep={ep}: torchrun tokens {got['new_tokens']} != single-process {want}"


@pytest.mark.parametrize("nproc,args,message", [
    (2, ("--tp", "3"), "tp=3 must divide num_attention_heads=4 (tp=3, ep=1)"),
    (2, ("--tp", "2", "--ep", "2"), "tp=2 x ep=2 = 4 ranks, but the process group has world size 2"),
], ids=["tp-does-not-divide-heads", "world-size-mismatch"])
def test_torchrun_bad_layout_fails_with_the_layout_error(nproc, args, message):
    # monitor_s: the ranks fail at the same point of start-up; polling every 2 s usually lets each
    # one print its error before torchrun terminates the rest. "Usually" is not a test: on a loaded
    # machine a slow rank can be killed first, so this checks that every error printed is the layout
    # error of a real rank and that at least one was printed; that every rank raises it is shown
    # in-process (the tests below and tests/test_model_parallel.py).
    r = _torchrun(nproc, *args, monitor_s=2)
    assert r.returncode != 0, f"torchrun exited 0 for a bad layout {args}:\n{r.stdout[-2000:]}"
    assert r.stdout == "", r.stdout
    # the ranks write to one stderr pipe: each error is one write, so it is a whole line
    lines = [ln for ln in r.stderr.splitlines() if "dsv4core generate: error" in ln]
    ranks = sorted(int(m.group(1)) for ln in lines
                   if (m := re.fullmatch(rf"dsv4core generate: error \(rank (\d) of {nproc}\): {re.escape(message)}",
                                         ln)))
    assert ranks and len(ranks) == len(lines) and set(ranks) <= set(range(nproc)), \
        f"want the error {message!r} from the ranks, got:\n" + "\n".join(lines) + f"\nstderr tail:\n{r.stderr[-3000:]}"


def test_generate_under_a_launcher_without_tp_or_ep_is_a_clear_error(monkeypatch, capsys):
    """torchrun with N > 1 processes but tp = ep = 1 would run the whole model N times and print
    it N times: an error naming the world size and the flags."""
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "1")
    rc = main(["generate", "--model", "tiny", "--input-ids", "1,2", "--max-new-tokens", "1"])
    err = capsys.readouterr().err
    assert rc == 2
    assert err.strip() == ("dsv4core generate: error (rank 1 of 2): started as 2 processes (WORLD_SIZE=2) but "
                           "--tp 1 x --ep 1 = 1 rank: give --tp / --ep with tp x ep = 2, or run one process "
                           "without torchrun"), err


def test_generate_ep_not_dividing_the_experts_is_a_clear_error_before_any_collective(monkeypatch, capsys):
    """The layout is checked before the process group is touched (the same check on every rank;
    the torchrun tests above show it ending every rank for tp)."""
    monkeypatch.setenv("WORLD_SIZE", "3")
    monkeypatch.setenv("RANK", "2")
    rc = main(["generate", "--model", "tiny", "--ep", "3", "--input-ids", "1,2", "--max-new-tokens", "1"])
    err = capsys.readouterr().err
    assert rc == 2
    assert err.strip() == "dsv4core generate: error (rank 2 of 3): ep=3 must divide n_routed_experts=8 (tp=1, ep=3)", err
