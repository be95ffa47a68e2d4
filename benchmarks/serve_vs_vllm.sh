#!/usr/bin/env bash
# Served throughput and latency, orca serve vs vllm serve, both driven by the unmodified `vllm bench serve`
# (through benchmarks/vllm_cli.py, in the vLLM venv) over streaming /v1/completions, on the same checkpoint.
#
#   benchmarks/serve_vs_vllm.sh [CHECKPOINT_DIR]      (default .cache/demo-llama, made if missing)
#
# For each server in turn (orca serve, then vllm serve at its defaults, compiled, float32, --max-num-seqs 256):
# start it, one untimed warm-up run (8 requests), then
#   1. N requests at --request-rate inf                        -> output tok/s
#   2. N requests at each Poisson rate in RATES (req/s)         -> median TTFT, median TPOT
#   3. N_SINGLE requests with --max-concurrency 1 (one stream)  -> median TTFT, median TPOT
# then stop it. Workload: vllm bench serve's random dataset (token-id sequences it decodes to text with the
# checkpoint's tokenizer; the server tokenizes them again), lengths drawn so that prompts are U[16,256]
# tokens (BOS included) and outputs U[8,256], ignore_eos, temperature 0. Results: `--save-result` JSON
# files under OUT, parsed into one table, plus the load average at the start and the end.
#
# CPU: /proc/PID/stat of every process in each server's process tree (Ray's and NATS's included) is read
# before and after the rate=inf run and after the last run, so CPU seconds per streamed token can be
# reported per process; the bench client runs under /usr/bin/time -v (its own .time files).
#
# Environment: N (default 128), N_SINGLE (default 32), RATES (default "4 8 16 32"), MAX_NUM_SEQS (both
# servers, default 256), KV_TOKENS (KV cache slots, both servers, default 65536: orca serve's default),
# VLLM_PYTHON (default /work/vllm-venv/bin/python, see benchmarks/setup_vllm.sh), OUT (default
# out/bench-serve), STARTUP_TIMEOUT (s, default 900: vLLM compiles the model on its first start), ORDER
# (default "orca vllm": which server runs first).
set -euo pipefail
cd "$(dirname "$0")/.."
DEFAULT_MODEL=.cache/demo-llama
MODEL=${1:-$DEFAULT_MODEL}
N=${N:-128}
N_SINGLE=${N_SINGLE:-32}
RATES=${RATES:-"4 8 16 32"}
MAX_NUM_SEQS=${MAX_NUM_SEQS:-256}
KV_TOKENS=${KV_TOKENS:-65536}
VLLM_PYTHON=${VLLM_PYTHON:-/work/vllm-venv/bin/python}
OUT=${OUT:-out/bench-serve}
STARTUP_TIMEOUT=${STARTUP_TIMEOUT:-900}
ORDER=${ORDER:-"orca vllm"}
TCMALLOC=/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4
if [ ! -f "$MODEL/config.json" ]; then
    [ "$MODEL" = "$DEFAULT_MODEL" ] || { echo "$MODEL: no config.json" >&2; exit 1; }
    .venv/bin/orca make-demo-model "$MODEL" --arch llama --size tiny
fi
mkdir -p "$OUT"
rm -f "$OUT"/{orca,vllm}-*.json "$OUT"/{orca,vllm}-*.time "$OUT"/cpu-{orca,vllm}-*.json

# Random-dataset lengths: vllm bench draws U[floor(L'(1-r)), ceil(L'(1+r))] with L' = L - the tokenizer's
# special tokens (the server adds them back), so L=136, r just under 120/L' gives prompts U[16,256].
SPECIAL=$("$VLLM_PYTHON" -c "from transformers import AutoTokenizer as T; print(T.from_pretrained('$MODEL').num_special_tokens_to_add())" 2>/dev/null | tail -1)
RANGE_RATIO=$(python3 -c "print('{\"input\": %.6f, \"output\": %.6f}' % (120 / (136 - $SPECIAL) - 1e-6, 124 / 132 - 1e-6))")
KV_BYTES=$(.venv/bin/python -c "from benchmarks.vllm_baseline import kv_bytes_per_token as b; print(b('$MODEL', 'float32') * ($KV_TOKENS + 256))")  # + block rounding

