"""A third-party backend written against HAL 1.0. Frozen: never update it (see __init__.py).

Pure PyTorch math of its own (not the reference's), on the CPU.
"""

import torch
import torch.distributed as dist

from dsv4core.hal import Backend, hookimpl


def _world(group):
    return dist.get_world_size(group) if dist.is_available() and dist.is_initialized() else 1


def rms_norm(x, weight, eps):
    xf = x.float()
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    if weight is not None:
        y = y * weight.float()
    return y.to(x.dtype)


def hc_post(o, residual, post, comb):
    r = residual.float()
    mixed = torch.einsum("tij,tih->tjh", comb.float(), r)
    return (post.float().unsqueeze(-1) * o.float().unsqueeze(1) + mixed).to(residual.dtype)


def moe_experts(x, ids, weights, w13, w2, swiglu_limit):
    xf = x.float()
    out = torch.zeros(x.shape, dtype=torch.float32)
    inter = w13.shape[1] // 2
    for t in range(x.shape[0]):
        for slot in range(ids.shape[1]):
            e = int(ids[t, slot])
            if e < 0:
                continue
            gu = w13[e].float() @ xf[t]
            gate = gu[:inter].clamp(max=swiglu_limit)
            up = gu[inter:].clamp(-swiglu_limit, swiglu_limit)
            h = gate * torch.sigmoid(gate) * up
            out[t] += float(weights[t, slot]) * (w2[e].float() @ h)
    return out.to(x.dtype)


def moe_experts_supports(x, ids, weights, w13, w2, swiglu_limit):
    return (x.device.type == "cpu" and w13.dtype in (torch.float32, torch.bfloat16)
            and w2.dtype in (torch.float32, torch.bfloat16))


def all_reduce(x, group=None):
    if _world(group) == 1:
        return x
    y = x.clone()
    dist.all_reduce(y, group=group)
    return y


def all_gather(x, dim=0, group=None):
    ws = _world(group)
    if ws == 1:
        return x
    parts = [torch.empty_like(x) for _ in range(ws)]
    dist.all_gather(parts, x.contiguous(), group=group)
    return torch.cat(parts, dim=dim)


def reduce_scatter(x, dim=0, group=None):
    ws = _world(group)
    if ws == 1:
        return x
    y = all_reduce(x, group)
    return y.chunk(ws, dim=dim)[dist.get_rank(group)].contiguous()


def make_backend(name="acme-1.0"):
    b = Backend(name=name, version="1.0.0", device_types=("cpu",), api_version=(1, 0), priority=-5,
                description="a plugin written against HAL 1.0 (frozen test fixture)")
    b.add("rms_norm", rms_norm)
    b.add("hc_post", hc_post)
    b.add("moe_experts", moe_experts, supports=moe_experts_supports,
          why_not=lambda x, ids, weights, w13, w2, swiglu_limit: f"weights {w13.dtype} on {x.device}")
    b.add("all_reduce", all_reduce)
    b.add("all_gather", all_gather)
    b.add("reduce_scatter", reduce_scatter)
    return b


@hookimpl
def dsv4core_register_backends(register):
    register(make_backend())
