import torch, time
from dsv4core.hal.quant import quantize_fp4
from dsv4core.bench import get_backend
import dsv4core.kernels.triton.moe as moe
torch.manual_seed(0)
dev = "cuda"
ref = get_backend("reference"); cu = get_backend("cuda")
for (E, H, I, T, k) in [(8, 256, 128, 1, 2), (8, 256, 128, 5, 3), (32, 4096, 2048, 1, 6), (32, 4096, 2048, 8, 6), (32, 4096, 2048, 64, 6), (16, 7168, 3072, 3, 6)]:
    w13 = torch.randn(E, 2 * I, H, device=dev) * H ** -0.5
    w2 = torch.randn(E, H, I, device=dev) * I ** -0.5
    (w13, s13), (w2, s2) = quantize_fp4(w13), quantize_fp4(w2)
    x = torch.randn(T, H, device=dev, dtype=torch.bfloat16)
    ids = torch.stack([torch.randperm(E)[:k] for _ in range(T)]).to(dev).to(torch.int32)
    wt = torch.rand(T, k, device=dev)
    kw = dict(x=x, ids=ids, weights=wt, w13=w13, w2=w2, swiglu_limit=10.0, w13_scale=s13, w2_scale=s2, act_block=128)
    r = ref.impls["moe_experts"].fn(**kw).float()
    outs = {}
    for name, v in (("native", {}), ("portable", {"gemm": None})):
        moe.TUNE.clear(); moe.TUNE.update(v)
        try:
            o = cu.impls["moe_experts"].fn(**kw).float(); torch.cuda.synchronize()
            outs[name] = o
            print(E, H, I, T, k, name, "max|d|/max|r|", float((o - r).abs().max() / r.abs().max()), flush=True)
        except Exception as e:
            print(E, H, I, T, k, name, "ERROR", type(e).__name__, str(e)[:500], flush=True)
    moe.TUNE.clear()
    if len(outs) == 2:
        print("   native vs portable", float((outs["native"] - outs["portable"]).abs().max() / r.abs().max()))
from dsv4core_cuda.fp4_experts import GEMM
print("serves", GEMM.serves(w13, s13, 16, 18), GEMM.serves(w2, s2, 16, 18), w13.dtype, s13.dtype)