SERVER_PID=""
stop_server() {
    [ -n "$SERVER_PID" ] || return 0
    kill -TERM "$SERVER_PID" 2>/dev/null || true
    for _ in $(seq 120); do kill -0 "$SERVER_PID" 2>/dev/null || break; sleep 1; done
    kill -KILL "$SERVER_PID" 2>/dev/null || true
    wait "$SERVER_PID" 2>/dev/null || true
    SERVER_PID=""
}
trap stop_server EXIT

# wait_for LOG REGEX: until the server's log matches (prints the first capture group) or it dies / times out
wait_for() {
    local log=$1 regex=$2
    for _ in $(seq "$STARTUP_TIMEOUT"); do
        if grep -qE "$regex" "$log"; then grep -oE "$regex" "$log" | head -1 | sed -E "s#$regex#\1#"; return 0; fi
        kill -0 "$SERVER_PID" 2>/dev/null || { echo "server exited while starting, see $log" >&2; tail -20 "$log" >&2; exit 1; }
        sleep 1
    done
    echo "server not up in ${STARTUP_TIMEOUT}s, see $log" >&2; exit 1
}

# cpu_snapshot FILE: CPU seconds (user + system) of every process in the server's tree, from /proc
cpu_snapshot() {
    .venv/bin/python - "$SERVER_PID" "$1" <<'PY'
import json, os, sys
root, path = int(sys.argv[1]), sys.argv[2]
tick, info, children = os.sysconf("SC_CLK_TCK"), {}, {}
for d in filter(str.isdigit, os.listdir("/proc")):
    try:
        stat = open(f"/proc/{d}/stat").read()
        cmd = open(f"/proc/{d}/cmdline", "rb").read().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        continue
    fields = stat[stat.rindex(")") + 2:].split()  # state ppid ... utime(11) stime(12)
    info[int(d)] = {"ppid": int(fields[1]), "comm": stat[stat.index("(") + 1:stat.rindex(")")], "cmd": cmd[:300],
                    "cpu_s": (int(fields[11]) + int(fields[12])) / tick}
    children.setdefault(int(fields[1]), []).append(int(d))
tree, todo = {}, [root]
while todo:
    pid = todo.pop()
    if pid in info:
        tree[pid] = info[pid]
        todo.extend(children.get(pid, []))
json.dump(tree, open(path, "w"), indent=1)
PY
}

# bench SERVER RUN URL [vllm bench serve flags]: one `vllm bench serve` run, saved as OUT/SERVER-RUN.json
bench() {
    local server=$1 run=$2 url=$3; shift 3
    echo "  $server $run ..." >&2
    /usr/bin/time -v -o "$OUT/$server-$run.time" \
        "$VLLM_PYTHON" benchmarks/vllm_cli.py bench serve --backend openai --base-url "$url" \
        --endpoint /v1/completions --model "$MODEL" --dataset-name random \
        --random-input-len 136 --random-output-len 132 --random-range-ratio "$RANGE_RATIO" \
        --ignore-eos --temperature 0 --seed 0 --disable-tqdm \
        --percentile-metrics ttft,tpot,itl,e2el --metric-percentiles 50,99 \
        --save-result --result-dir "$OUT" --result-filename "$server-$run.json" "$@" > "$OUT/$server-$run.log" 2>&1 \
        || { echo "bench $server $run failed, see $OUT/$server-$run.log" >&2; tail -20 "$OUT/$server-$run.log" >&2; exit 1; }
}

runs() {  # runs SERVER URL
    local server=$1 url=$2
    bench "$server" warmup "$url" --num-prompts 8 --request-rate inf
    cpu_snapshot "$OUT/cpu-$server-0.json"
    bench "$server" rate-inf "$url" --num-prompts "$N" --request-rate inf
    cpu_snapshot "$OUT/cpu-$server-1.json"
    for r in $RATES; do bench "$server" "rate-$r" "$url" --num-prompts "$N" --request-rate "$r"; done
    bench "$server" single "$url" --num-prompts "$N_SINGLE" --request-rate inf --max-concurrency 1
    cpu_snapshot "$OUT/cpu-$server-2.json"
}

