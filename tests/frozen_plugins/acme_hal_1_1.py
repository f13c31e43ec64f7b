"""A third-party backend written against HAL 1.1 as it shipped. Frozen: never update it (see
__init__.py). It implements one of the 1.1 ops (``cache_store``, declared capturable), and the 1.0
forms of ``moe_experts`` and ``all_gather`` (1.1 had no ``w13_scale`` / ``sizes``).
"""

import torch
import torch.distributed as dist

from dsv4core.hal import Backend, hookimpl


def cache_store(pool, index, rows):
    keep = index >= 0
    pool.index_copy_(0, index[keep].long(), rows[keep].to(pool.dtype))


def rope(x, positions, inv_freq, inverse=False):
    ang = (positions.float()[:, None] * inv_freq.float()[None, :]).double()   # the angle is an fp32 product
    cos, sin = ang.cos(), ang.sin()
    if inverse:
        sin = -sin
    shape = (x.shape[0],) + (1,) * (x.dim() - 2) + (inv_freq.shape[0],)
    cos, sin = cos.reshape(shape), sin.reshape(shape)
    xf = x.double()
    half = inv_freq.shape[0]
    rot = xf[..., -2 * half:].unflatten(-1, (half, 2))
    a, b = rot[..., 0], rot[..., 1]
    out = torch.stack((a * cos - b * sin, a * sin + b * cos), dim=-1).flatten(-2)
    return torch.cat((xf[..., :-2 * half], out), dim=-1).to(x.dtype)


def moe_experts(x, ids, weights, w13, w2, swiglu_limit):
    xf = x.float()
    inter = w13.shape[1] // 2
    out = torch.zeros(x.shape, dtype=torch.float32)
    for e in ids[ids >= 0].unique().tolist():
        tok, slot = (ids == e).nonzero(as_tuple=True)
        gu = xf[tok] @ w13[e].float().T
        gate = gu[:, :inter].clamp(max=swiglu_limit)
        up = gu[:, inter:].clamp(-swiglu_limit, swiglu_limit)
        y = (torch.nn.functional.silu(gate) * up) @ w2[e].float().T
        out.index_add_(0, tok, y * weights[tok, slot].float()[:, None])
    return out.to(x.dtype)


def all_gather(x, dim=0, group=None):
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size(group) == 1:
        return x
    parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, x.contiguous(), group=group)
    return torch.cat(parts, dim=dim)


@hookimpl
def dsv4core_register_backends(register):
    b = Backend(name="acme-1.1", version="1.1.0", device_types=("cpu",), api_version=(1, 1), priority=-5,
                description="a plugin written against HAL 1.1 (frozen test fixture)")
    b.add("cache_store", cache_store, capturable=True)
    b.add("rope", rope)
    b.add("moe_experts", moe_experts)
    b.add("all_gather", all_gather)
    register(b)
