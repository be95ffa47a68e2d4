#!/usr/bin/env bash
# Offline throughput, side by side in one run: orca-serve's engine (benchmarks/engine_throughput.py, the
# `orca generate` path, policy `orca`) and vLLM's CPU build at vLLM's defaults (compiled), with vLLM
# enforce_eager (NOT its default) labelled beside. Same checkpoint, same workload file, same KV capacity
# in tokens, tcmalloc preloaded for every process. Prints one markdown table, and the load average at
# the start and the end.
#
#   benchmarks/compare_vllm.sh [CHECKPOINT_DIR[:NUM_REQUESTS] ...]
#
# With no directory it uses three demo checkpoints, made if missing: .cache/demo-llama:128 (llama tiny),
# .cache/demo-gpt2:128 (gpt2 tiny), .cache/demo-llama-small:32 (llama small, ~110M parameters).
# Environment: N (requests where a directory gives none, default 256), ORCA_THREADS (orca's torch threads), KV_TOKENS (KV cache slots for both engines, default 65536),
# VLLM_PYTHON (default /work/vllm-venv/bin/python, see benchmarks/setup_vllm.sh), OUT (default
# out/bench/compare-vllm).
#
# Throughput counts generated tokens only. CPU seconds: orca's engine is one process, timed with
# time.process_time() around its run; vLLM's is three (main, EngineCore, Worker), read from /proc before
# and after LLM.generate. Each whole process is also run under /usr/bin/time -v (its .time file: CPU
# including model load, compile and, for orca, the request-level run and the bare loop).
set -euo pipefail
cd "$(dirname "$0")/.."
N=${N:-256}
KV_TOKENS=${KV_TOKENS:-65536}
VLLM_PYTHON=${VLLM_PYTHON:-/work/vllm-venv/bin/python}
OUT=${OUT:-out/bench/compare-vllm}
TCMALLOC=/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4
mkdir -p "$OUT"

