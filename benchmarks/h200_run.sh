#!/usr/bin/env bash
# How the H200 figures in benchmarks/results/ were produced (device machine: Python 3.12, torch 2.11,
# Triton 3.6, no pydantic). Wheels for what the machine lacks sit in .whl/ (git-ignored): pydantic,
# pydantic-core, annotated-types, typing-inspection, transformers 5.23.0 (the peer).
#   bash benchmarks/h200_run.sh STEP[,STEP...]    results under $OUT (default /tmp/dsv4core-out)
#   (STEP+STEP runs those steps at the same time: for numerics-only steps, never around a timing,
#   and never cand, which reinstalls the package the other steps import)
# steps:
#   cand    the kernels cuda leaves to the reference (NOT_SERVED), served in this copy: their
#           conformance; those that fail stay unserved for the steps after it
#   conf    conformance --backend cuda (small, flash, pro; CONF_OPS: a comma list of ops, default all)
#   e2e     graph-vs-eager test (E2E_TEST=0: skipped) + benchmarks/e2e_decode.py (PEER=1: transformers eager
#           too; E2E_WEIGHTS=official: FP8 projections + packed FP4 experts, files e2e-decode-h200-official.*)
#   ops     benchmarks/step_ops.py: aten ops per eager decode step by source line (flash, batch 1 and 32)
#   mid     benchmarks/bench_model.py --configs mid, batch 32, against transformers
#   vendor  benchmarks/vendor_tables_on_cuda.py (the ROCm and XPU launch tables on this GPU)
#   tune    benchmarks/tune_triton.py: launch-config sweeps (TUNE_OPS: comma list of sweep labels; TUNE_SET: a list of
#           sweeps, default all; FLUSH=read|write)
#   bench   dsv4core bench --backend cuda (BENCH_OPS: comma list, default every op; flash shapes; FLUSH=read|write)
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
init=plugins/cuda/dsv4core_cuda/__init__.py

