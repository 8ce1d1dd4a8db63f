#!/usr/bin/env bash
# Issue 52 in one device call: Llama-2-7B's shape (random weights from its config, bf16, sequence 2048)
# through fedtune's own CLIs on one GPU:
#   1. train: `python -m fedtune.train` under scripts/launch, FSDP2, bf16, activation checkpointing, 20
#      steps of 4 x 2048 tokens, in the setup fedtune.train.memory_plan's fits rule chooses for this GPU:
#      the Leonardo site's of config/examples/llama2-it-cs.yaml (hybrid_zero2, micro batch 4) where it
#      fits, else the closest that does (on a 141 GB H200: sharding full, micro batch 4; then micro 2 as
#      the fallback run if the first fails); tokens/s, MFU and the live peak against the plan; last, if
#      deepspeed imports and DS_MIN_S seconds are left, ZeRO-3 (micro batch 1 x 4, 10 steps, no export);
#   2. exchange: `python -m fedtune.core.updates compress` (int8, block 64, error feedback: the residual is
#      kept, in /dev/shm where it has room) of the trained site against the start, then `decode`;
#   3. merge: `python -m fedtune.aggregate` with the default options (fedavg, streamed) of two sites: the
#      trained model and its copy rebuilt by step 2's decode (the same model perturbed by the int8 codec),
#      from a cold page cache, against the I/O floor of the disk bandwidth measured first;
#   4. evaluate: `python -m fedtune.evaluate` of the merged model on the GPU, 400 documents.
# Every step has its own time limit within BUDGET_S (default 400 s); the report (published.json,
# published.md: each figure beside the plan's) and a summary come out even when a step fails. Models on
# disk at once: at most three 13.5 GB ones plus the 7 GB update; no optimizer checkpoint is written.
#
#     WHEELS=.gpuwhl7b/whl OUT=$OUT benchmarks/gpu-checks/published.sh     # device call: carry [".gpuwhl7b"]
#     ARCH=tiny PYTHON=.venv/bin/python OUT=/tmp/pub-out benchmarks/gpu-checks/published.sh   # CPU rehearsal
#
# .gpuwhl7b (ignored through .git/info/exclude): whl/ the wheels the GPU machine lacks, prep/ the
# tokenizer, text and shards of `python benchmarks/published_size.py prepare .gpuwhl7b/prep`.
# Back under $OUT: published.json, published.md, logs.txt, versions.txt, skipped.json. KEEP=1 keeps $W.
set -u
: "${OUT:?set OUT to the folder that comes back}"
mkdir -p "$OUT"
SECONDS=0
BUDGET_S=${BUDGET_S:-400}
RESERVE_S=${RESERVE_S:-20}  # kept for the report
ARCH=${ARCH:-7b}
PY=${PYTHON:-python3}
PREP=${PREP:-.gpuwhl7b/prep}
if [ "$ARCH" = tiny ]; then
    DEVICE=${DEVICE:-cpu} SEQ=${SEQ:-256} DISK_GIB=${DISK_GIB:-0.25} PRECISION=${PRECISION:-bf16} EVAL_DOCS=${EVAL_DOCS:-30}
else
    DEVICE=${DEVICE:-cuda} SEQ=${SEQ:-2048} DISK_GIB=${DISK_GIB:-4} PRECISION=${PRECISION:-bf16} EVAL_DOCS=${EVAL_DOCS:-400}
fi
# scripts/launch starts torchrun (or python3 -m torch.distributed.run) from PATH: the same Python's.
PATH="$(cd "$(dirname "$(command -v "$PY")")" && pwd):$PATH"
STEPS=${STEPS:-20}
DS_STEPS=${DS_STEPS:-10}
DS_MIN_S=${DS_MIN_S:-150}
PARTS=${PARTS:-train,exchange,merge,evaluate,deepspeed}  # e.g. PARTS=deepspeed: build, then ZeRO-3 only
W=${WORK:-/tmp/published}
rm -rf "$W"
mkdir -p "$W/results" "$W/logs" "$W/tmp" "$W/cache"
R=$W/results L=$W/logs
if [ -n "${WHEELS:-}" ]; then
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$W/site" "$WHEELS"/*.whl \
        || echo "wheels: install failed"
    export PYTHONPATH="$W/site:$PWD"
