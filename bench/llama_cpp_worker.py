"""llama-cpp-python for bench/throughput.py's llama_cpp backend, in a process of its own.

Usage (bench/throughput.py starts it): python bench/llama_cpp_worker.py GGUF N_CTX THREADS
Then one JSON request per line on stdin and one JSON answer per line on stdout:
  {"prompt": [token ids], "max_tokens": n}
      one completion from an empty cache, as a llama.cpp user calls it (stops at EOS):
      {"tokens": generated, "seconds": wall time of the call}
  {"batch": [[token ids], ...], "max_tokens": [n, ...], "unified": bool}
      every prompt at once, as llama-server batches its slots: one context of
      n_seq_max = len(batch) sequences (its KV cache in one buffer or per sequence:
      llama.cpp's kv_unified), the prompts prefilled 512 tokens per llama_decode, then one
      llama_decode per step over every unfinished sequence's next token, greedy, each
      generating exactly its max_tokens: {"tokens": generated, "seconds": wall time}
  {"perplexity": [token ids]}
      exp(mean negative log-likelihood) of each token given those before it, from one
      batch with every position's logits: {"perplexity": value, "seconds": wall time}

Why a process of its own: llama.cpp's CPU backend runs on OpenMP, and in kvscope's process
it would share torch's libgomp (the same soname), already started with the
OMP_WAIT_POLICY=PASSIVE that importing `engine` sets. Its threads then sleep between the
graph's ops, and its single stream decoded at about a third of the rate it reaches on its
own (docs/performance-history.md, 'Figures the code's comments quoted'). Here it imports
neither torch nor kvscope, and starts without OMP_WAIT_POLICY: libgomp's defaults, as a
llama.cpp user runs it. It may run under another interpreter than the bench's
(bench/throughput.py's --llama-python), one with llama-cpp-python.
"""

import ctypes
import json
import sys
import time

import llama_cpp
import numpy as np
from llama_cpp import Llama

BATCH_TOKENS = 512  # tokens per llama_decode (llama.cpp's default n_ubatch)


class Context:
    """A llama.cpp context of its own over the loaded model, with a batch and a greedy
    sampler, freed on exit."""

    def __init__(self, llm: Llama, n_ctx: int, n_seq: int, n_threads: int, unified: bool,
                 n_batch: int = BATCH_TOKENS):
        params = llama_cpp.llama_context_default_params()
        params.n_ctx = n_ctx
        params.n_batch = params.n_ubatch = n_batch
        params.n_seq_max = n_seq
        params.n_threads = params.n_threads_batch = n_threads
        params.kv_unified = unified
        self.ctx = llama_cpp.llama_init_from_model(llm.model, params)
        if not self.ctx:
            raise RuntimeError(f"llama_init_from_model failed (n_ctx {n_ctx}, n_seq_max {n_seq})")
        self.batch = llama_cpp.llama_batch_init(n_batch, 0, 1)
        self.sampler = llama_cpp.llama_sampler_init_greedy()

    def __enter__(self) -> "Context":
        return self

    def __exit__(self, *_) -> None:
        llama_cpp.llama_sampler_free(self.sampler)
        llama_cpp.llama_batch_free(self.batch)
        llama_cpp.llama_free(self.ctx)

    def decode(self, entries: list[tuple[int, int, int, bool]]) -> None:
        """One llama_decode of (token, position, sequence, wants logits) entries."""
        batch = self.batch
        for i, (token, position, sequence, logits) in enumerate(entries):
            batch.token[i] = token
            batch.pos[i] = position
            batch.n_seq_id[i] = 1
            batch.seq_id[i][0] = sequence
            batch.logits[i] = logits
        batch.n_tokens = len(entries)
        if llama_cpp.llama_decode(self.ctx, batch) != 0:
            raise RuntimeError(f"llama_decode failed on a batch of {len(entries)} tokens")

    def greedy(self, index: int) -> int:
        """The greedy token of the last batch's entry `index` (one that wanted logits)."""
        return llama_cpp.llama_sampler_sample(self.sampler, self.ctx, index)


def batched(llm: Llama, n_threads: int, prompts: list[list[int]], max_tokens: list[int],
            unified: bool) -> dict:
    longest = max(len(p) + n for p, n in zip(prompts, max_tokens))
    with Context(llm, len(prompts) * longest, len(prompts), n_threads, unified) as context:
        started = time.perf_counter()
        entries = [(token, position, s, position == len(prompt) - 1)
                   for s, prompt in enumerate(prompts) for position, token in enumerate(prompt)]
        next_token = {}
        for start in range(0, len(entries), BATCH_TOKENS):
            chunk = entries[start:start + BATCH_TOKENS]
            context.decode(chunk)
            for i, (_, _, s, logits) in enumerate(chunk):
                if logits:
                    next_token[s] = context.greedy(i)
        generated = [1] * len(prompts)  # each prompt's last logits gave its first token
        while active := [s for s in range(len(prompts)) if generated[s] < max_tokens[s]]:
            context.decode([(next_token[s], len(prompts[s]) + generated[s] - 1, s, True)
                            for s in active])
            for i, s in enumerate(active):
                next_token[s] = context.greedy(i)
                generated[s] += 1
        return {"tokens": sum(generated), "seconds": time.perf_counter() - started}


def perplexity(llm: Llama, n_threads: int, tokens: list[int]) -> dict:
    with Context(llm, max(len(tokens), 256), 1, n_threads, True, n_batch=len(tokens)) as context:
        started = time.perf_counter()
        context.decode([(token, position, 0, True) for position, token in enumerate(tokens)])
        vocab = llama_cpp.llama_vocab_n_tokens(llama_cpp.llama_model_get_vocab(llm.model))
        pointer = llama_cpp.llama_get_logits_ith(context.ctx, 0)
        logits = np.ctypeslib.as_array(ctypes.cast(pointer, ctypes.POINTER(ctypes.c_float)),
                                       shape=(len(tokens), vocab)).astype(np.float64)[:-1]
        top = logits.max(-1, keepdims=True)
        log_norm = np.log(np.exp(logits - top).sum(-1)) + top[:, 0]
        nll = log_norm - logits[np.arange(len(tokens) - 1), tokens[1:]]
        return {"perplexity": float(np.exp(nll.mean())), "seconds": time.perf_counter() - started}


def main() -> None:
    model_path, n_ctx, n_threads = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    llm = Llama(model_path=model_path, n_ctx=n_ctx, n_threads=n_threads, verbose=False)
    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        request = json.loads(line)
        if "batch" in request:
            answer = batched(llm, n_threads, request["batch"], request["max_tokens"],
                             request["unified"])
        elif "perplexity" in request:
            answer = perplexity(llm, n_threads, request["perplexity"])
        else:
            llm.reset()  # no reuse of the previous request's cache: every call prefills
            started = time.perf_counter()
            completion = llm.create_completion(request["prompt"], max_tokens=request["max_tokens"],
                                               temperature=0.0)
            answer = {"tokens": completion["usage"]["completion_tokens"],
                      "seconds": time.perf_counter() - started}
        print(json.dumps(answer), flush=True)


if __name__ == "__main__":
    main()
