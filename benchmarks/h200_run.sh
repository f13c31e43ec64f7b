#!/usr/bin/env bash
# How the H200 figures in benchmarks/results/h200/ are produced (the machine: benchmarks/results/h200/system.json;
# Python 3.12, torch 2.11, Triton 3.6, no pydantic). Wheels for what the machine lacks sit in .whl/ (git-ignored): pydantic,
# pydantic-core, annotated-types, typing-inspection, transformers 5.23.0 (the peer).
#   bash benchmarks/h200_run.sh STEP[,STEP...]    results under $OUT (default /tmp/dsv4core-out), laid out as
#   benchmarks/results/: $OUT/h200/<date>_<commit>/<kind>/<name> (COMMIT: the measured commit, default git's HEAD);
#   copy that folder into benchmarks/results/h200/, delete what it supersedes, run benchmarks/index_results.py
#   (STEP+STEP runs those steps at the same time: for numerics-only steps, never around a timing,
#   and never cand, which reinstalls the package the other steps import)
# steps:
#   cand    the portable kernels without a cuda validation record (plugins/cuda/dsv4core_cuda/validation/),
#           served through DSV4CORE_CUDA_TRY: their conformance; those that pass stay tried for the steps after it
#   conf    conformance --backend cuda (small, flash, pro; CONF_OPS: a comma list of ops, default all; CONF_JOBS worker
#           processes sharing the GPU, default 8: the Triton compiles run in parallel); a full
#           passing run is also written as $OUT/validation/h200.json, the cuda validation record
#   e2e     graph-vs-eager test (E2E_TEST=0: skipped) + benchmarks/e2e_decode.py (PEER=1: transformers eager
#           too; E2E_WEIGHTS=official: FP8 projections + packed FP4 experts, files decode-flash-4layers-official.*)
#   ops     benchmarks/step_ops.py: aten ops per eager decode step by source line (flash, batch 1 and 32)
#   mid     benchmarks/bench_model.py --configs mid, batch 32, against transformers
#   vendor  benchmarks/vendor_tables_on_cuda.py (the ROCm and XPU launch tables on this GPU)
#   tune    benchmarks/tune_triton.py: launch-config sweeps (TUNE_OPS: comma list of sweep labels; TUNE_SET: a list of
#           sweeps, default all; FLUSH=read|write)
#   bench   dsv4core bench --backend cuda (BENCH_OPS: comma list, default every op; flash shapes; FLUSH=read|write)
#   spec    benchmarks/spec_decode_bench.py: decode / verify / MTP draft step costs and the speedup they predict
#           (flash dims, 4 layers; E2E_WEIGHTS=official as for e2e; SPEC_BATCHES, default 1,2,4,8,16,32)
#   lmhead  benchmarks/lm_head.py: the lm_head GEMM (fp32 logits) against the weight-streaming floor, its accuracy
#           against fp64 beside torch's matmuls, Flash and Pro hidden sizes (LMHEAD_TOKENS, default 1,2,8,64,512;
#           LMHEAD_CHAINS: TUNE chain values timed beside the default, default 0,16,64)
#   mixed   benchmarks/mixed_steps.py: prefill chunks (MIXED_CHUNKS, default 512,2048,8192), mixed (31 decodes + a chunk),
#           verify and decode steps of 32 requests at 1k context: wall, host and device-busy ms, graphs against eager
#           (flash dims, MIXED_LAYERS default 43, MIXED_EXPERTS default 32; E2E_WEIGHTS=official as for e2e)
#   verify  benchmarks/verify_overhead.py: the cost of DSV4CORE_VERIFY at 1 % and 10 % with graphs on (whole-step
#           sampling; VERIFY_CONFIGS, default mid)
#   vchecks benchmarks/verify_checks.py: a whole-step verify sampled step against graph replay and eager, the check
#           time per op (flash dims, VCHECKS_LAYERS default 4, 32 experts, 8 decodes and a 512-token chunk at 1k context)
#   mtptok  benchmarks/train_tiny_mtp.py --measure: the trained tiny-mtp checkpoint (MTP_CKPT, default
#           scratch/tiny-mtp-trained: carry it) on cuda, batch-1 tokens/s with and without speculation
#   serve   benchmarks/serving.py: SERVE_REQUESTS (default 64) requests arriving at SERVE_RATE a second (default 8;
#           inf: all at once), prompts of 256..4096 tokens, 128 new tokens each: TTFT, inter-token latency, tok/s,
#           steps by kind; then the first token of one prompt alone at SERVE_TTFT tokens (default 1024,8192,32768):
#           wall, prefill tok/s, device-busy ms (flash dims, 43 layers, 32 experts; E2E_WEIGHTS=official as for e2e;
#           SERVE_CHUNK: prefill tokens of a prompt a step, SERVE_STEP_TOKENS: tokens a step (default 8192), SERVE_RUNS:
#           timed runs (later ones replay the graphs the first recorded), SERVE_NAME: a suffix of the result's name)
#   eprof   benchmarks/eager_profile.py: eager decode steps under cProfile, host time per function and per place
#           (flash dims, 4 layers, 32 experts, bf16, batch 1 and 32)
#   fimhc   benchmarks/flashinfer_mhc.py: FlashInfer's mHC kernels (backend cuda-flashinfer) built from
#           .vendor/flashinfer-mhc (benchmarks/fetch_flashinfer_mhc.py; carry .vendor and .whl), their
#           conformance and their timings beside ours
set -uo pipefail
steps=${1:-e2e}
OUT=${OUT:-/tmp/dsv4core-out}
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
install() { python3 -m pip install -q --no-deps --no-build-isolation --no-compile --upgrade --target /tmp/dsv . >/dev/null; }
install || exit 1
export PYTHONPATH=/tmp/site:/tmp/dsv PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv,noheader
COMMIT=${COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}
RES="$OUT/h200/$(date -u +%F)_$COMMIT"
mkdir -p "$RES"/{conformance,bench,e2e,tune}

