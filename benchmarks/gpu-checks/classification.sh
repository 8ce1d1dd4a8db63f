#!/usr/bin/env bash
# GPU check of sequence-classification: tiny DistilBERT (bidirectional: the attention mask matters),
# trained on one GPU with FSDP bf16, DDP fp32, DeepSpeed ZeRO-2 fp16 (the DistilBERT example's setup),
# then evaluated on CUDA and on CPU. Logs to $OUT.
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site ${WHEELS:-build/gpucheck-cls/whl}/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 TMPDIR=/tmp HF_HUB_OFFLINE=1
W=${DATA:-build/gpucheck-cls/w}
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
python3 -c "import torch, transformers, deepspeed, datasets; print('torch', torch.__version__, 'tf', transformers.__version__, 'ds', deepspeed.__version__, 'datasets', datasets.__version__)" 2>&1 | tail -1
run() {  # name, options-json, extra args
  local name=$1 opts=$2; shift 2
  /usr/bin/time -f "$name wall %e s" scripts/launch --procs-per-node 1 -- python3 -m fedtune.train --site alpha \
    --init $W/model --manifest $W/data/manifest.json --options "$opts" --checkpoints /tmp/w/$name/ckpt \
    --out /tmp/w/$name/model "$@" > $OUT/$name.log 2>&1
  echo "$name rc=$?"; grep -E "^rank|^step|^error|Error|wall" $OUT/$name.log | tail -4
  for dev in cuda cpu; do
    for bs in 1 64; do
      python3 -m fedtune.evaluate --model /tmp/w/$name/model --data $W/raw \
        --options "{\"task\":\"sequence-classification\",\"max_length\":32,\"batch_size\":$bs}" --device $dev --out /tmp/w/$name/eval-$dev-$bs.json 2>&1 | grep -E "accuracy|error" | tail -1
    done
  done
}
B='"micro_batch":16,"global_batch":16,"max_steps":60,"lr":0.003,"warmup_steps":3,"log_every":20,"checkpoint_every":0,"device":"cuda"'
run fsdp_bf16 "{$B,\"precision\":\"bf16\",\"dtype\":\"bfloat16\"}"
run ddp_fp32 "{$B,\"sharding\":\"none\"}"
run ds2_fp16 "{$B,\"backend\":\"deepspeed\",\"zero_stage\":2,\"precision\":\"fp16\",\"dtype\":\"float16\"}"
python3 -m fedtune.evaluate --model $W/model --data $W/raw --options '{"task":"sequence-classification","max_length":32}' --device cuda --out /tmp/w/base.json 2>&1 | grep accuracy
python3 - <<'PY'
import json
for name in ["fsdp_bf16", "ddp_fp32", "ds2_fp16"]:
    try:
        r = {k: json.load(open(f"/tmp/w/{name}/eval-{k}.json")) for k in ("cuda-1", "cuda-64", "cpu-1", "cpu-64")}
        print(name, {k: (round(v["accuracy"], 4), round(v["macro_f1"], 4), round(v["nll"], 5)) for k, v in r.items()})
    except Exception as e:
        print(name, "FAILED", repr(e))
PY