if [ $# -eq 0 ]; then
    set -- .cache/demo-llama:128 .cache/demo-gpt2:128 .cache/demo-llama-small:32
    make_demo() { [ -f "$1/config.json" ] || .venv/bin/orca make-demo-model "$1" --arch "$2" --size "$3"; }
    make_demo .cache/demo-llama llama tiny
    make_demo .cache/demo-gpt2 gpt2 tiny
    make_demo .cache/demo-llama-small llama small
fi

for SPEC in "$@"; do
    MODEL=${SPEC%%:*}
    [ -f "$MODEL/config.json" ] || { echo "$MODEL: not a checkpoint directory (give DIR or DIR:N)" >&2; exit 2; }
done

LOAD_START=$(cat /proc/loadavg)
# run NAME LOGFILE CMD...: the command under /usr/bin/time -v with tcmalloc; a failure is recorded, not fatal
run() {
    local name=$1 log=$2; shift 2
    echo "  $name ..." >&2
    if ! LD_PRELOAD=$TCMALLOC /usr/bin/time -v -o "${log%.log}.time" "$@" > "$log" 2>&1; then
        echo "  $name FAILED, see $log" >&2
    fi
}
MODELS=()
for SPEC in "$@"; do
    MODEL=${SPEC%%:*}
    NUM=$N
    [ "$SPEC" = "$MODEL" ] || NUM=${SPEC#*:}
    MODELS+=("$MODEL")
    D="$OUT/$(basename "$MODEL")"
    mkdir -p "$D"
    rm -f "$D"/orca.json "$D"/vllm-default.json "$D"/vllm-eager.json
    echo "$MODEL -> $D" >&2
    run "orca (engine_throughput.py, writes the workload)" "$D/orca.log" \
        .venv/bin/python benchmarks/engine_throughput.py --model "$MODEL" --num-requests "$NUM" --only-orca \
        --input-len 16:256 --output-len 8:256 --max-num-seqs 256 ${ORCA_THREADS:+--threads $ORCA_THREADS} \
        --kv-cache-tokens "$KV_TOKENS" --write-workload "$D/workload.jsonl" --out "$D/orca.json"
    [ -s "$D/workload.jsonl" ] || { echo "no workload written for $MODEL, see $D/orca.log" >&2; exit 1; }
    run "vLLM default (compiled)" "$D/vllm-default.log" \
        "$VLLM_PYTHON" benchmarks/vllm_baseline.py --model "$MODEL" --input "$D/workload.jsonl" \
        --kv-cache-tokens "$KV_TOKENS" --out "$D/vllm-default.json"
    run "vLLM enforce_eager" "$D/vllm-eager.log" \
        "$VLLM_PYTHON" benchmarks/vllm_baseline.py --model "$MODEL" --input "$D/workload.jsonl" \
        --kv-cache-tokens "$KV_TOKENS" --enforce-eager --out "$D/vllm-eager.json"
done
LOAD_END=$(cat /proc/loadavg)

.venv/bin/python - "$OUT" "$N" "$KV_TOKENS" "$LOAD_START" "$LOAD_END" "${MODELS[@]}" <<'PY'
import json, os, re, sys

out, n, kv, load_start, load_end, models = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4], sys.argv[5], sys.argv[6:]

def load(path):
    return json.load(open(path)) if os.path.exists(path) else None

def whole_cpu(path):
    """user + system seconds and max RSS of a whole process, from /usr/bin/time -v."""
    try:
        text = open(path).read()
    except OSError:
        return "n/a"
    get = lambda key: float(re.search(rf"{key}: ([\d.]+)", text).group(1))
    return f"{get('User time .seconds.') + get('System time .seconds.'):.1f} CPU s, {get('Maximum resident set size .kbytes.') / 1024:.0f} MiB max RSS"

def fmt(x, spec=".1f"):
    return "failed" if x is None else format(x, spec)

rows, notes = [], []
for model in models:
    d = os.path.join(out, os.path.basename(model.rstrip("/")))
    orca, vd, ve = load(f"{d}/orca.json"), load(f"{d}/vllm-default.json"), load(f"{d}/vllm-eager.json")
    o = orca and orca["results"]["orca"]
    o_tps = o and o["tokens_per_s"]
    vd_tps, ve_tps = vd and vd["generated_tokens_per_s"], ve and ve["generated_tokens_per_s"]
    ratio = f"{o_tps / vd_tps:.2f}x" if o_tps and vd_tps else "n/a"
    ms = lambda x: None if x is None else 1000 * x
    single = lambda r: "n/a" if not r or "single_stream" not in r else \
        f"{r['single_stream']['decode_ms_per_token']:.2f} / {r['single_stream']['ttft_ms']:.1f}"
    requests = orca["workload"].split(" requests")[0] if orca else "?"
    rows.append(f"| {os.path.basename(model.rstrip('/'))} ({requests} requests) | {fmt(o_tps)} | {fmt(vd_tps)} | {ratio} | {fmt(ve_tps)} "
                f"| {fmt(ms(o and o['cpu_seconds_per_token']), '.2f')} "
                f"| {fmt(ms(vd and vd['cpu_seconds_per_generated_token']), '.2f')} "
                f"| {fmt(ms(ve and ve['cpu_seconds_per_generated_token']), '.2f')} "
                f"| {single(o)} | {single(vd)} |")
    for label, r in (("vLLM default (compiled)", vd), ("vLLM enforce_eager", ve)):
        if r:
            notes.append(f"- {os.path.basename(model)} {label}: mode={r['mode']}, max_num_seqs={r['max_num_seqs']}, "
                         f"max_num_batched_tokens={r['max_num_batched_tokens']}, KV {r['kv_cache_capacity_tokens']} tokens, "
                         f"init {r['engine_init_s']:.0f} s, {r['total_generated_tokens']} tokens generated, "
                         f"CPU by process {r['cpu_seconds_by_process']}; whole run: {whole_cpu(f'{d}/' + ('vllm-default' if r is vd else 'vllm-eager') + '.time')}")
    if o:
        notes.append(f"- {os.path.basename(model)} orca: max_num_seqs=256, {orca['threads']} torch threads, "
                     f"{o['generated_tokens']} tokens generated, {o['cpu_seconds']:.1f} CPU s in its run; "
                     f"whole process: {whole_cpu(f'{d}/orca.time')}")

print(f"\nOffline throughput, all requests at once (input U[16,256], output U[8,256], EOS ignored, greedy, "
      f"float32), KV cache {kv} tokens for both, tcmalloc preloaded; out tok/s = generated tokens / wall s\n")
print("| checkpoint | orca out tok/s | vLLM (default, compiled) out tok/s | orca / vLLM default "
      "| vLLM enforce_eager out tok/s (not default) | orca CPU ms/token | vLLM default CPU ms/token "
      "| vLLM enforce_eager CPU ms/token | orca single stream decode ms/token / TTFT ms "
      "| vLLM default single stream decode ms/token / TTFT ms |")
print("|---|---|---|---|---|---|---|---|---|---|")
print("\n".join(rows))
print(f"\nload average at start: {load_start}\nload average at end:   {load_end}")
print("\n" + "\n".join(notes))
PY
