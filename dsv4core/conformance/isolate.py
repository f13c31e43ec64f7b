"""The isolated oracle: the cases and their expected outputs from a process that loads no plugin.

With ``isolate`` (``dsv4core conformance --isolate``; the default under ``--require-all``), the
runner does not generate the cases nor run the reference in its own process, where the backend's
plugin is loaded and could have changed anything torch runs (a Python-level patch the oracle
fingerprint sees, or one below it: an aten kernel registered over torch's own). It starts
``python -m dsv4core.conformance.isolate`` with ``DSV4CORE_PLUGINS=none``; that process checks
its own oracle against the files on disk (:mod:`dsv4core.hal.oracle`), generates every selected
case, computes the reference output in the case dtype, the fp64 evaluation and the moved-code
allowance of the official expert math (``compare._moved_code_allowance``: fp64 from the inputs;
None for every other call), and writes them to a file (``torch.save``) that the runner loads. The
runner then calls the backend on those inputs and judges its outputs against those expected
outputs and that allowance (the comparison code is part of the fingerprinted oracle), so it
computes none of the oracle's numbers itself.

Cost: one more Python process (a torch import, about 1-3 s), and every case's inputs and both
expected outputs pass through a temporary file: negligible for ``--shapes small``, seconds and
up to a few GB of temporary disk for ``flash`` / ``pro``. On an accelerator ``--device`` the
child opens its own device context and computes there, as the runner would.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from typing import Sequence

import torch

from .results import ConformanceError


def _child(request: str, out: str) -> int:
    from dsv4core.hal import catalogue, compare, oracle
    from dsv4core.hal.compare import dtype_name

    from .cases import _exc, iter_cases, parse_dtypes

    refusal = oracle.refusal("in the isolated oracle process")
    if refusal:
        print(refusal, file=sys.stderr)
        return 2
    with open(request) as f:
        req = json.load(f)
    specs = catalogue()
    found: dict = {}
    for op in req["ops"]:
        spec = specs[op]
        for sh in req["shapes"]:
            for dt in parse_dtypes(req["dtypes"]):
                key = f"{op}/{sh}/{dtype_name(dt)}"
                try:
                    entries = []
                    for case in iter_cases(spec, sh, dt, req["device"], req["seed"]):
                        try:
                            spec.validate(**case.kwargs)
                            ref, exact = compare.expected_outputs(spec, case.kwargs)
                            allow = compare._moved_code_allowance(spec, case.kwargs)
                            entries.append((case.name, tuple(case.tags), case.kwargs,
                                            (ref.names, ref.tensors), (exact.names, exact.tensors), allow, ""))
                        except Exception as e:  # noqa: BLE001 - reported as that case's harness failure
                            entries.append((case.name, tuple(case.tags), case.kwargs, None, None, None, _exc(e)))
                    found[key] = entries
                except Exception as e:  # noqa: BLE001 - the generator failed
                    found[key] = _exc(e)
    torch.save({"digest": oracle.digest(oracle.expected()), "cases": found}, out)
    return 0


def expected_cases(ops: Sequence[str], shapes: Sequence[str], dtypes: Sequence[str], device: str, seed: int,
                   timeout: float | None = None) -> tuple[str, dict]:
    """Run the isolated oracle process; return (its oracle digest, the cases by
    ``"op/shapes/dtype"``: a list of ``(case, (reference Outputs, fp64 Outputs, moved-code
    allowance or None), "")``, or
    ``(case, None, error)`` for a case whose expected outputs could not be computed; a str when
    the case generator itself failed). Raises ConformanceError when the process fails."""
    from dsv4core.hal.compare import Outputs
    from dsv4core.hal.spec import Case

    with tempfile.TemporaryDirectory(prefix="dsv4core-oracle-") as tmp:
        req, out = os.path.join(tmp, "request.json"), os.path.join(tmp, "expected.pt")
        with open(req, "w") as f:
            json.dump({"ops": list(ops), "shapes": list(shapes), "dtypes": list(dtypes), "device": device,
                       "seed": seed}, f)
        env = dict(os.environ, DSV4CORE_PLUGINS="none")
        p = subprocess.run([sys.executable, "-m", "dsv4core.conformance.isolate", req, out], env=env,
                           capture_output=True, text=True, timeout=timeout)
        if p.returncode != 0:
            tail = (p.stderr or p.stdout).strip()[-2000:]
            raise ConformanceError(f"the isolated oracle process failed (exit {p.returncode}): {tail}")
        data = torch.load(out, map_location=device if device != "cpu" else None, weights_only=False)
    cases: dict = {}
    for key, entries in data["cases"].items():
        if isinstance(entries, str):
            cases[key] = entries
            continue
        cases[key] = [(Case(name, kwargs, tags),
                       None if ref is None else (Outputs(*ref), Outputs(*exact), allow), err)
                      for name, tags, kwargs, ref, exact, allow, err in entries]
    return data["digest"], cases


if __name__ == "__main__":
    sys.exit(_child(sys.argv[1], sys.argv[2]))
