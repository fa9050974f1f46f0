#!/usr/bin/env bash
# Every CPU figure of docs/benchmarks.md, one after the other (they must not overlap on 2 cores).
# Results: bench_results/*.json and *.log. Takes about 40 minutes on a quiet 2-core machine.
set -u
cd "$(dirname "$0")/.."
mkdir -p bench_results
SMALL=$(python -c "import sys; sys.path.insert(0, 'benchmarks'); from bench_models import resolve_model; print(resolve_model('small', 'bfloat16')[0])")
M100=$(python -c "import sys; sys.path.insert(0, 'benchmarks'); from bench_models import resolve_model; print(resolve_model('100m', 'bfloat16')[0])")
run() { local name=$1; shift; echo "== $name: $*"; "$@" > "bench_results/$name.log" 2>&1; tail -n 25 "bench_results/$name.log"; }

# Issue 2: one static batch against transformers' generate.
run one_batch_100m_bf16 python benchmarks/bench_one_batch.py --model-path "$M100" --batch-size 16 --input-len 128 --output-len 128 --dtype bfloat16 --compare-hf --repeats 2 --result-file bench_results/one_batch_100m_bf16.json
run one_batch_100m_fp32 python benchmarks/bench_one_batch.py --model-path "$M100" --batch-size 16 --input-len 128 --output-len 128 --dtype float32 --compare-hf --repeats 2 --result-file bench_results/one_batch_100m_fp32.json
run one_batch_small_bf16 python benchmarks/bench_one_batch.py --model-path "$SMALL" --batch-size 16 --input-len 128 --output-len 128 --dtype bfloat16 --compare-hf --repeats 2 --result-file bench_results/one_batch_small_bf16.json
run one_batch_builtin python benchmarks/bench_one_batch.py --batch-size 16 --input-len 128 --output-len 128 --dtype float32 --compare-hf --repeats 2 --result-file bench_results/one_batch_builtin.json
# Issue 3: continuous batching against static batching; radix cache on a shared-prefix workload.
run offline_random_100m python benchmarks/bench_offline_throughput.py --model 100m --dtype bfloat16 --dataset random --num-prompts 64 --compare-hf --result-file bench_results/offline_random_100m.json
run offline_random_builtin python benchmarks/bench_offline_throughput.py --model builtin --dtype float32 --dataset random --num-prompts 64 --compare-hf --result-file bench_results/offline_random_builtin.json
run offline_shared_100m python benchmarks/bench_offline_throughput.py --model 100m --dtype bfloat16 --dataset shared-prefix --compare-no-radix --result-file bench_results/offline_shared_100m.json
run offline_shared_builtin python benchmarks/bench_offline_throughput.py --model builtin --dtype float32 --dataset shared-prefix --compare-no-radix --result-file bench_results/offline_shared_builtin.json
# Issue 5: overlap against the normal loop.
run overlap_builtin python benchmarks/bench_overlap.py --model builtin --num-reqs 64 256 --repeats 4 --profile bench_results/overlap_profile_builtin --result-file bench_results/overlap_builtin.json
run overlap_builtin_stream python benchmarks/bench_overlap.py --model builtin --num-reqs 256 --stream --repeats 4 --result-file bench_results/overlap_builtin_stream.json
run overlap_100m python benchmarks/bench_overlap.py --model 100m --dtype bfloat16 --num-reqs 64 --repeats 4 --result-file bench_results/overlap_100m.json
run overlap_devicelike python benchmarks/bench_overlap.py --num-reqs 64 256 --stream --device-forward-ms 5 --repeats 4 --result-file bench_results/overlap_devicelike.json
# Overlap through the server: the same streaming workload with the default loop and the normal one.
SERVE="--dtype bfloat16 --max-total-tokens 200000 --max-running-requests 256 --chunked-prefill-size 2048 --max-prefill-tokens 4096"
for loop in overlap normal; do
  extra=""; [ "$loop" = normal ] && extra=" --disable-overlap-schedule"
  run serving_$loop python benchmarks/bench_serving.py --launch-server --server-args "$SERVE$extra" --backend engine \
      --dataset random --num-prompts 64 --random-input-len 512 --random-output-len 256 --random-range-ratio 0.0625 \
      --seed 0 --request-rate inf --output-file bench_results/serving_$loop.json
done
# Issue 15: two workers behind sglang-router, cache_aware against round_robin, and the router's overhead.
run router python benchmarks/bench_router.py --server-args "--device cpu --max-total-tokens 6144" --output-file bench_results/router.json
# Issue 17: constrained decoding against the same tokens unconstrained; grammar compile times.
run grammar_overlap python benchmarks/bench_grammar.py --threads 1 --repeats 7 --result-file bench_results/grammar_overlap.json
run grammar_normal python benchmarks/bench_grammar.py --threads 1 --repeats 7 --disable-overlap-schedule --result-file bench_results/grammar_normal.json
# Issue 18: all-MiniLM-L6-v2 through the server against sentence-transformers; radix cache on a decoder embedding model.
run embeddings_t1 python benchmarks/bench_embeddings.py --num-sentences 512 --batch-sizes 1 8 64 --concurrency 4 --threads 1 --skip-prefix-reuse --output-file bench_results/embeddings_t1.json
run embeddings python benchmarks/bench_embeddings.py --num-sentences 512 --batch-sizes 1 8 64 --concurrency 4 --output-file bench_results/embeddings.json
# Issue 16: PD (prefill and decode on a core each, behind sglang-router) against a unified server;
# the KV transfer path against a memory copy.
run pd python benchmarks/bench_pd.py --output-file bench_results/pd.json
