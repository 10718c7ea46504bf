#!/usr/bin/env bash
# What a lent GPU checks, in one go (~4 min on an H100/H200): the compiled-kernel test suite (tests marked gpu: Triton
# kernels against their twins at production sizes, the train pipelines' CUDA streams and the training job on a
# one-rank NCCL group), then the GPU benchmarks of the pooled lookups, the codecs, the jagged ops and the DLRM train
# step, each against its anchor measured in the same run, and a profile of the ops' host overhead. Every step is
# time-boxed and runs even when an earlier one failed.
#
#   bash benchmarks/gpu_session.sh OUT_DIR       # logs, junit XML and benchmarks/results/runs/<date>/ CSVs land there
#
# Needs tritonrec importable (an install, or PYTHONPATH) and a CUDA device. The CSVs it writes are copied by hand to
# benchmarks/results/ (with the device and date in their rows) when they are worth committing.
#
# On a machine with torch but no network and no install of ours (as the lent H200 was): carry the wheels of
# hydra-core, omegaconf, antlr4-python3-runtime (built with `pip wheel`) and torchdata, then
#   pip install --no-index --no-deps --target /tmp/site WHEELS
#   mkdir -p /tmp/ns/tritonrec && for p in data dist kernels modules optim; do ln -s $PWD/$p /tmp/ns/tritonrec/$p; done
#   PYTHONPATH=/tmp/site:/tmp/ns:$PWD bash benchmarks/gpu_session.sh OUT_DIR
# (tritonrec is a namespace package over those folders, as pyproject's package-dir maps them).
set -uo pipefail
OUT=${1:?usage: gpu_session.sh OUT_DIR}
mkdir -p "$OUT"
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1
status=0

step() {  # step NAME SECONDS COMMAND...: run, time-boxed, log to OUT/NAME.log; remember a failure
  local name=$1 limit=$2
  shift 2
  echo "=== $name (limit ${limit}s): $*"
  local began=$SECONDS
  timeout --kill-after=10 "$limit" "$@" >"$OUT/$name.log" 2>&1
  local rc=$?
  echo "=== $name: rc $rc in $((SECONDS - began))s"
  tail -n 25 "$OUT/$name.log"
  [ "$rc" -eq 0 ] || status=1
}

nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
python3 -c "import torch, triton; print('torch', torch.__version__, '| triton', triton.__version__, '|',
torch.cuda.get_device_name(0))"

step gpu_tests 210 env TRITON_INTERPRET=0 python3 -m pytest -q -m gpu -p no:cacheprovider --timeout 150 \
  --junitxml="$OUT/gpu_tests.xml" tests
step bench_embedding 120 python3 benchmarks/bench_embedding.py --device cuda --cases fbgemm_default cpu_sized gpu_scale --rounds 2 --batches 8 --plot
step bench_codecs 50 python3 benchmarks/bench_codecs.py --device cuda --repeats 10 --plot
step bench_jagged 40 python3 benchmarks/bench_jagged.py --device cuda --plot
step bench_train 90 python3 benchmarks/bench_train.py --out train_dlrm_cuda.csv device=cuda
step profile_ops 90 python3 benchmarks/profile_gpu_ops.py --calls 30 --train-step
exit $status
