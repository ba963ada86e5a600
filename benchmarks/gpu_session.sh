#!/usr/bin/env bash
# The checks and benchmarks to run when a GPU is lent (cuda backend; Ray set up as in
# ../shared/GPU.md). Each line below fits one device call (< 10 min); results go to OUT.
#
#   bash benchmarks/gpu_session.sh tests OUT             # the gpu-marked tests
#   bash benchmarks/gpu_session.sh chain OUT             # matmul chain: launch ahead off / on
#   bash benchmarks/gpu_session.sh llama OUT 512 4096    # llama_prefill 7b-shaped per tile: ahead 0 / 4
#   bash benchmarks/gpu_session.sh torch OUT             # llama_prefill: the torch baselines
#   bash benchmarks/gpu_session.sh streams1 OUT          # llama tile 512 on one stream: does the
#                                                        # device gain from several streams?
set -euo pipefail
part=${1:?usage: gpu_session.sh tests|chain|llama|torch|streams1 OUT [TILE ...]}
out=${2:-gpu_out}
shift $(($# < 2 ? $# : 2))
mkdir -p "$out"
w="llama_prefill preset=7b layers=4 gpus=1 seq=4096" # + tile=T; workload parameters go before options
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
llama)
    for tile in "${@:-2048}"; do
        for a in 0 4; do
            python -m disco_ray bench $w tile="$tile" "${opts[@]}" --modes dynamic --ahead "$a" \
                --out "$out/llama_t${tile}_a$a" 2>&1 | tee "$out/llama_t${tile}_a$a.log"
        done
    done
    ;;
torch)
    python -m disco_ray bench $w tile=4096 "${opts[@]}" --modes torch_naive,torch_prefetch \
        --out "$out/llama_torch" 2>&1 | tee "$out/llama_torch.log"
    ;;
streams1)
    python -m disco_ray bench $w tile=512 "${opts[@]}" --modes dynamic --streams 1 \
        --out "$out/llama_t512_s1" 2>&1 | tee "$out/llama_t512_s1.log"
    ;;
*)
    echo "gpu_session.sh: unknown part '$part' (tests, chain, llama, torch or streams1)" >&2
    exit 2
    ;;
esac
