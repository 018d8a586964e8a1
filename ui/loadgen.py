"""The load generator: N requests at a rate, sharing a system prompt, to stress the pool."""

import random
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from engine.sampling_params import SamplingParams

# Ordinary prose to cut prompts from, so block hover texts read as words.
CORPUS = (
    "The paged attention design stores the key and value cache of every sequence in "
    "fixed size blocks, so memory is allocated on demand and shared between requests "
    "that start with the same tokens. A block table maps each logical block of a "
    "sequence to a physical block in the pool, much like virtual memory maps pages. "
    "When the pool runs out, the scheduler preempts the least important request and "
    "recomputes it later, while prefix caching keeps finished prompts around until "
    "their blocks are needed again. ")
MAX_WORKERS = 64


@dataclass(slots=True)
class LoadSpec:
    num_requests: int
    rate: float  # requests per second
    shared_fraction: float  # share of requests that start with the shared system prompt
    prompt_len: tuple[int, int]
    output_len: tuple[int, int]
    n: int = 1

    def validate(self) -> None:
        if not 1 <= self.num_requests <= 1000:
            raise ValueError(f"requests={self.num_requests} must be between 1 and 1000")
        if not 0 < self.rate <= 1000:
            raise ValueError(f"rate={self.rate} must be in (0, 1000] requests/s")
        if not 0 <= self.shared_fraction <= 1:
            raise ValueError(f"shared fraction={self.shared_fraction} must be in [0, 1]")
        for name, (low, high) in (("prompt", self.prompt_len), ("output", self.output_len)):
            if not 1 <= low <= high:
                raise ValueError(f"{name} length range {low}..{high}: need 1 <= min <= max")
        if not 1 <= self.n <= 8:
            raise ValueError(f"n={self.n} must be between 1 and 8")


class LoadGenerator:
    """Sends in a background thread; counts what was sent, finished, refused or failed."""

    def __init__(self, engine):
        self.engine = engine
        self.sent = self.finished = self.failed = 0
        self._lock = threading.Lock()
        self._pool = ThreadPoolExecutor(MAX_WORKERS, thread_name_prefix="kvscope-loadgen")
        corpus_ids = engine.tokenizer(CORPUS * 8, add_special_tokens=False).input_ids
        self._corpus = corpus_ids
        self._system = corpus_ids[:len(corpus_ids) // 4]

    def status(self) -> str:
        return (f"load generator: sent {self.sent} · finished {self.finished} · "
                f"refused or failed {self.failed}")

    def start(self, spec: LoadSpec, seed: int | None = None) -> str:
        spec.validate()
        threading.Thread(target=self._send_all, args=(spec, random.Random(seed)),
                         name="kvscope-loadgen", daemon=True).start()
        return (f"Sending {spec.num_requests} requests at {spec.rate:g}/s "
                f"({spec.shared_fraction:.0%} with the shared system prompt).")

    def _prompt(self, spec: LoadSpec, rng: random.Random) -> list[int]:
        length = rng.randint(*spec.prompt_len)
        prefix = self._system[:length] if rng.random() < spec.shared_fraction else []
        start = rng.randrange(len(self._corpus) - length)
        return prefix + self._corpus[start:start + length - len(prefix)]

    def _send_all(self, spec: LoadSpec, rng: random.Random) -> None:
        started = time.monotonic()
        for index in range(spec.num_requests):
            time.sleep(max(0.0, started + index / spec.rate - time.monotonic()))
            params = SamplingParams(n=spec.n, temperature=1.0, ignore_eos=True,
                                    max_tokens=rng.randint(*spec.output_len))
            try:
                stream = self.engine.submit(self._prompt(spec, rng), params, source="loadgen")
            except RuntimeError:  # the engine is shutting down: stop sending
                return
            with self._lock:
                self.sent += 1
            self._pool.submit(self._drain, stream)

    def _drain(self, stream) -> None:
        try:
            for _ in stream:
                pass
        except (ValueError, RuntimeError):  # refused, or a failed step: counted in status
            with self._lock:
                self.failed += 1
            return
        with self._lock:
            self.finished += 1
