#!/usr/bin/env bash
# Reruns the tests marked `numerics` (two computation orders compared within a bound) under the CPU kernel
# paths other hosts take, so a bound that holds only for this host's SIMD kernels fails here, not on a
# user's first `make test`. torch dispatches its own kernels by ATEN_CPU_CAPABILITY (default = scalar,
# avx2, avx512); its BLAS (MKL) and oneDNN pick their own, set alongside so each run is one coherent host:
#   default: ATEN default, MKL SSE4_2, oneDNN SSE41      avx2: ATEN avx2, MKL AVX2, oneDNN AVX2
# each at 1 and 2 intra-op threads (OMP_NUM_THREADS). The Triton tests are left out: on CPU they run in
# Triton's interpreter (numpy), which no capability switch reaches, and ~1000x slower.
# Usage: tools/numerics_paths.sh [python]   (default .venv/bin/python); exit 1 if any combination failed.
set -uo pipefail
PY=${1:-.venv/bin/python}
declare -A MKL=([default]=SSE4_2 [avx2]=AVX2) ONEDNN=([default]=SSE41 [avx2]=AVX2)
failed=0
summary=()
for cap in default avx2; do
  for threads in 1 2; do
    start=$(date +%s)
    echo "== numerics tests: ATEN_CPU_CAPABILITY=$cap MKL_ENABLE_INSTRUCTIONS=${MKL[$cap]} ONEDNN_MAX_CPU_ISA=${ONEDNN[$cap]} OMP_NUM_THREADS=$threads"
    ATEN_CPU_CAPABILITY=$cap MKL_ENABLE_INSTRUCTIONS=${MKL[$cap]} ONEDNN_MAX_CPU_ISA=${ONEDNN[$cap]} \
      OMP_NUM_THREADS=$threads "$PY" -m pytest -q -p no:cacheprovider -m "numerics and not triton" 2>&1 | tail -n 15
    rc=${PIPESTATUS[0]}
    summary+=("cpu_capability=$cap threads=$threads exit=$rc seconds=$(( $(date +%s) - start ))")
    [ "$rc" = 0 ] || failed=1
  done
done
printf 'numerics paths: %s\n' "${summary[@]}"
exit $failed