cand() {
  local ops failed
  ops=$(python3 -c "import re;print(','.join(sorted(re.findall(r'\"(\w+)\"', re.search(r'^NOT_SERVED = frozenset\((.*)\)', open('$init').read(), re.M).group(1)))))")
  [ -n "$ops" ] || { echo "cand: nothing in NOT_SERVED"; return; }
  sed -i 's/^NOT_SERVED = frozenset({.*})$/NOT_SERVED = frozenset()/' $init
  install || exit 1
  echo "candidates: $ops"
  timeout 200 python3 -m dsv4core conformance --backend cuda --device cuda --shapes small,flash,pro --ops "$ops" \
    --json "$OUT/conformance-cuda-h200-candidates.json" --markdown "$OUT/conformance-cuda-h200-candidates.md" 2>&1 | tail -12
  # a run cut short (no JSON, or not complete) confirms nothing: every candidate stays unserved
  failed=$(python3 -c "
import json, sys
try:
    d = json.load(open('$OUT/conformance-cuda-h200-candidates.json'))
    bad = None if not d['complete'] else sorted(o['op'] for o in d['ops'] if o['status'] != 'passed')
except (OSError, ValueError, KeyError):
    bad = None
print(sys.argv[1] if bad is None else ','.join(bad))" "$ops")
  echo "still not served: ${failed:-none}"
  python3 -c "import sys;f=[x for x in sys.argv[1].split(',') if x];s=open('$init').read();open('$init','w').write(s.replace('NOT_SERVED = frozenset()','NOT_SERVED = frozenset({'+', '.join(repr(x).replace(chr(39),chr(34)) for x in f)+'})'))" "$failed"
  grep -n '^NOT_SERVED' $init; cp $init "$OUT/cuda-init-as-run.py"
  install || exit 1
}
conf() {
  timeout ${CONF_LIMIT:-330} python3 -m dsv4core conformance --backend cuda --device cuda --shapes small,flash,pro \
    ${CONF_OPS:+--ops $CONF_OPS} --json "$OUT/conformance-cuda-h200.json" --markdown "$OUT/conformance-cuda-h200.md" 2>&1 | tail -30
}
e2e() {
  local peer=""
  [ "${PEER:-0}" = 1 ] && peer="--peer --peer-combos 1x1024,8x1024,32x1024"
  local w=${E2E_WEIGHTS:-bf16} tag=""
  [ "$w" = bf16 ] || tag="-$w"
  [ "${E2E_TEST:-1}" = 0 ] || python3 -m pytest -q -p no:cacheprovider tests/test_model_graphs_cuda.py -rs 2>&1 | tail -5
  timeout ${E2E_LIMIT:-420} python3 benchmarks/e2e_decode.py --device cuda --dims flash --layers 4 --experts 256 \
    --backend cuda --combos ${E2E_COMBOS:-1x1024,8x1024,32x1024,64x1024,128x1024,1x8192,8x8192} \
    --steps 16 --warmup 3 $peer --time-budget ${E2E_BUDGET:-240} --weights "$w" \
    --json "$OUT/e2e-decode-h200$tag.json" --markdown "$OUT/e2e-decode-h200$tag.md" 2>&1 | tail -22
}
ops() {
  for b in 1 32; do
    timeout 150 python3 benchmarks/step_ops.py --device cuda --dims flash --experts 32 --batch $b \
      --json "$OUT/step-ops-h200-flash-b$b.json" 2>&1 | head -${OPS_LINES:-40}
  done
}
mid() {
  timeout 200 python3 benchmarks/bench_model.py --configs mid --backend cuda --device cuda --dtype bfloat16 \
    --batch 32 --prompt 1024 --json 2>&1 > "$OUT/bench-model-mid-h200.json" | tail -5; tail -c 1200 "$OUT/bench-model-mid-h200.json"; echo
}
vendor() {   # every table at small shapes, then the flash shapes for as many tables as time allows
  timeout ${VENDOR_LIMIT:-200} python3 benchmarks/vendor_tables_on_cuda.py --shapes small \
    --json "$OUT/conformance-vendor-tables-h200-small.json" 2>&1 | grep -E "^(rocm|xpu)|wrote" | tail -8
  timeout ${VENDOR_FLASH_LIMIT:-200} python3 benchmarks/vendor_tables_on_cuda.py --shapes flash \
    --json "$OUT/conformance-vendor-tables-h200-flash.json" 2>&1 | grep -E "^(rocm|xpu)|wrote" | tail -8
}
tune() {
  timeout ${TUNE_LIMIT:-300} python3 benchmarks/tune_triton.py ${TUNE_OPS:+--ops $TUNE_OPS} ${TUNE_SET:+--set $TUNE_SET} --flush ${FLUSH:-read} \
    --json "$OUT/tune-h200-flash-${FLUSH:-read}.json" 2>&1 | tail -${TUNE_LINES:-5}
}
bench() {
  DSV4CORE_FLASHINFER_SRC=$PWD/.vendor/flashinfer-mhc DSV4CORE_FLASHINFER_CACHE=/tmp/dsv4core-fi-mhc \
    timeout ${BENCH_LIMIT:-300} python3 -m dsv4core bench --backend cuda --shapes flash --no-compile --flush ${FLUSH:-read} \
    ${BENCH_OPS:+--ops $BENCH_OPS} --json "$OUT/bench-cuda-h200-flash-${FLUSH:-read}.json" --markdown "$OUT/bench-cuda-h200-flash-${FLUSH:-read}.md" \
    2>&1 | tail -${BENCH_LINES:-50}
}
fimhc() {
  DSV4CORE_FLASHINFER_SRC=$PWD/.vendor/flashinfer-mhc DSV4CORE_FLASHINFER_CACHE=/tmp/dsv4core-fi-mhc \
    timeout ${FIMHC_LIMIT:-240} python3 benchmarks/flashinfer_mhc.py --json "$OUT/flashinfer-mhc-h200.json" 2>&1 | tail -30
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