fi
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false TMPDIR="$W/tmp"
export TORCH_EXTENSIONS_DIR="$W/cache/torch-extensions" TRITON_CACHE_DIR="$W/cache/triton" HF_HOME="$W/cache/hf"
# Live memory is near the card's size at 7B: segments that grow in place keep the reserve small.
export PYTORCH_CUDA_ALLOC_CONF=${PYTORCH_CUDA_ALLOC_CONF:-expandable_segments:True}
MAN=$PREP/data-$SEQ/it/manifest.json MAN_CS=$PREP/data-$SEQ/cs/manifest.json
PS=benchmarks/published_size.py
echo "[]" > "$R/skipped.json"

left() { echo $((BUDGET_S - SECONDS)); }
cap() {  # cap SECONDS: the step's limit, within what is left of the budget less the report's reserve
    local l=$(($(left) - RESERVE_S))
    if ((l < $1)); then echo $((l > 1 ? l : 1)); else echo "$1"; fi
}
skip() {  # skip STEP WHY
    "$PY" - "$R/skipped.json" "$1" "$2" <<'PY'
import json, sys
items = json.load(open(sys.argv[1]))
items.append({"step": sys.argv[2], "why": sys.argv[3]})
json.dump(items, open(sys.argv[1], "w"))
PY
    echo "[published] skip $1: $2"
}
say() { echo "[published] $(date -u +%H:%M:%S) +${SECONDS}s $*"; }
smi_start() {  # smi_start NAME: GPU memory in use every 250 ms while a step runs
    smi=""
    if command -v nvidia-smi > /dev/null 2>&1 && [ "$DEVICE" = cuda ]; then
        nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits -lms 250 > "$R/$1.smi" 2> /dev/null &
        smi=$!
    fi
}
smi_stop() { if [ -n "$smi" ]; then kill "$smi" 2> /dev/null; wait "$smi" 2> /dev/null; fi; }
have_model() { ls "$1"/*.safetensors > /dev/null 2>&1; }
want() { [[ ",$PARTS," == *",$1,"* ]]; }

# -- the machine ---------------------------------------------------------------------------------------
# One Python start for every version (each start with torch costs seconds of the call).
"$PY" - "$R/gpu.json" > "$OUT/versions.txt" 2>&1 <<'PY'
import json, shutil, subprocess, sys, time
gpu = {"date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())}
try:
    line = subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total,driver_version", "--format=csv,noheader,nounits"],
                          capture_output=True, text=True, timeout=20).stdout.splitlines()[0]
    name, memory, driver = [x.strip() for x in line.split(",")]
    gpu.update(name=name, memory_mib=int(float(memory)), driver=driver)
except Exception as error:
    gpu["nvidia_smi"] = repr(error)
import torch, transformers
gpu.update(python=sys.version.split()[0], torch=torch.__version__, transformers=transformers.__version__)
for module in ("deepspeed", "datasets", "jsonschema"):
    try:
        gpu[module] = __import__(module).__version__
    except Exception as error:
        gpu[module] = None
        print(f"{module}: {error!r}"[:300])
for path in ("/tmp", "/dev/shm"):
    usage = shutil.disk_usage(path)
    gpu[f"free_gb {path}"] = round(usage.free / 1e9, 1)
json.dump(gpu, open(sys.argv[1], "w"))
print(json.dumps(gpu))
PY
{ nproc; free -g | sed -n 2p; df -h "$W" /dev/shm | tail -n +2; } >> "$OUT/versions.txt" 2>&1
cat "$OUT/versions.txt"

# -- disk bandwidth (the I/O floor's) --------------------------------------------------------------------
say "disk bandwidth ($DISK_GIB GiB)"
timeout "$(cap 60)" "$PY" $PS diskbw "$W/disk" --gib "$DISK_GIB" --json "$R/diskbw.json" > "$L/diskbw.log" 2>&1 \
    || skip diskbw "exit $? (log: diskbw)"
tail -8 "$L/diskbw.log"

# -- the starting model ------------------------------------------------------------------------------------
say "build $ARCH on $DEVICE"
timeout "$(cap 150)" "$PY" $PS build --arch "$ARCH" --tokenizer "$PREP/tokenizer" --out "$W/base" --device "$DEVICE" \
    --json "$R/build.json" > "$L/build.log" 2>&1 || skip build "exit $? (log: build)"
tail -3 "$L/build.log"
if ! have_model "$W/base"; then
    skip all "no starting model"
fi

# -- 1. train ----------------------------------------------------------------------------------------------
train() {  # train NAME OPTIONS OUTDIR LIMIT [more train args]
    local name=$1 opts=$2 outdir=$3 limit=$4
    shift 4
    say "train $name ($(cap "$limit") s at most): $opts"
    smi_start "$name"
    PUBLISHED_NO_CHECKPOINT=1 "$PY" $PS measure --json "$R/$name.json" --log "$L/$name.log" --timeout "$(cap "$limit")" \
        --extra "{\"out\": \"$outdir\", \"options\": $opts}" -- \
        scripts/launch --procs-per-node 1 -- "$PY" $PS train-cli --site it --init "$INIT" --manifest "$MAN" \
        --options "$opts" --checkpoints "$W/ckpt-$name" --out "$outdir" "$@" > /dev/null 2>&1
    local rc=$?
    smi_stop
    rm -rf "$W/ckpt-$name"
    grep -E "^step (1|5|10|15|20)/|exported|error|Error|OutOfMemory" "$L/$name.log" | tail -8
    say "train $name exit $rc"
    return $rc
}
common="\"precision\": \"$PRECISION\", \"dtype\": \"bfloat16\", \"gradient_checkpointing\": true, \"compile\": false, \"global_batch\": 4, \"lr\": 2e-05, \"warmup_steps\": 2, \"weight_decay\": 0.1, \"checkpoint_every\": 0, \"log_every\": 1, \"nodes\": 1, \"processes_per_node\": 1, \"gpus_per_node\": 1, \"device\": \"$DEVICE\""
# The plan's choice (fedtune.train.memory_plan's fits rule for this GPU's memory): Leonardo's setting
# (hybrid_zero2, micro 4) where it fits, else the closest that does; SHARDING and MICRO override it.
"$PY" $PS choose --arch "$ARCH" --gpu-json "$R/gpu.json" --seq "$SEQ" > "$R/choice.txt" 2> "$R/choice.json"
if [ -n "${SHARDING:-}" ]; then printf '%s %s\n' "$SHARDING" "${MICRO:-4}" | cat - "$R/choice.txt" > "$R/choice2.txt"; mv "$R/choice2.txt" "$R/choice.txt"; fi
read -r MODE1 MICRO1 < <(sed -n 1p "$R/choice.txt")
read -r MODE2 MICRO2 < <(sed -n 2p "$R/choice.txt")
say "plan's choice: $MODE1 micro $MICRO1 (then $MODE2 micro $MICRO2): $(cat "$R/choice.json")"
INIT=$W/base
SITE=$W/site-a
if want train && have_model "$W/base"; then
    opts="{\"backend\": \"fsdp\", \"sharding\": \"$MODE1\", \"micro_batch\": $MICRO1, \"max_steps\": $STEPS, $common}"
    train train_fsdp "$opts" "$SITE" 220
    if ! have_model "$SITE"; then
        if (($(left) > 200)); then
            opts="{\"backend\": \"fsdp\", \"sharding\": \"$MODE2\", \"micro_batch\": $MICRO2, \"max_steps\": $STEPS, $common}"
            train train_fsdp_fallback "$opts" "$SITE" 200
        else
            skip train_fsdp_fallback "the first setup failed and $(left) s are left"
        fi
    fi
fi

# -- 2. exchange: int8 with error feedback, compress and decode ------------------------------------------
if want exchange && have_model "$SITE" && have_model "$W/base"; then
    need=$(($("$PY" -c "from pathlib import Path; print(sum(p.stat().st_size for p in Path('$SITE').glob('*.safetensors')))") * 2 + 2000000000))
    shm=$(df --output=avail -B1 /dev/shm 2> /dev/null | tail -1)
    disk=$(df --output=avail -B1 "$W" | tail -1)
    if [ -n "$shm" ] && ((shm > need)); then
        RES=/dev/shm/published-residual
    elif ((disk > need + 25000000000)); then
        RES=$W/residual
    else
        RES=""
        skip residual "no room for the fp32 residual ($need bytes; /dev/shm ${shm:-?}, disk $disk free): compressed without --residual-out"
    fi
    rm -rf /dev/shm/published-residual
    say "compress ($(cap "${COMPRESS_S:-130}") s at most), residual in ${RES:-nowhere}"
    "$PY" $PS measure --json "$R/compress.json" --log "$L/compress.log" --timeout "$(cap "${COMPRESS_S:-130}")" \
        --extra "{\"update\": \"$W/update\", \"residual\": \"$RES\"}" -- \
        "$PY" -m fedtune.core.updates compress --model "$SITE" --start "$W/base" --options '{"dtype": "int8"}' \
        ${RES:+--residual-out "$RES"} --out "$W/update" > /dev/null 2>&1
    say "compress exit $?"; tail -2 "$L/compress.log"
    if [ -f "$W/update/update.json" ]; then
        say "decode ($(cap 90) s at most)"
        "$PY" $PS measure --json "$R/decode.json" --log "$L/decode.log" --timeout "$(cap 90)" -- \
            "$PY" -m fedtune.core.updates decode --update "$W/update" --start "$W/base" --out "$W/site-b" > /dev/null 2>&1
        say "decode exit $?"; tail -1 "$L/decode.log"
    fi
    if have_model "$W/site-b"; then
        say "compare ($(cap 60) s at most)"
        timeout "$(cap 60)" "$PY" $PS compare --site "$SITE" --rebuilt "$W/site-b" --start "$W/base" \
            ${RES:+--residual "$RES"} --device "$DEVICE" --json "$R/compare.json" > "$L/compare.log" 2>&1 \
            || skip compare "exit $? (log: compare)"
        grep -E "max_abs|relative" "$L/compare.log"
    fi
    cp "$W/update/update.json" "$R/update.json" 2> /dev/null
    rm -rf "$W/update" /dev/shm/published-residual "$W/residual"
elif want exchange; then
    skip exchange "no trained model"
fi

# -- 3. merge: the trained site and its int8-rebuilt copy, default options, cold cache --------------------
OTHER=$W/site-b
if want merge && ! have_model "$OTHER"; then
    OTHER=$W/base  # the second site: the start model, one that did not move
    skip site-b "no rebuilt copy: the start model is the second site"
fi
if ! want merge; then
    :
elif have_model "$SITE" && have_model "$OTHER"; then
    if [ "$OTHER" = "$W/site-b" ]; then rm -rf "$W/base"; fi  # three models on disk at most
    "$PY" $PS evict "$SITE" "$OTHER" > "$R/evict.txt" 2>&1
    say "aggregate ($(cap 150) s at most; cache: $(cat "$R/evict.txt"))"
    "$PY" $PS measure --json "$R/aggregate.json" --log "$L/aggregate.log" --timeout "$(cap 150)" \
        --read "$SITE" --read "$OTHER" --write "$W/merged" --extra "{\"out\": \"$W/merged\", \"evicted_by\": \"$(tail -1 "$R/evict.txt")\"}" -- \
        "$PY" -m fedtune.aggregate --out "$W/merged" --options '{}' --model "it=$SITE" "cs=$OTHER" \
        --manifest "it=$MAN" "cs=$MAN_CS" > /dev/null 2>&1
    say "aggregate exit $?"; tail -2 "$L/aggregate.log"
    rm -rf "$W/site-b"
else
    skip aggregate "fewer than two site models"
fi

# -- 4. evaluate the merged model on the GPU -------------------------------------------------------------
EVAL_MODEL=$W/merged
have_model "$EVAL_MODEL" || EVAL_MODEL=$SITE
have_model "$EVAL_MODEL" || EVAL_MODEL=$W/base
if ! want evaluate; then
    :
elif have_model "$EVAL_MODEL"; then
    length=$SEQ stride=$((SEQ / 2))
    say "evaluate $(basename "$EVAL_MODEL") ($(cap 120) s at most)"
    "$PY" $PS measure --json "$R/evaluate.json" --log "$L/evaluate.log" --timeout "$(cap 120)" \
        --extra "{\"out\": \"$R/scores.json\", \"max_length\": $length, \"model\": \"$(basename "$EVAL_MODEL")\"}" -- \
        "$PY" -m fedtune.evaluate --model "$EVAL_MODEL" --data "$PREP/raw" --site it --device "$DEVICE" \
        --options "{\"max_length\": $length, \"stride\": $stride, \"batch_size\": 4, \"max_documents\": $EVAL_DOCS}" \
        --out "$R/scores.json" > /dev/null 2>&1
    say "evaluate exit $?"; grep "\[evaluate\]" "$L/evaluate.log" | tail -1
else
    skip evaluate "no model"
fi

# -- 1b. DeepSpeed ZeRO-3, if it is here and time is left ----------------------------------------------------
if ! want deepspeed; then
    :
elif grep -q '"deepspeed": null' "$R/gpu.json"; then
    skip train_deepspeed "deepspeed does not import"
elif (($(left) < DS_MIN_S)); then
    skip train_deepspeed "$(left) s left, under DS_MIN_S=$DS_MIN_S"
elif ! have_model "$SITE" && ! have_model "$W/base"; then
    skip train_deepspeed "no model to start from"
else
    # From the trained site (the start model is gone by now), else the start; summary only: no export,
    # no checkpoint.
    INIT=$SITE
    have_model "$INIT" || INIT=$W/base
    DS="{\"backend\": \"deepspeed\", \"zero_stage\": 3, \"micro_batch\": ${DS_MICRO:-1}, \"max_steps\": $DS_STEPS, $common}"
    train train_deepspeed "$DS" "$W/ds-out" $(($(left) - RESERVE_S)) --summary-only
fi

# -- the report -----------------------------------------------------------------------------------------
echo "{\"wall_s\": $SECONDS}" > "$R/wall.json"
say "report"
timeout 60 "$PY" $PS report --work "$W" --out "$OUT" --arch "$ARCH" --seq "$SEQ" \
    --command-line "ARCH=$ARCH WHEELS=${WHEELS:-} OUT=\$OUT benchmarks/gpu-checks/published.sh" > "$L/report.log" 2>&1 \
    || { echo "report failed:"; tail -20 "$L/report.log"; }
for log in "$L"/*.log; do
    echo "=== $(basename "$log")"
    grep -v "it/s\]$\|s/it\]$" "$log" | tail -n 40
done > "$OUT/logs.txt" 2> /dev/null
cp "$R/skipped.json" "$OUT/skipped.json" 2> /dev/null
echo
cat "$OUT/published.md" 2> /dev/null
echo
"$PY" - "$OUT/published.json" <<'PY' 2> /dev/null
import json, sys
r = json.load(open(sys.argv[1]))
for name, step in r["steps"].items():
    keep = {k: v for k, v in (step or {}).items() if not isinstance(v, dict | list)}
    print(name, json.dumps(keep)[:900])
    if isinstance(step, dict) and isinstance(step.get("plan"), dict):
        print("  plan", json.dumps(step["plan"])[:600])
PY
# A warm machine's next call must find its disk free.
[ "${KEEP:-0}" = 1 ] || rm -rf "$W/base" "$W/site-a" "$W/site-b" "$W/merged" "$W/update" /dev/shm/published-residual
say "done in $SECONDS s"
