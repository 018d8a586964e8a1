"""Engine request streams -> OpenAI response bodies and SSE chunks (completions and chat)."""

import asyncio
import json
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field, fields

from kvscope.engine.orchestrator.streams import RequestStream
from kvscope.engine.outputs import CompletionOutput, KVCost, RequestOutput
from kvscope.engine.serving.chat_output import ChatDeltaStream, ChatOutputParser
from kvscope.engine.serving.errors import error_body, from_exception

KV_COST_FIELDS = tuple(f.name for f in fields(KVCost))


@dataclass
class Generation:
    """The engine requests behind one API call; prompt i's samples are choices i*n..i*n+n-1."""

    chat: bool
    response_id: str
    model: str
    streams: list[RequestStream]
    n: int
    tokenizer: object
    logprobs: int | None = None
    include_usage: bool = False
    echo: bool = False  # completions: the prompt opens each choice's text
    # vLLM's prompt_logprobs: on each completions choice, or once on a chat response.
    prompt_logprobs: bool = False
    # chat: how an answer's text becomes reasoning, content and tool calls
    chat_parser: ChatOutputParser = field(default_factory=ChatOutputParser)
    # Called on a worker thread before the final answer (a whole body, a stream's [DONE])
    # goes out: app.py's returns once the finished requests' rows are committed, so an
    # acknowledged request is in the session log even if the process dies next.
    durable: Callable[[], object] | None = None
    created: int = field(default_factory=lambda: int(time.time()))
    # Streaming state: the newest output of each stream, and per choice what was sent.
    latest: dict[int, RequestOutput] = field(default_factory=dict)
    tokens_sent: dict[int, int] = field(default_factory=dict)
    chars_sent: dict[int, int] = field(default_factory=dict)
    finish_sent: set[int] = field(default_factory=set)
    opened: set[int] = field(default_factory=set)  # choices whose echo / prompt part went out
    chat_deltas: dict[int, ChatDeltaStream] = field(default_factory=dict)

    @property
    def object_name(self) -> str:
        return "chat.completion" if self.chat else "text_completion"

    def abort_unfinished(self) -> None:
        for stream in self.streams:
            stream.abort()

    # ---- a whole response ---------------------------------------------------------------
    async def response(self) -> dict:
        finals = await asyncio.gather(*(_last_output(stream) for stream in self.streams))
        choices = []
        for prompt_index, output in enumerate(finals):
            self.latest[prompt_index] = output
            for sample in output.outputs[:self.n]:  # beam search ranks more, best first
                finish_reason = sample.finish_reason
                if self.chat:
                    choice = {"message": self.chat_parser.message(sample.text),
                              "logprobs": self._logprobs(sample, 0, 0)}
                    finish_reason = self.chat_parser.finish_reason(sample.text, finish_reason)
                else:
                    choice = self._opening(output)
                    choice["text"] += sample.text
                    choice["logprobs"] = _joined(choice["logprobs"], self._logprobs(
                        sample, 0, len(choice["text"]) - len(sample.text)))
                choices.append({"index": prompt_index * self.n + sample.index, **choice,
                                "finish_reason": finish_reason})
        body = {"id": self.response_id, "object": self.object_name, "created": self.created,
                "model": self.model, "choices": choices, "usage": self.usage(),
                "kv": self.kv_cost()}
        if self.chat and self.prompt_logprobs:  # one conversation, so one prompt
            body["prompt_logprobs"] = self._prompt_logprobs(finals[0])
        await self._made_durable()
        return body

    async def _made_durable(self) -> None:
        if self.durable is not None:
            await asyncio.to_thread(self.durable)

    def usage(self) -> dict:
        outputs = list(self.latest.values())
        prompt_tokens = sum(len(output.prompt_token_ids) for output in outputs)
        completion_tokens = sum(len(sample.token_ids) for output in outputs
                                for sample in output.outputs)
        return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                "total_tokens": prompt_tokens + completion_tokens,
                "prompt_tokens_details": {
                    "cached_tokens": sum(output.num_cached_tokens for output in outputs)}}

    def kv_cost(self) -> dict | None:
        """kvscope's `kv` object: engine.outputs.KVCost summed over the response's prompts
        (blocks_peak too: each prompt's peak, added); None where no output carried one."""
        costs = [output.kv for output in self.latest.values() if output.kv is not None]
        if not costs:
            return None
        return {name: round(sum(getattr(cost, name) for cost in costs), 6)
                for name in KV_COST_FIELDS}

    # ---- server-sent events -------------------------------------------------------------
    async def events(self) -> AsyncIterator[str]:
        """SSE lines in OpenAI's chunk format, ending with `data: [DONE]`; aborts whatever
        is unfinished when the client goes away (the iterator is closed or cancelled)."""
        queue: asyncio.Queue = asyncio.Queue()
        tasks = [asyncio.create_task(_pump(index, stream, queue))
                 for index, stream in enumerate(self.streams)]
        try:
            if self.chat:  # OpenAI opens every chat choice with the role
                for index in range(len(self.streams) * self.n):
                    yield _sse(self._chunk(index, {"role": "assistant", "content": ""}))
            remaining = len(tasks)
            while remaining:
                prompt_index, item = await queue.get()
                if item is None:
                    remaining -= 1
                elif isinstance(item, Exception):
                    error = from_exception(item)
                    yield _sse(error_body(error.status_code, error.message, error.param,
                                          error.code))
                    break
                else:
                    self.latest[prompt_index] = item
                    for chunk in self._chunks(prompt_index, item):
                        yield _sse(chunk)
            else:
                if self.include_usage:
                    yield _sse({**self._envelope(), "choices": [], "usage": self.usage(),
                                "kv": self.kv_cost()})
            await self._made_durable()
            yield "data: [DONE]\n\n"
        finally:
            for task in tasks:
                task.cancel()
            self.abort_unfinished()

    def _chunks(self, prompt_index: int, output: RequestOutput) -> list[dict]:
        chunks = []
        for sample, delta in zip(output.outputs, output.deltas, strict=True):
            index = prompt_index * self.n + sample.index
            tokens_sent = self.tokens_sent.get(index, 0)
            finishing = sample.finish_reason is not None and index not in self.finish_sent
            if not delta and not finishing and len(sample.token_ids) == tokens_sent:
                continue
            if self.chat:
                fields = self._chat_delta(index, sample)
                if not any(fields.values()) and not finishing and self.logprobs is None:
                    continue  # all of it held back (a marker may be arriving)
            opening = {"text": "", "logprobs": None}
            if not self.chat and index not in self.opened:
                self.opened.add(index)
                opening = self._opening(output)
                self.chars_sent[index] = len(opening["text"])
            logprobs = _joined(opening["logprobs"], self._logprobs(
                sample, tokens_sent, self.chars_sent.get(index, 0)))
            self.tokens_sent[index] = len(sample.token_ids)
            self.chars_sent[index] = self.chars_sent.get(index, 0) + len(delta)
            if finishing:
                self.finish_sent.add(index)
            finish_reason = sample.finish_reason if finishing else None
            if self.chat and finishing:
                finish_reason = self.chat_parser.finish_reason(sample.text, finish_reason)
            chunk = self._chunk(index, fields if self.chat else opening["text"] + delta,
                                logprobs, finish_reason)
            if "prompt_logprobs" in opening:
                chunk["choices"][0]["prompt_logprobs"] = opening["prompt_logprobs"]
            chunks.append(chunk)
        return chunks

    def _chat_delta(self, index: int, sample: CompletionOutput) -> dict:
        if index not in self.chat_deltas:
            self.chat_deltas[index] = ChatDeltaStream(self.chat_parser)
        return self.chat_deltas[index].delta(sample.text, sample.finish_reason is not None)

    # ---- what opens a completion choice: echo and prompt logprobs ------------------------
    def _opening(self, output: RequestOutput) -> dict:
        """The echoed prompt text and its tokens' logprobs, and vLLM's prompt_logprobs."""
        opening: dict = {"text": "", "logprobs": None}
        entries, ids = output.prompt_logprobs, output.prompt_token_ids
        if self.echo:
            opening["text"] = (output.prompt if output.prompt is not None
                               else self.tokenizer.decode(ids))
            if self.logprobs is not None and entries is not None:
                opening["logprobs"] = self._completion_logprobs(ids, entries, 0)
        if self.prompt_logprobs and entries is not None:
            opening["prompt_logprobs"] = self._prompt_logprobs(output)
        return opening

    def _prompt_logprobs(self, output: RequestOutput) -> list[dict | None]:
        """vLLM's shape: per prompt token (None for the first), token id -> logprob, rank
        and decoded text. The prompt token's rank comes from the engine; an alternative's is
        its place among the entry's (every more likely token is among them too)."""
        result = []
        for entry, token, rank in zip(output.prompt_logprobs, output.prompt_token_ids,
                                      output.prompt_token_ranks, strict=True):
            if entry is None:
                result.append(None)
                continue
            ranks = {t: place for place, t in enumerate(sorted(entry, key=entry.get,
                                                               reverse=True), start=1)}
            ranks[token] = rank
            result.append({str(t): {"logprob": logprob, "rank": ranks[t],
                                    "decoded_token": self._token_text(t)}
                           for t, logprob in entry.items()})
        return result

    def _envelope(self) -> dict:
        return {"id": self.response_id,
                "object": "chat.completion.chunk" if self.chat else "text_completion",
                "created": self.created, "model": self.model}

    def _chunk(self, index: int, content: dict | str, logprobs: dict | None = None,
               finish_reason: str | None = None) -> dict:
        body = {"delta": content} if self.chat else {"text": content}
        chunk = {**self._envelope(), "choices": [{"index": index, **body, "logprobs": logprobs,
                                                  "finish_reason": finish_reason}]}
        if self.include_usage:
            chunk["usage"] = None  # OpenAI's chunks carry a null usage until the last one
        return chunk

    # ---- logprobs -------------------------------------------------------------------------
    def _logprobs(self, sample: CompletionOutput, first_token: int,
                  text_offset: int) -> dict | None:
        """Logprobs of the sample's tokens from `first_token` on, in the endpoint's format."""
        if self.logprobs is None or sample.logprobs is None:
            return None
        token_ids = sample.token_ids[first_token:]
        entries = sample.logprobs[first_token:len(sample.token_ids)]
        decode = self._token_text
        if self.chat:
            content = []
            for token_id, entry in zip(token_ids, entries, strict=True):
                top = sorted(entry.items(), key=lambda item: -item[1])[:self.logprobs]
                content.append({**_chat_logprob(decode(token_id), entry[token_id]),
                                "top_logprobs": [_chat_logprob(decode(t), lp) for t, lp in top]})
            return {"content": content}
        return self._completion_logprobs(token_ids, entries, text_offset)

    def _completion_logprobs(self, token_ids: list[int],
                             entries: list[dict[int, float] | None], text_offset: int) -> dict:
        """The completions format; an entry of None (the first prompt token) has no logprob."""
        tokens = [self._token_text(token_id) for token_id in token_ids]
        offsets = []
        for token in tokens:
            offsets.append(text_offset)
            text_offset += len(token)
        return {"tokens": tokens,
                "token_logprobs": [None if entry is None else entry[t]
                                   for t, entry in zip(token_ids, entries, strict=True)],
                "top_logprobs": [None if entry is None else
                                 {self._token_text(t): lp for t, lp in entry.items()}
                                 for entry in entries],
                "text_offset": offsets}

    def _token_text(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id])


def _joined(first: dict | None, second: dict | None) -> dict | None:
    """Two completions-format logprobs back to back (the echoed prompt, then the sample)."""
    if first is None or second is None:
        return first or second
    return {key: first[key] + second[key] for key in first}


def _chat_logprob(token: str, logprob: float) -> dict:
    return {"token": token, "logprob": logprob, "bytes": list(token.encode())}


async def _last_output(stream: RequestStream) -> RequestOutput:
    output = None
    async for output in stream:
        pass
    return output


async def _pump(index: int, stream: RequestStream, queue: asyncio.Queue) -> None:
    """Move one stream's outputs into the merged queue; None marks its end."""
    try:
        async for output in stream:
            queue.put_nowait((index, output))
    except Exception as error:  # noqa: BLE001 -- handed to the consumer, which reports it
        queue.put_nowait((index, error))
    queue.put_nowait((index, None))


def _sse(payload: dict) -> str:
    return f"data: {json.dumps(payload, separators=(',', ':'))}\n\n"
