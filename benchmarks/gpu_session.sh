#!/usr/bin/env bash
# The checks and benchmarks to run when a GPU is lent (cuda backend; Ray set up as in
# ../shared/GPU.md). Each part fits one device call (< 10 min); results go to OUT.
#
#   bash benchmarks/gpu_session.sh tests OUT        # the gpu-marked tests
#   bash benchmarks/gpu_session.sh chain OUT        # matmul chain: launch ahead off / on
#   bash benchmarks/gpu_session.sh llama512 OUT     # llama_prefill 7b-shaped, tile 512: ahead 0 / 4, 1 stream
#   bash benchmarks/gpu_session.sh llama2048 OUT    # the same with tile 2048, and the torch baselines
# (1 stream: is the per-kernel cost host-side contention between the stream threads?)
set -euo pipefail
part=${1:?usage: gpu_session.sh tests|chain|llama512|llama2048 OUT}
out=${2:-gpu_out}
mkdir -p "$out"
w="llama_prefill preset=7b layers=4 gpus=1 seq=4096"  # + tile=T, before the options
opts=(--capacity 2GiB --backend cuda --repeat 2)
case $part in
tests)
    python -m pytest -q -m gpu tests/test_gpu.py --timeout=600 2>&1 | tee "$out/gpu_tests.log"
    ;;
chain)
    for a in 0 4; do
        python benchmarks/bench_gpu_chain.py --repeat 3 --engines ray --ahead "$a" 2>&1 | tee "$out/chain_ahead$a.log"
    done
    ;;
llama512 | llama2048)
    tile=${part#llama}
    for a in 0 4; do
        python -m disco_ray bench $w tile="$tile" "${opts[@]}" --modes dynamic --ahead "$a" \
            --out "$out/llama_t${tile}_a$a" 2>&1 | tee "$out/llama_t${tile}_a$a.log"
    done
    if [ "$tile" = 512 ]; then
        python -m disco_ray bench $w tile=512 "${opts[@]}" --modes dynamic --streams 1 \
            --out "$out/llama_t512_s1" 2>&1 | tee "$out/llama_t512_s1.log"
    else
        python -m disco_ray bench $w tile="$tile" "${opts[@]}" --modes torch_naive,torch_prefetch \
            --out "$out/llama_torch" 2>&1 | tee "$out/llama_torch.log"
    fi
    ;;
*)
    echo "gpu_session.sh: unknown part '$part' (tests, chain, llama512 or llama2048)" >&2
    exit 2
    ;;
esac
