#!/usr/bin/env bash
# The CUDA path on one GPU, as one script: environment, the CUDA tests, the trainer on CUDA per
# model (fp32 and bf16), trainer overhead against a plain loop, and NCCL's refusal of two ranks
# on one GPU. Results land in $OUT (default gpu-results/): gpu_check.json, a log and the job dirs.
#   OUT=gpu-results bash scripts/gpu_check.sh
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-gpu-results}
mkdir -p "$OUT/runs"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 WANDB_MODE=disabled
PY=${PYTHON:-python3}
# Hydra is not on every GPU image; wheels carried in .gpu/wheels are installed when present.
if ! $PY -c "import hydra" 2>/dev/null && [ -d .gpu/wheels ]; then
  $PY -m pip install -q --no-index --no-deps .gpu/wheels/*.whl
fi
{
  date -u +"date %Y-%m-%dT%H:%M:%SZ"
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
  $PY -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'nccl', torch.cuda.nccl.version())"
} > "$OUT/environment.txt" 2>&1
cat "$OUT/environment.txt"

echo "== CUDA tests"
$PY -m pytest -q -m cuda tests/test_cuda.py 2>&1 | tail -n 15 | tee "$OUT/pytest_cuda.txt"

echo "== trainer on CUDA, world_size=1, NCCL"
for spec in "mlp:model=mlp model.hidden=4096 model.depth=4 data.batch_size=256" \
            "cnn:model=cnn model.width=64 data.batch_size=256" \
            "transformer:model=transformer data=lm model.d_model=768 model.n_layer=6 model.n_head=12 data.seq_len=256 data.vocab_size=8192 data.batch_size=32"; do
  name=${spec%%:*}; args=${spec#*:}
  for precision in fp32 bf16; do
    $PY -m testbed device=cuda world_size=1 sync=allreduce precision=$precision steps=60 warmup_steps=10 \
      launcher.echo_rank0=false $args hydra.run.dir="$OUT/runs/${name}_${precision}" > "$OUT/runs/${name}_${precision}.log" 2>&1 \
      && echo "$name $precision ok" || echo "$name $precision FAILED (see runs/${name}_${precision}.log)"
  done
done

echo "== trainer overhead vs a plain loop (CUDA)"
for spec in "mlp:model=mlp model.hidden=4096 model.depth=4 data.batch_size=256" \
            "transformer:model=transformer data=lm model.d_model=768 model.n_layer=6 model.n_head=12 data.seq_len=256 data.vocab_size=8192 data.batch_size=32 precision=bf16"; do
  name=${spec%%:*}; args=${spec#*:}
  # shellcheck disable=SC2086
  $PY -m testbed.bench.overhead device=cuda $args --steps 100 --repeats 3 --out "$OUT/runs/overhead_${name}.json"
done

echo "== NCCL with two ranks on one GPU must be refused before spawning"
$PY -m testbed backend=nccl world_size=2 hydra.run.dir="$OUT/runs/nccl_refused" > "$OUT/runs/nccl_refused.txt" 2>&1
echo "rc=$? $(cat "$OUT/runs/nccl_refused.txt")"

$PY - "$OUT" <<'PYEOF'
import json, sys
from pathlib import Path
out = Path(sys.argv[1])
report = {"environment": (out / "environment.txt").read_text().splitlines(), "runs": {}, "overhead": {}}
for s in sorted((out / "runs").glob("*/summary.json")):
    d = json.loads(s.read_text())
    report["runs"][s.parent.name] = {k: d.get(k) for k in ("status", "error", "device", "backend", "throughput",
        "step_time", "phases", "gradient_bytes", "cuda_peak_bytes", "loss_first", "final_loss")}
for o in sorted((out / "runs").glob("overhead_*.json")):
    report["overhead"][o.stem] = json.loads(o.read_text())
report["nccl_refused"] = (out / "runs" / "nccl_refused.txt").read_text().strip()
(out / "gpu_check.json").write_text(json.dumps(report, indent=1) + "\n")
for name, r in report["runs"].items():
    print(f"{name:18s} {r['status']:6s} {r['throughput'] or 0:12.1f} samples/s  step {1e3 * (r['step_time'] or 0):8.2f} ms  loss {r['loss_first']} -> {r['final_loss']}")
for name, r in report["overhead"].items():
    print(f"{name:22s} plain {r['plain_samples_per_s']:.1f}  trainer {r['trainer_samples_per_s']:.1f}  ratio {r['ratio']:.3f}")
PYEOF
tar czf "$OUT/runs.tgz" -C "$OUT" runs && rm -rf "$OUT/runs"