LOAD_START=$(cat /proc/loadavg)

serve_orca() {
    echo "orca serve $MODEL ..." >&2
    LD_PRELOAD=$TCMALLOC .venv/bin/orca serve --model "$MODEL" --dtype float32 --max-num-seqs "$MAX_NUM_SEQS" \
        --kv-cache-tokens "$KV_TOKENS" --port 0 --drain-timeout 5 > "$OUT/orca-server.log" 2>&1 &
    SERVER_PID=$!
    local url
    url=$(wait_for "$OUT/orca-server.log" 'orca-serve is up: HTTP (http://[^,]+),')
    runs orca "$url"
    stop_server
}

serve_vllm() {
    local port
    port=$(python3 -c "import socket; s = socket.socket(); s.bind(('127.0.0.1', 0)); print(s.getsockname()[1])")
    echo "vllm serve $MODEL (default, compiled) on port $port ..." >&2
    env -u VLLM_CPU_KVCACHE_SPACE LD_PRELOAD=$TCMALLOC "$VLLM_PYTHON" benchmarks/vllm_cli.py serve "$MODEL" \
        --dtype float32 --max-num-seqs "$MAX_NUM_SEQS" --kv-cache-memory-bytes "$KV_BYTES" --host 127.0.0.1 \
        --port "$port" > "$OUT/vllm-server.log" 2>&1 &
    SERVER_PID=$!
    wait_for "$OUT/vllm-server.log" '(Application startup complete)' > /dev/null
    runs vllm "http://127.0.0.1:$port"
    stop_server
}

# This VM's speed drifts within the hour: ORDER="vllm orca" runs vLLM first, to see the order's share.
for server in $ORDER; do
    case $server in
        orca) serve_orca ;;
        vllm) serve_vllm ;;
        *) echo "ORDER: unknown server $server (orca, vllm)" >&2; exit 2 ;;
    esac
done

LOAD_END=$(cat /proc/loadavg)
.venv/bin/python - "$OUT" "$MODEL" "$N" "$N_SINGLE" "$RATES" "$LOAD_START" "$LOAD_END" "$MAX_NUM_SEQS" "$KV_TOKENS" <<'PY'
import json, os, re, sys

out, model, n, n_single, rates, load_start, load_end, max_seqs, kv = sys.argv[1:]
rates = rates.split()
SERVERS = {"orca": "orca serve", "vllm": "vllm serve (default, compiled)"}
LABELS = [  # (pattern in cmdline or comm, label), first match wins
    (r"ray::ProxyActor", "ProxyActor (HTTP proxy)"), (r"ray::ServeReplica", "gateway replica"),
    (r"ray::ServeController", "Serve controller"), (r"ray::EngineMasterActor", "master"),
    (r"ray::Worker", "worker"), (r"services\.tokenizer", "tokenizer"), (r"nats-server", "nats-server"),
    (r"services\.admission", "admission"), (r"services\.jobs", "jobs"), (r"raylet", "raylet"),
    (r"gcs_server", "gcs_server"), (r"orca serve|bin/orca", "orca serve (driver)"),
    (r"VLLM::EngineCore|EngineCore", "vLLM engine core"), (r"VLLM::Worker|VllmWorker", "vLLM worker"),
    (r"vllm_cli\.py serve|APIServer", "vLLM API server"),
]

def label(p):
    text = p["cmd"] + " " + p["comm"]
    name = next((name for pattern, name in LABELS if re.search(pattern, text)), None)
    other = re.search(r"ray::(\w+)|/ray/.*?(\w+)\.py", p["cmd"])  # Ray's own helpers: dashboard, log monitor, ...
    return name or (f"Ray {other.group(1) or other.group(2)}" if other else p["cmd"][:40] or p["comm"])

def result(server, run):
    path = os.path.join(out, f"{server}-{run}.json")
    return json.load(open(path)) if os.path.exists(path) else None

