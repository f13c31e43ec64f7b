"""Bound-call overhead of the HAL: what a model pays per op call on top of the kernel itself.

Compares, on a trivial implementation (returns its input) so that only call overhead is timed:
  direct      the implementation called as a plain function
  bound       OpTable attribute call (the model's hot path)
  predicate   a bound op whose implementation has a `supports` predicate (checked per call)
  validated   a bound op under strict/debug checking (full input validation per call)
  pluggy      the same function called through a pluggy hook (what per-call pluggy would cost)

Usage: python benchmarks/hal_overhead.py [--calls N]
"""

import argparse
import timeit

import pluggy
import torch

from dsv4core.hal import Backend, bind, catalogue, discover, reset


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--calls", type=int, default=200_000)
    args = ap.parse_args()

    def identity(x, weight, eps):
        return x

    x, w = torch.zeros(4, 8), torch.ones(8)
    # register an in-process backend with the trivial implementation, plain and with a predicate
    reset()
    status = discover()
    plain = Backend(name="overhead-plain", device_types=("cpu",), priority=1000)
    plain.add("rms_norm", identity)
    pred = Backend(name="overhead-pred", device_types=("cpu",), priority=1001)
    pred.add("rms_norm", identity, supports=lambda x, weight, eps: x.dtype is torch.float32)
    from dsv4core.hal.discovery import _status_for

    status[plain.name] = _status_for(plain, "benchmark")
    status[pred.name] = _status_for(pred, "benchmark")
    bound = bind("cpu", backend="overhead-plain", policy="allow", check=False).rms_norm
    predicated = bind("cpu", backend="overhead-pred", policy="allow", check=False).rms_norm
    validated = bind("cpu", backend="overhead-plain", policy="allow", check=True).rms_norm
    assert bound is identity

    class Spec:
        @pluggy.HookspecMarker("bench")
        def op(self, x, weight, eps):
            """one op"""

    class Impl:
        @pluggy.HookimplMarker("bench")
        def op(self, x, weight, eps):
            return x

    pm = pluggy.PluginManager("bench")
    pm.add_hookspecs(Spec)
    pm.register(Impl())
    hook = pm.hook.op

    cases = {
        "direct": lambda: identity(x, w, 1e-6),
        "bound": lambda: bound(x, w, 1e-6),
        "predicate": lambda: predicated(x, w, 1e-6),
        "validated": lambda: validated(x, w, 1e-6),
        "pluggy": lambda: hook(x=x, weight=w, eps=1e-6),
    }
    base = None
    print(f"{'path':<10} {'ns/call':>9} {'overhead vs direct (ns)':>24}")
    for name, fn in cases.items():
        n = args.calls if name != "validated" else args.calls // 10
        t = min(timeit.repeat(fn, number=n, repeat=5)) / n * 1e9
        base = t if base is None else base
        print(f"{name:<10} {t:9.1f} {t - base:24.1f}")
    print(f"(ops in catalogue: {len(catalogue())}; torch {torch.__version__})")
    reset()


if __name__ == "__main__":
    main()
