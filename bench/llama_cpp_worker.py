"""llama-cpp-python for bench/throughput.py's llama_cpp backend, in a process of its own.

Usage (bench/throughput.py starts it): python bench/llama_cpp_worker.py GGUF N_CTX THREADS
Then one JSON request per line on stdin, {"prompt": [token ids], "max_tokens": n}, and one
JSON answer per line on stdout, {"tokens": generated, "seconds": wall time of the call}.

Why a process of its own: llama.cpp's CPU backend runs on OpenMP, and in kvscope's process
it would share torch's libgomp (the same soname), already started with the
OMP_WAIT_POLICY=PASSIVE that importing `engine` sets. Its threads then sleep between the
graph's ops, and its single stream decoded at 42 tok/s instead of the 121-127 it reaches on
its own on the 2-core EPYC. Here it imports neither torch nor kvscope, and starts without
OMP_WAIT_POLICY: libgomp's defaults, as a llama.cpp user runs it.
"""

import json
import sys
import time

from llama_cpp import Llama


def main() -> None:
    model_path, n_ctx, n_threads = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    llm = Llama(model_path=model_path, n_ctx=n_ctx, n_threads=n_threads, verbose=False)
    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        request = json.loads(line)
        llm.reset()  # no reuse of the previous request's cache: every call prefills
        started = time.perf_counter()
        completion = llm.create_completion(request["prompt"], max_tokens=request["max_tokens"],
                                           temperature=0.0)
        print(json.dumps({"tokens": completion["usage"]["completion_tokens"],
                          "seconds": time.perf_counter() - started}), flush=True)


if __name__ == "__main__":
    main()