def ttft_tpot(r):
    return f"{r['median_ttft_ms']:.0f} / {r['median_tpot_ms']:.1f}" if r else "n/a"

head = ["server", f"out tok/s (rate inf, {n} req)"] + [f"{r} req/s: median TTFT / TPOT ms" for r in rates] \
    + [f"single stream ({n_single} req): median TTFT / TPOT ms"]
print(f"\nServed throughput, {os.path.basename(model.rstrip('/'))}: vllm bench serve, random dataset "
      f"(prompts U[16,256], outputs U[8,256] tokens), ignore_eos, temperature 0, streaming /v1/completions; "
      f"both servers float32, max_num_seqs {max_seqs}, KV cache {kv} tokens, tcmalloc preloaded\n")
print("| " + " | ".join(head) + " |\n|" + "---|" * len(head))
for server, name in SERVERS.items():
    inf = result(server, "rate-inf")
    cells = [name, f"{inf['output_throughput']:.1f}" if inf else "n/a"]
    cells += [ttft_tpot(result(server, f"rate-{r}")) for r in rates] + [ttft_tpot(result(server, "single"))]
    print("| " + " | ".join(cells) + " |")
print(f"\nload average at start: {load_start}\nload average at end:   {load_end}")

def tokens(server, runs):
    return sum((result(server, r) or {}).get("total_output_tokens", 0) for r in runs)

def client_cpu(server, runs):
    total = 0.0
    for r in runs:
        try:
            text = open(os.path.join(out, f"{server}-{r}.time")).read()
        except OSError:
            continue
        total += sum(float(re.search(rf"{k} time \(seconds\): ([\d.]+)", text).group(1)) for k in ("User", "System"))
    return total

all_runs = ["rate-inf"] + [f"rate-{r}" for r in rates] + ["single"]
print("\nCPU per streamed token by process (from /proc/PID/stat before and after; ms of CPU per output token)\n")
print("| server | process | pid | CPU s, rate inf | ms/token, rate inf | CPU s, all runs | ms/token, all runs |")
print("|---|---|---|---|---|---|---|")
for server, name in SERVERS.items():
    snaps = []
    for i in range(3):
        path = os.path.join(out, f"cpu-{server}-{i}.json")
        snaps.append({int(k): v for k, v in json.load(open(path)).items()} if os.path.exists(path) else {})
    if not snaps[2]:
        continue
    t_inf, t_all = tokens(server, ["rate-inf"]), tokens(server, all_runs)
    sums = [0.0, 0.0]
    spent = lambda item: item[1]["cpu_s"] - snaps[0].get(item[0], {"cpu_s": 0.0})["cpu_s"]
    for pid, p in sorted(snaps[2].items(), key=spent, reverse=True):
        base = snaps[0].get(pid, {"cpu_s": 0.0})["cpu_s"]
        d_inf = snaps[1].get(pid, {"cpu_s": base})["cpu_s"] - base
        d_all = p["cpu_s"] - base
        sums[0] += d_inf
        sums[1] += d_all
        if d_all >= 0.05:
            print(f"| {name} | {label(p)} | {pid} | {d_inf:.2f} | {1000 * d_inf / max(t_inf, 1):.3f} "
                  f"| {d_all:.2f} | {1000 * d_all / max(t_all, 1):.3f} |")
    print(f"| {name} | **all server processes** | | {sums[0]:.2f} | {1000 * sums[0] / max(t_inf, 1):.3f} "
          f"| {sums[1]:.2f} | {1000 * sums[1] / max(t_all, 1):.3f} |")
    c_inf, c_all = client_cpu(server, ["rate-inf"]), client_cpu(server, all_runs)
    print(f"| {name} | bench client (vllm bench serve, whole run) | | {c_inf:.2f} | {1000 * c_inf / max(t_inf, 1):.3f} "
          f"| {c_all:.2f} | {1000 * c_all / max(t_all, 1):.3f} |")
    print(f"| {name} | output tokens | | {t_inf} | | {t_all} | |")
PY
