#!/bin/bash
# The checks that need a CUDA GPU, in one run on a lent GPU machine (see docs/benchmarks.md):
# the CUDA tests, the training-overhead benchmark on the GPU (every configuration, the RAM tier's
# included), and an in-process recovery from real CUDA out-of-memory errors, compared bitwise.
# Results go to $OUT (or ./gpu-out). Needs python3 with a CUDA torch, safetensors, xxhash, typer,
# fsspec, pytest (the device image has them); the package is taken from src/.
set -u
OUT=${OUT:-gpu-out}; mkdir -p "$OUT"
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1 CUBLAS_WORKSPACE_CONFIG=:4096:8
nvidia-smi -L; df -h /dev/shm | tail -1
python3 -c "import torch, safetensors, xxhash, typer, fsspec; print('torch', torch.__version__, torch.cuda.get_device_name())"
echo "== CUDA tests"; timeout 120 python3 -m pytest -q -p no:cacheprovider tests/test_cuda_snapshot.py 2>&1 | tee "$OUT/cuda_tests.log" | tail -15
echo "== recovery from real CUDA OOMs"
R=$(mktemp -d)
timeout 90 python3 tests/recovery_train.py --device cuda --run-dir "$R/ref" --out "$R/ref-out" 2>&1 | tail -3
timeout 90 python3 tests/recovery_train.py --device cuda --run-dir "$R/rec" --out "$R/rec-out" --async-save \
    --faults 7:realoom,12:oombw,13:nan:2,23:realoom 2>&1 | grep -E "rolled back|Error|error" | head -8
python3 - "$R" <<'PY' 2>&1 | tee "$OUT/recovery.log"
import sys, torch
from safetensors.torch import load_file
r = sys.argv[1]
a, b = load_file(f"{r}/ref-out/final.safetensors"), load_file(f"{r}/rec-out/final.safetensors")
print("recovery bitwise:", a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a))
PY
echo "== training overhead on the GPU"
timeout 330 python3 benchmarks/bench_train_overhead.py --device cuda --layers 4 --dim 768 --seq 256 --batch 16 \
    --vocab 16000 --steps 60 --warmup 5 --every 20 --reps 1 --threads 8 --dir /tmp \
    --json "$OUT/overhead_cuda.json" --markdown "$OUT/overhead_cuda.md" 2>&1 | tail -25
