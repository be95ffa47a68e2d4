#!/usr/bin/env bash
# Side by side, in one run: orca-serve's engine (orca and request-level policies, bare loop) and vLLM's
# CPU build on the same checkpoint and the same workload file, both with tcmalloc preloaded.
#   benchmarks/compare_vllm.sh MODEL_DIR [NUM_REQUESTS] [VLLM_PYTHON]
set -euo pipefail
cd "$(dirname "$0")/.."
MODEL=${1:?model dir}
N=${2:-256}
VLLM_PYTHON=${3:-/work/vllm-venv/bin/python}
OUT=${OUT:-out/bench}
mkdir -p "$OUT"
export LD_PRELOAD=/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4
.venv/bin/python benchmarks/engine_throughput.py --model "$MODEL" --num-requests "$N" \
    --write-workload "$OUT/workload.jsonl" --out "$OUT/orca.json" > "$OUT/orca.log"
"$VLLM_PYTHON" benchmarks/vllm_baseline.py --model "$MODEL" --input "$OUT/workload.jsonl" \
    --max-num-seqs 128 --out "$OUT/vllm.json" > "$OUT/vllm.log" 2>&1
.venv/bin/python - "$OUT" <<'PY'
import json, sys
out = sys.argv[1]
orca, vllm = json.load(open(f"{out}/orca.json")), json.load(open(f"{out}/vllm.json"))
print(json.dumps({k: orca[k] for k in orca if k != "results"}, indent=2))
print(f"vLLM CPU {vllm['vllm_version']}: {vllm['generated_tokens_per_s']:.1f} generated tok/s")
print(f"orca-serve / vLLM: {orca['orca_tokens_per_s'] / vllm['generated_tokens_per_s']:.3f}")
PY
