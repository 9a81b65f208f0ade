#!/usr/bin/env bash
# The GPU checks as one script, for a lent CUDA machine (several minutes; each step has its own time limit):
#
#   bash benchmarks/gpu_session.sh                          # results under $OUT (default runs/gpu)
#   LIMIT=2 DEVICE=cpu REPEATS=1 bash benchmarks/gpu_session.sh   # a smoke test of the script on a CPU
#
# 1. `recap compare`, every method, the demo's three bench sets one request at a time (bf16 on CUDA; the match
#    column says whether bf16 kept every token of `ar`);
# 2. benchmarks/batching.py, the same sets at batch 16, fresh sessions (start-up included), by wall time;
# 3. benchmarks/gpu_steps.py, eager step costs at the Qwen2.5-VL-7B shape (random weights), batch 1 and batched;
# 4. benchmarks/attention_kernels.py, step times under each choice of attention kernels;
# 5. `recap compare` on 24 held-out demo scenes;
# 6. `recap run` as a user runs it, `ar` beside recap, twice each, on the bench and held-out sets together: the
#    default batch (32 on CUDA), then batch 1, which on CUDA compiles its steps (CUDA graphs; the warm-up is in the
#    time). Each run's summary line.
# 7. (not in the default list) `compiled`: the same at --batch 16 with --compile on (batched static shapes), then
#    off; never measured on a GPU: give it its own call.
# Each step has its own time limit (TIMEOUT seconds, scaled), so a slow one leaves the others' results.
# STEPS picks some of them and their order (default: all, as above), e.g. STEPS="heldout run" for steps 5 and 6;
# names: bench batching gpu_steps kernels heldout run compiled. On an H200, "batching" took 73 s in one call, "heldout"
# and "kernels" about a minute each; 12 `recap run` processes of 72-144 requests took 272 s, so "run" (8 of 144)
# takes some 3 minutes: all six do not fit in one 600 s call, so split them.
set -u
OUT=${OUT:-runs/gpu}
DEVICE=${DEVICE:-cuda}
LIMIT=${LIMIT:-}
REPEATS=${REPEATS:-2}
T=${TIMEOUT:-60}
STEPS=${STEPS:-bench batching gpu_steps kernels heldout run}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
if ! python3 -c "import orjson" 2>/dev/null; then  # the GPU image lacks orjson: carried as a wheel in .whl
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl || exit 1
    export PYTHONPATH=/tmp/site:$PWD
fi
{ nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv 2>/dev/null; nproc
  python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)"
} | tee "$OUT/env.txt"

B=sample_inputs/bench
HO=/tmp/ho
timeout "$T" python3 -m recap_cli.demo.samples --bench-to $HO --scenes 24 --seed s36-heldout >/dev/null 2>&1
if [ -n "$LIMIT" ]; then  # the smoke test: a few requests of each set
    for set in B HO; do
        small=/tmp/gpu_small_$set; mkdir -p $small; ln -sfn "$(realpath ${!set})/images" $small/images
        for f in demo_caption demo_vqa demo_multiturn; do head -n "$LIMIT" ${!set}/$f.jsonl > $small/$f.jsonl; done
        eval "$set=$small"
    done
fi
M="--methods ar,recap,suffix,tr:budget=auto,pld --warmup 1 --device $DEVICE --quiet --max-new-tokens 96"

compare() {  # name dir repeats
    echo "== recap compare, $1, batch 1"
    timeout $((2 * T)) python3 -m recap_cli compare $2/demo_caption.jsonl $2/demo_vqa.jsonl $2/demo_multiturn.jsonl \
        $M --repeats "$3" --json "$OUT/compare_$1.json" >/dev/null 2>"$OUT/compare_$1.txt"
    echo "rc $?"; tail -n 9 "$OUT/compare_$1.txt"
}

batching() {
    echo "== batching.py, batch 16, fresh sessions"
    timeout $((2 * T)) python3 benchmarks/batching.py --device "$DEVICE" --dtype bf16 --fresh --rounds 3 --batches 16 \
        --methods ar,recap,suffix,tr:budget=auto,pld --inputs $B/demo_caption.jsonl $B/demo_vqa.jsonl \
        $B/demo_multiturn.jsonl --json "$OUT/batching.json" >"$OUT/batching.txt" 2>&1
    echo "rc $?"; grep "^| " "$OUT/batching.txt"
}

gpu_steps() {
    echo "== gpu_steps.py, Qwen2.5-VL-7B shape, eager"
    timeout "$T" python3 benchmarks/gpu_steps.py --shapes qwen2.5-vl-7b --no-compile --reps 10 --batches 1,4,16 \
        ${LIMIT:+--tiny} --json "$OUT/gpu_steps.json" >"$OUT/gpu_steps.txt" 2>&1
    echo "rc $?"; cat "$OUT/gpu_steps.txt"
}

kernels() {
    echo "== attention_kernels.py"
    timeout "$T" python3 benchmarks/attention_kernels.py --device "$DEVICE" --limit "${LIMIT:-8}" >"$OUT/kernels.txt" 2>&1
    echo "rc $?"; cat "$OUT/kernels.txt"
}

all_requests() {  # the bench and held-out sets together (144 requests), so a compiled run's warm-up weighs less
    python3 - "$B" "$HO" > /tmp/gpu_all.jsonl <<'PY'
import json, os, sys
for root, tag in ((os.path.abspath(sys.argv[1]), ""), (os.path.abspath(sys.argv[2]), "ho-")):
    for name in ("demo_caption", "demo_vqa", "demo_multiturn"):
        for line in open(f"{root}/{name}.jsonl"):
            r = json.loads(line)
            r["id"] = tag + r["id"]
            if r.get("image"):
                r["image"] = f"{root}/{r['image']}"
            print(json.dumps(r))
PY
}

user_runs() {  # recap run's own flags: ar and recap alternating, twice each, a fresh process each
    for method in ar recap ar recap; do
        timeout $((2 * T)) python3 -m recap_cli run /tmp/gpu_all.jsonl --method $method "$@" --device "$DEVICE" \
            -o /dev/null >/tmp/gpu_run.txt 2>&1 || echo "rc $?: $method $*"
        grep "items,\|warning" /tmp/gpu_run.txt
    done
}

run() {
    echo "== recap run, default batch, then batch 1 (compiled on CUDA)"
    all_requests
    user_runs
    user_runs --batch 1
}

compiled() {  # batched static shapes: never measured on a GPU before
    echo "== recap run --batch 16 --compile on (static shapes per width, CUDA graphs), then --compile off"
    all_requests
    user_runs --batch 16 --compile on
    user_runs --batch 16 --compile off
}

for step in $STEPS; do
    case $step in
        bench) compare bench $B "$REPEATS" ;;
        heldout) compare heldout $HO 1 ;;
        batching|gpu_steps|kernels|run|compiled) $step ;;
        *) echo "unknown step: $step" ;;
    esac
done
