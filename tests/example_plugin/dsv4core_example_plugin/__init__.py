"""An out-of-tree dsv4core backend: a CPU ``rms_norm`` computed in chunks of the last dim, and an
``hc_post`` that declines bf16 inputs (to exercise per-call fallback)."""

import torch

from dsv4core.hal import Backend, hookimpl


def _rms_norm(x, weight, eps):
    xf = x.float()
    ss = sum(c.pow(2).sum(-1, keepdim=True) for c in xf.split(64, dim=-1))
    y = xf * torch.rsqrt(ss / x.shape[-1] + eps)
    return (y if weight is None else y * weight.float()).to(x.dtype)


def _hc_post(o, residual, post, comb):
    mixed = torch.matmul(comb.transpose(1, 2), residual.float())
    return (post.unsqueeze(-1) * o.float().unsqueeze(1) + mixed).to(residual.dtype)


@hookimpl
def dsv4core_register_backends(register):
    b = Backend(name="example", version="0.3.0", device_types=("cpu",), priority=10,
                description="example third-party plugin (tests)")
    b.add("rms_norm", _rms_norm)
    b.add("hc_post", _hc_post,
          supports=lambda o, residual, post, comb: residual.dtype == torch.float32,
          why_not=lambda o, residual, post, comb: f"only float32 residuals, got {residual.dtype}")
    register(b)
