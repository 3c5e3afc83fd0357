#!/usr/bin/env bash
# The CUDA path on one GPU, as one script (under 8 minutes on an H100/H200): the CUDA tests, the
# trainer's throughput and MFU on ResNet-50 and GPT-2 against a plain PyTorch loop, communication
# timing by CUDA events against synchronize-bracketed timing, and host<->device staging bandwidth.
# Every part has its own time limit inside BUDGET_S, so one that hangs costs only its share.
# Results land in $OUT (default gpu-results/): gpu_check.json (the report), gpu_check.log and
# runs.tgz (job directories, each part's log and JSON). docs/gpu.md's tables are rendered from
# gpu_check.json: python -m analysis.gpu_report --markdown docs/gpu.md docs/gpu/gpu_check.json
#   OUT=gpu-results bash scripts/gpu_check.sh
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-gpu-results}
BUDGET_S=${BUDGET_S:-480}
RUNS="$OUT/runs"
mkdir -p "$RUNS"
exec > >(tee "$OUT/gpu_check.log") 2>&1
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 WANDB_MODE=disabled HYDRA_FULL_ERROR=1
PY=${PYTHON:-python3}
# Packages a GPU image may lack or hold at older versions (Hydra, the gencode's protobuf and gRPC),
# carried as wheels in .gpu/wheels, go into their own directory ahead of the image's.
if [ -d .gpu/wheels ]; then
  $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/gpu-site .gpu/wheels/*.whl \
    && export PYTHONPATH=/tmp/gpu-site:$PYTHONPATH
fi

# part NAME LIMIT_S COMMAND...: run with a time limit (cut to what is left of the budget), log to runs/NAME.log.
part() {
  local name=$1 limit=$2 left; shift 2
  left=$((BUDGET_S - SECONDS - 20))
  if [ "$left" -lt 20 ]; then echo "== $name: skipped, budget spent"; echo skipped > "$RUNS/$name.rc"; return; fi
  [ "$limit" -gt "$left" ] && limit=$left
  echo "== $name (limit ${limit}s, at ${SECONDS}s)"
  timeout -k 10 "$limit" "$@" > "$RUNS/$name.log" 2>&1
  local rc=$?
  echo "$rc" > "$RUNS/$name.rc"
  tail -n 4 "$RUNS/$name.log"
  echo "-- $name rc=$rc"
}

{
  date -u +"date %Y-%m-%dT%H:%M:%SZ"
  echo "commit ${COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}"
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
  $PY -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'nccl', torch.cuda.nccl.version())"
  $PY -c "import transformers, hydra, grpc, google.protobuf as p; print('transformers', transformers.__version__, 'hydra', hydra.__version__, 'grpcio', grpc.__version__, 'protobuf', p.__version__)"
} > "$OUT/environment.txt" 2>&1
cat "$OUT/environment.txt"

# 1. The CUDA tests: NCCL against CPU, bf16, NCCL's refusal of two ranks on one GPU, the parameter
#    server with two ranks sharing it (against CPU), communication stamped when it runs.
part pytest_cuda 240 $PY -m pytest -q -p no:cacheprovider -m cuda tests/test_cuda.py

# 2. Throughput and MFU through `python -m testbed` (NCCL, world_size=1).
R50="model=resnet50 data=synthetic_images data.image_size=224 data.batch_size=128"
GPT2="model=gpt2 data=lm data.seq_len=1024 data.vocab_size=50257 data.batch_size=16"
for spec in "resnet50_fp32:$R50 precision=fp32" "resnet50_bf16:$R50 precision=bf16" "gpt2_bf16:$GPT2 precision=bf16"; do
  name=${spec%%:*}; args=${spec#*:}
  # shellcheck disable=SC2086
  part "train_$name" 120 $PY -m testbed device=cuda world_size=1 sync=allreduce steps=50 warmup_steps=10 \
    launcher.echo_rank0=false $args hydra.run.dir="$RUNS/train_$name"
done

# 3. The trainer against a plain PyTorch loop on the same model and data (target >= 0.97).
for spec in "resnet50_fp32:$R50 precision=fp32" "resnet50_bf16:$R50 precision=bf16" "gpt2_bf16:$GPT2 precision=bf16"; do
  name=${spec%%:*}; args=${spec#*:}
  # shellcheck disable=SC2086
  part "overhead_$name" 120 $PY -m testbed.bench.overhead device=cuda $args --steps 30 --repeats 4 --out "$RUNS/overhead_$name.json"
done

# 4. t_sync, t_encode, t_decode by CUDA events against synchronize brackets (target: within 10 %).
for spec in "allreduce:" "allreduce_powersgd:compress=powersgd"; do
  name=${spec%%:*}; args=${spec#*:}
  # shellcheck disable=SC2086
  part "timing_$name" 90 $PY -m testbed.bench.sync_timing device=cuda sync=allreduce $R50 precision=bf16 $args \
    --steps 30 --out "$RUNS/timing_$name.json"
done

# 5. What staging costs the parameter server: host<->device copies, pinned and pageable.
part staging 60 $PY -m testbed.bench.staging --repeats 20 --out "$RUNS/staging.json"

$PY -m analysis.gpu_report "$OUT" > "$OUT/gpu_check.md"
tar czf "$OUT/runs.tgz" --exclude='*.pt' -C "$OUT" runs environment.txt && rm -rf "$RUNS" "$OUT/environment.txt"
