# issue 49: CTA pairs with 1x128-block scales by TMA: the GPU test and the GEMM table beside single CTAs with TMA scales
set -u
bash .cdsl/stash.sh .cdsl/part02 > /dev/null && bash .cdsl/install.sh .cdsl || exit 3
[ -d /tmp/site/megatron ] || python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:/tmp/cdslsite:/tmp/cdslsite/nvidia_cutlass_dsl/dsl_packages:$PWD
nvidia-smi --query-gpu=name,clocks.current.sm,clocks.max.sm,power.limit --format=csv | tee $OUT/gpu.txt
timeout 90 python3 -m pytest -m gpu -p no:cacheprovider -q tests/test_gpu.py -k "own_against and tma" > $OUT/gpu_tests.log 2>&1; tail -1 $OUT/gpu_tests.log
timeout ${GEMM_S:-120} python3 docs/results/h100_issue49_66fd8f5/gemm_quick.py $OUT/gemm_quick.json cutlass_tma_scales,cutlass_multicast_tma_scales > $OUT/gemm_quick.log 2>&1; tail -2 $OUT/gemm_quick.log | cut -c1-300
