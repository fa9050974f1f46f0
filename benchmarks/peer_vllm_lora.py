"""vLLM's CPU build serving bench_lora.py's workload, for the side-by-side LoRA row of docs/benchmarks.md.

Runs inside vLLM's own venv (bench_peers.py --install-vllm makes one), never with this project on the
path: 64 requests of 128 random token ids (seed 0), 32 greedy tokens each, EOS ignored, all submitted at
once; the base model alone, then 8 rank-16 adapters round-robin (bench_lora.py's write_adapter, saved as
DIR/adapter0..7); both cores for the model (VLLM_CPU_NUM_OF_RESERVED_CPU=0). One untimed round of each,
then 3 alternating rounds; the fastest of each is printed.

  python -c "import sys; sys.path.insert(0, 'benchmarks'); from bench_models import resolve_model; \
from bench_lora import write_adapter; p = resolve_model('builtin', 'bfloat16')[0]; \
[write_adapter(p, f'/tmp/adapters/adapter{i}', 16, seed=i) for i in range(8)]; print(p)"
  VLLM_CPU_NUM_OF_RESERVED_CPU=0 VLLM_CPU_KVCACHE_SPACE=2 VENV/bin/python benchmarks/peer_vllm_lora.py MODEL_DIR /tmp/adapters
"""

import random
import sys
import time


def main() -> None:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt
    from vllm.lora.request import LoRARequest

    model, adapters = sys.argv[1], sys.argv[2]
    rng = random.Random(0)
    vocab = 2560  # the built-in model's
    prompts = [TokensPrompt(prompt_token_ids=[rng.randrange(vocab) for _ in range(128)]) for _ in range(64)]
    params = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)
    llm = LLM(model=model, dtype="bfloat16", enable_lora=True, max_loras=8, max_lora_rank=16, max_model_len=512,
              max_num_seqs=64, seed=0)
    loras = [LoRARequest(f"adapter{i}", i + 1, f"{adapters}/adapter{i}") for i in range(8)]
    spread = [loras[i % len(loras)] for i in range(len(prompts))]

    def tok_s(lora) -> float:
        start = time.perf_counter()
        outs = llm.generate(prompts, params, lora_request=lora, use_tqdm=False)
        return sum(len(o.outputs[0].token_ids) for o in outs) / (time.perf_counter() - start)

    tok_s(spread)
    tok_s(None)
    runs = {"base": [], "lora": []}
    for r in range(3):
        for name in (("base", "lora") if r % 2 == 0 else ("lora", "base")):
            runs[name].append(tok_s(None if name == "base" else spread))
    base, lora = max(runs["base"]), max(runs["lora"])
    print(f"vLLM base {base:.1f} tok/s, lora {lora:.1f} tok/s, lora / base {lora / base:.2f} (every round: {runs})")


if __name__ == "__main__":
    main()
