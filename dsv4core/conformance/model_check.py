"""Model-level parity: the built-in tiny model (or a checkpoint) under the backend vs the reference.

The model is loaded once on the reference backend; its op table is then swapped for one that
serves every op the backend implements (and whose ``supports`` accepts the call) with the
backend, the rest with the reference (that is what a user gets at run time). Same weights, same
prompt, both tables:

* logits of one prefill: max relative error (max |diff| / max |reference|) within LOGITS_BOUND;
* greedy decoding for STEPS steps: in float32 the tokens must be identical (a divergence at a step
  whose reference top-2 logits are within the logits bound is a near tie and is reported, not
  failed); in bfloat16 the agreement rate is reported only.
"""

from __future__ import annotations

import time
from typing import Any

import torch

from dsv4core.hal import Backend, OpBinding, OpTable, catalogue

from .runner import FAILED, PASSED

STEPS = 32
PROMPT_LEN = 24
#: max relative logits error vs the reference backend, per dtype (float32 gates, bfloat16 informs)
LOGITS_BOUND = {"float32": 1e-4, "bfloat16": 5e-2}


def backend_table(backend: Backend, device: str) -> OpTable:
    """An OpTable serving ``backend``'s implementations (per-call ``supports`` honoured), the
    reference for the rest."""
    specs = catalogue()
    bindings = {}
    for name, spec in specs.items():
        impl = backend.impls.get(name)
        if impl is None:
            call, served = spec.reference, "reference"
        elif impl.supports is None:
            call, served = impl.fn, backend.name
        else:
            call, served = _with_fallback(impl.fn, impl.supports, spec.reference), backend.name
        bindings[name] = OpBinding(name, served, (backend.name, "reference"), {}, call=call)
    return OpTable(torch.device(device).type, "allow", bindings)


def _with_fallback(fn, supports, ref):
    def call(*args, **kwargs):
        return fn(*args, **kwargs) if supports(*args, **kwargs) else ref(*args, **kwargs)
    return call


def _load(model: str, dtype: torch.dtype, device: str):
    import dsv4core

    return dsv4core.load_model(model, backend="reference", dtype=dtype, device=device)


def check_model(backend: Backend, model: str = "tiny", dtypes=("float32", "bfloat16"), device: str = "cpu",
                seed: int = 0, steps: int = STEPS) -> dict[str, Any]:
    """Run the model-level check; returns a JSON-able dict with ``status`` passed / failed /
    unavailable and one entry per dtype in ``runs``."""
    try:
        import dsv4core  # noqa: F401
        from dsv4core.model.api import load_model  # noqa: F401
    except Exception as e:
        return {"status": "unavailable", "reason": f"model check unavailable: the model core cannot be imported "
                                                    f"({type(e).__name__}: {e})"}
    runs = []
    status = PASSED
    for dt_name in dtypes:
        dt = {"float32": torch.float32, "bfloat16": torch.bfloat16}[dt_name]
        t0 = time.perf_counter()
        try:
            m = _load(model, dt, device)
        except Exception as e:
            if model == "tiny":
                return {"status": "unavailable",
                        "reason": f"model check unavailable: load_model('tiny') failed ({type(e).__name__}: {e})"}
            return {"status": FAILED, "reason": f"cannot load model {model!r}: {type(e).__name__}: {e}", "runs": runs}
        ref_table = m.ops
        V = m.config.vocab_size
        g = torch.Generator().manual_seed(seed)
        prompt = torch.randint(2, V, (PROMPT_LEN,), generator=g).tolist()
        run: dict[str, Any] = {"model": model, "dtype": dt_name, "steps": steps, "message": ""}
        try:
            ref_logits = m.logits(prompt).double()
            ref_tokens = m.generate([prompt], steps)[0]
            m.bind_ops(backend_table(backend, device))
            try:
                be_logits = m.logits(prompt).double()
                be_tokens = m.generate([prompt], steps)[0]
            finally:
                m.bind_ops(ref_table)
        except Exception as e:
            run.update(logits_max_rel=float("nan"), logits_bound=LOGITS_BOUND[dt_name], greedy_agreement=0.0,
                       status=FAILED, message=f"raised {type(e).__name__}: {e}")
            runs.append(run)
            status = FAILED
            continue
        finite = bool(torch.isfinite(be_logits).all())
        rel = float((be_logits - ref_logits).abs().max() / ref_logits.abs().max().clamp_min(1e-30)) if finite \
            else float("inf")
        same = 0
        for a, b in zip(ref_tokens, be_tokens):
            if a != b:
                break
            same += 1
        agree = sum(int(a == b) for a, b in zip(ref_tokens, be_tokens)) / max(1, steps)
        run.update(logits_max_rel=rel, logits_bound=LOGITS_BOUND[dt_name], greedy_agreement=agree,
                   identical_prefix=same, seconds=round(time.perf_counter() - t0, 2))
        ok = True
        if dt_name == "float32":
            if not finite:
                ok, run["message"] = False, "non-finite logits"
            elif rel > LOGITS_BOUND[dt_name]:
                ok, run["message"] = False, f"logits max_rel {rel:.3g} > {LOGITS_BOUND[dt_name]:g}"
            elif same < len(ref_tokens):
                # near tie at the divergence step? (reference logits there)
                ctx = prompt + ref_tokens[:same]
                last = m.logits(ctx)[-1].double()
                gap = float(last[ref_tokens[same]] - last[be_tokens[same]])
                if abs(gap) <= LOGITS_BOUND[dt_name] * float(last.abs().max()):
                    run["message"] = (f"greedy tokens diverge at step {same} on a near tie "
                                      f"(reference logit gap {gap:.3g}); not a failure")
                else:
                    ok, run["message"] = False, (f"greedy tokens diverge at step {same}: reference {ref_tokens[same]}"
                                                 f", backend {be_tokens[same]} (reference logit gap {gap:.3g})")
        run["status"] = PASSED if ok else FAILED
        if not ok:
            status = FAILED
        runs.append(run)
    return {"status": status, "runs": runs}