cand() {
  local ops passed
  ops=$(python3 -c "from dsv4core.kernels.triton import OPS; from dsv4core_cuda import CUDA_OPS; print(','.join(sorted(set(OPS) - CUDA_OPS)))")
  [ -n "$ops" ] || { echo "cand: every portable kernel has a validation record"; return; }
  echo "candidates: $ops"
  DSV4CORE_CUDA_TRY=$ops timeout 200 python3 -m dsv4core conformance --backend cuda --device cuda --shapes small,flash,pro \
    --ops "$ops" --json "$RES/conformance/cuda-candidates.json" --markdown "$RES/conformance/cuda-candidates.md" 2>&1 | tail -12
  # a run cut short (no JSON, or not complete) confirms nothing: no candidate stays tried
  passed=$(python3 -c "
import json
try:
    d = json.load(open('$RES/conformance/cuda-candidates.json'))
    ok = sorted(o['op'] for o in d['ops'] if o['status'] == 'passed') if d['complete'] else []
except (OSError, ValueError, KeyError):
    ok = []
print(','.join(ok))")
  echo "passed, tried in the steps after this one: ${passed:-none}"
  export DSV4CORE_CUDA_TRY=$passed
}
conf() {
  timeout ${CONF_LIMIT:-330} python3 -m dsv4core conformance --backend cuda --device cuda --shapes small,flash,pro \
    --jobs ${CONF_JOBS:-8} ${CONF_OPS:+--ops $CONF_OPS} --json "$RES/conformance/cuda-${CONF_OPS:-all-ops}.json" \
    --markdown "$RES/conformance/cuda-${CONF_OPS:-all-ops}.md" 2>&1 | tail -30
  [ -n "${CONF_OPS:-}" ] || python3 -c "
import json, os, torch, triton
d = json.load(open('$RES/conformance/cuda-all-ops.json'))
if not d['failed']:
    rec = {'hardware': f'{torch.cuda.get_device_name()} (sm{\"\".join(map(str, torch.cuda.get_device_capability()))}), CUDA {torch.version.cuda}, torch {torch.__version__}, Triton {triton.__version__}',
           'report': '$RES/conformance/cuda-all-ops.json'.replace('$OUT/', 'benchmarks/results/') + ' (the full report, every case)'}
    rec.update({k: v for k, v in d.items() if k != 'ops'})
    rec['ops'] = [{k: v for k, v in o.items() if k != 'cases'} for o in d['ops']]
    os.makedirs('$OUT/validation', exist_ok=True)
    json.dump(rec, open('$OUT/validation/h200.json', 'w'), indent=1)
    print('wrote the validation record $OUT/validation/h200.json')"
}
e2e() {
  local peer=""
  [ "${PEER:-0}" = 1 ] && peer="--peer --peer-combos 1x1024,8x1024,32x1024"
  local w=${E2E_WEIGHTS:-bf16}
  [ "${E2E_TEST:-1}" = 0 ] || python3 -m pytest -q -p no:cacheprovider tests/test_model_graphs_cuda.py -rs 2>&1 | tail -5
  timeout ${E2E_LIMIT:-420} python3 benchmarks/e2e_decode.py --device cuda --dims flash --layers 4 --experts 256 \
    --backend cuda --combos ${E2E_COMBOS:-1x1024,8x1024,32x1024,64x1024,128x1024,1x8192,8x8192} \
    --steps 16 --warmup 3 $peer --time-budget ${E2E_BUDGET:-240} --weights "$w" \
    --json "$RES/e2e/decode-flash-4layers-$w.json" --markdown "$RES/e2e/decode-flash-4layers-$w.md" 2>&1 | tail -22
}
ops() {
  for b in 1 32; do
    timeout 150 python3 benchmarks/step_ops.py --device cuda --dims flash --experts 32 --batch $b \
      --json "$RES/bench/step-aten-ops-flash-b$b.json" 2>&1 | head -${OPS_LINES:-40}
  done
}
mid() {
  timeout 200 python3 benchmarks/bench_model.py --configs mid --backend cuda --device cuda --dtype bfloat16 \
    --batch 32 --prompt 1024 --json 2>&1 > "$RES/bench/model-mid-b32-vs-transformers.json" | tail -5
  tail -c 1200 "$RES/bench/model-mid-b32-vs-transformers.json"; echo
}
vendor() {   # every table at small shapes, then the flash shapes for as many tables as time allows
  timeout ${VENDOR_LIMIT:-200} python3 benchmarks/vendor_tables_on_cuda.py --shapes small \
    --json "$RES/conformance/rocm-xpu-launch-tables-small.json" 2>&1 | grep -E "^(rocm|xpu)|wrote" | tail -8
  timeout ${VENDOR_FLASH_LIMIT:-200} python3 benchmarks/vendor_tables_on_cuda.py --shapes flash \
    --json "$RES/conformance/rocm-xpu-launch-tables-flash.json" 2>&1 | grep -E "^(rocm|xpu)|wrote" | tail -8
}
tune() {
  timeout ${TUNE_LIMIT:-300} python3 benchmarks/tune_triton.py ${TUNE_OPS:+--ops $TUNE_OPS} ${TUNE_SET:+--set $TUNE_SET} --flush ${FLUSH:-read} \
    --json "$RES/tune/${TUNE_SET:-all-ops}-flash$([ "${FLUSH:-read}" = read ] || echo "-$FLUSH-flush").json" 2>&1 | tail -${TUNE_LINES:-5}
}
bench() {
  DSV4CORE_FLASHINFER_SRC=$PWD/.vendor/flashinfer-mhc DSV4CORE_FLASHINFER_CACHE=/tmp/dsv4core-fi-mhc \
    timeout ${BENCH_LIMIT:-300} python3 -m dsv4core bench --backend cuda --shapes flash --no-compile --flush ${FLUSH:-read} \
    ${BENCH_OPS:+--ops $BENCH_OPS} --json "$RES/bench/cuda-ops-flash-${FLUSH:-read}-flush.json" --markdown "$RES/bench/cuda-ops-flash-${FLUSH:-read}-flush.md" \
    2>&1 | tail -${BENCH_LINES:-50}
}
spec() {
  local w=${E2E_WEIGHTS:-bf16}
  timeout ${SPEC_LIMIT:-420} python3 benchmarks/spec_decode_bench.py --device cuda --model flash --layers 4 --backend cuda \
    --weights "$w" --batches ${SPEC_BATCHES:-1,2,4,8,16,32} --json "$RES/bench/spec-decode-flash-4layers-$w.json" \
    --markdown "$RES/bench/spec-decode-flash-4layers-$w.md" 2>&1 | tail -30
}
lmhead() {
  # Flash's hidden size, then Pro's (7,168: the longest K of the lm_head cases)
  timeout ${LMHEAD_LIMIT:-200} python3 benchmarks/lm_head.py --backend cuda --tokens ${LMHEAD_TOKENS:-1,2,8,64,512} \
    --chains ${LMHEAD_CHAINS:-0,16,64} --json "$RES/bench/lm-head-flash.json" 2>&1 | tail -25
  timeout ${LMHEAD_LIMIT:-200} python3 benchmarks/lm_head.py --backend cuda --hidden 7168 --tokens ${LMHEAD_TOKENS:-1,2,8,64,512} \
    --chains ${LMHEAD_CHAINS:-0,16,64} --json "$RES/bench/lm-head-pro.json" 2>&1 | tail -25
}
mixed() {
  local w=${E2E_WEIGHTS:-bf16} L=${MIXED_LAYERS:-43}
  timeout ${MIXED_LIMIT:-420} python3 benchmarks/mixed_steps.py --device cuda --backend cuda --config flash --layers $L \
    --experts ${MIXED_EXPERTS:-32} --weights "$w" --requests 32 --context 1024 --chunks ${MIXED_CHUNKS:-512,2048,8192} \
    --steps ${MIXED_STEPS:-5} --json "$RES/bench/step-kinds-flash-${L}layers-$w.json" 2>&1 | tail -12
}
verify() {
  timeout ${VERIFY_LIMIT:-240} python3 benchmarks/verify_overhead.py --device cuda --backend cuda --configs ${VERIFY_CONFIGS:-mid} \
    --dtype bfloat16 --graphs on --fractions 0,0.1,0.01 --min-sampled ${VERIFY_SAMPLED:-10} --json "$RES/bench/verify-overhead-cuda.json" 2>&1 | tail -20
}
vchecks() {
  local L=${VCHECKS_LAYERS:-4}
  timeout ${VCHECKS_LIMIT:-300} python3 benchmarks/verify_checks.py --device cuda --backend cuda --config flash --layers $L \
    --experts 32 --requests 8 --context 1024 --chunk 512 --cases decode,prefill \
    --json "$RES/bench/verify-checks-flash-${L}layers-bf16.json" 2>&1 | tail -24
}
mtptok() {
  timeout ${MTPTOK_LIMIT:-200} python3 benchmarks/train_tiny_mtp.py --measure ${MTP_CKPT:-scratch/tiny-mtp-trained} \
    --device cuda --backend cuda --json "$RES/bench/tiny-mtp-trained-speculation-cuda.json" 2>&1 | tail -30
}
serve() {
  local w=${E2E_WEIGHTS:-bf16}
  timeout ${SERVE_LIMIT:-300} python3 benchmarks/serving.py --device cuda --backend cuda --config flash --layers 43 \
    --experts 32 --weights "$w" --requests ${SERVE_REQUESTS:-64} --rate ${SERVE_RATE:-8} \
    ${SERVE_CHUNK:+--prefill-chunk $SERVE_CHUNK} --max-step-tokens ${SERVE_STEP_TOKENS:-8192} --runs ${SERVE_RUNS:-1} \
    --ttft-lengths "${SERVE_TTFT-1024,8192,32768}" --json "$RES/bench/serving-flash-43layers-$w${SERVE_NAME:+-$SERVE_NAME}.json" 2>&1 | tail -12
}
eprof() {
  timeout ${EPROF_LIMIT:-200} python3 benchmarks/eager_profile.py --device cuda --backend cuda --config flash --layers 4 \
    --experts 32 --batches 1,32 --json "$RES/bench/eager-profile-flash-4layers-bf16.json" 2>&1 | tail -40
}
fimhc() {
  DSV4CORE_FLASHINFER_SRC=$PWD/.vendor/flashinfer-mhc DSV4CORE_FLASHINFER_CACHE=/tmp/dsv4core-fi-mhc \
    timeout ${FIMHC_LIMIT:-240} python3 benchmarks/flashinfer_mhc.py --json "$RES/bench/flashinfer-mhc-hc_pre-hc_post-flash.json" 2>&1 | tail -30
}
for group in ${steps//,/ }; do
  echo "=== $group $(date +%T)"
  if [[ $group == *+* ]]; then
    for s in ${group//+/ }; do $s > "$OUT/$s.log" 2>&1 & done
    wait
    for s in ${group//+/ }; do echo "--- $s"; tail -${LOG_LINES:-25} "$OUT/$s.log"; done
  else
    $group
  fi
done
echo "=== done $(date +%T)"
