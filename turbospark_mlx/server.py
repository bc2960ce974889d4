"""An OpenAI-compatible HTTP server over the package's models and compressed KV caches.

Endpoints: `POST /v1/completions` and `POST /v1/chat/completions` (with `"stream": true`
as server-sent events), `GET /v1/models`, `GET /health`. The HTTP side is the standard
library's `ThreadingHTTPServer`, as `mlx_lm.server`'s: one thread per connection,
which validates and tokenizes the request and then reads its pieces from a queue.

One `Engine` thread runs the model and batches continuously: every step, each running
request advances one token in one forward pass (`SequenceBatch`: shared matmuls, each
request's attention on its own cache); a request that arrives is prefilled one chunk per
step beside them and joins the batch when its prompt is in. A request's tokens are those
`generate` gives for the same prompt and settings when it runs alone.

Not served: several prompts per request (`n`, prompt lists), per-request `seed`
(requests share the batch's random stream), logprobs, tools. Each is refused with a 400
naming the field; fields OpenAI clients send that do not change the output are ignored.
"""

from __future__ import annotations

import json
import queue
import threading
import time
import uuid
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from .cache import KVCacheManager, make_cache
from .cache.batch import SequenceBatch
from .generate import DEFAULT_KV, TextStream, encode_messages, eval_cache, model_max_context, token_picker
from .quant.config import TurboQuantConfig

MAX_BODY_BYTES = 16 * 2**20  # a request body larger than this is refused (413)


class RequestError(ValueError):
    """A request the server refuses: HTTP `status` with an OpenAI-style error body."""

    def __init__(self, message: str, status: int = 400, param: str | None = None):
        super().__init__(message)
        self.status = status
        self.param = param


@dataclass
class Sampling:
    """One request's generation settings, checked (OpenAI field names in the errors)."""

    max_tokens: int
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float | None = None
    stop: list[str] = field(default_factory=list)

    @classmethod
    def from_body(cls, body: dict, default_max_tokens: int) -> "Sampling":
        for name in ("seed", "logprobs", "top_logprobs", "tools", "functions", "suffix", "echo", "best_of"):
            if body.get(name) not in (None, False):
                raise RequestError(f"{name!r} is not supported by this server", param=name)
        if body.get("n", 1) != 1:
            raise RequestError("'n' must be 1: one completion per request", param="n")
        max_tokens = body.get("max_completion_tokens", body.get("max_tokens", default_max_tokens))
        stop = body.get("stop") or []
        stop = [stop] if isinstance(stop, str) else stop
        s = cls(
            max_tokens=max_tokens,
            temperature=body.get("temperature", 0.0),
            top_p=body.get("top_p", 1.0),
            top_k=body.get("top_k", 0),
            min_p=body.get("min_p", 0.0),
            repetition_penalty=body.get("repetition_penalty"),
            stop=stop,
        )
        number = (int, float)
        checks = [
            ("max_tokens", _is_int(s.max_tokens) and s.max_tokens >= 1, "an integer >= 1"),
            ("temperature", _is(s.temperature, number) and s.temperature >= 0, "a number >= 0"),
            ("top_p", _is(s.top_p, number) and 0 < s.top_p <= 1, "a number in (0, 1]"),
            ("top_k", _is_int(s.top_k) and s.top_k >= 0, "an integer >= 0"),
            ("min_p", _is(s.min_p, number) and 0 <= s.min_p <= 1, "a number in [0, 1]"),
            (
                "repetition_penalty",
                s.repetition_penalty is None or (_is(s.repetition_penalty, number) and s.repetition_penalty > 0),
                "a number > 0",
            ),
            (
                "stop",
                isinstance(s.stop, list) and all(isinstance(x, str) and x for x in s.stop),
                "a non-empty string or a list of them",
            ),
        ]
        for name, ok, what in checks:
            if not ok:
                raise RequestError(f"{name!r} must be {what}", param=name)
        return s


def _is(value, types) -> bool:
    return isinstance(value, types) and not isinstance(value, bool)


def _is_int(value) -> bool:
    return _is(value, int)


class Request:
    """One generation: its prompt ids and settings; the engine builds its cache and sampler
    (MLX work stays on the engine's thread) and puts (text, finish_reason) pairs on `out`,
    or a `RequestError` if it fails."""

    def __init__(self, ids: list[int], sampling: Sampling, tokenizer):
        self.ids = ids
        self.sampling = sampling
        self.text = TextStream(tokenizer, sampling.max_tokens, sampling.stop)
        self.out: queue.Queue = queue.Queue()
        self.cancelled = threading.Event()  # the client went away
        self.cache: KVCacheManager | None = None
        self.prefilled = 0
        self.generated = 0
        self.next_token: mx.array | None = None  # sampled, not yet fed back

    def setup(self, cache: KVCacheManager) -> None:
        s = self.sampling
        self.cache = cache
        self.history = mx.array(self.ids)
        # mlx-lm's sampler takes top_p 0 for "off".
        self.pick = token_picker(s.temperature, s.top_p if s.top_p < 1 else 0.0, s.top_k, s.min_p, s.repetition_penalty)


class Engine:
    """The thread that runs the model: prefills arriving requests and steps the running ones
    together, at most `max_batch_size` of them (the rest wait their turn)."""

    def __init__(
        self,
        model: nn.Module,
        tokenizer,
        *,
        kv: str | TurboQuantConfig = DEFAULT_KV,
        max_batch_size: int = 8,
        prefill_step_size: int = 512,
        max_context: int | None = None,
        max_kv_size: int | None = None,
    ):
        if max_batch_size < 1 or prefill_step_size < 1:
            raise ValueError(
                f"max_batch_size and prefill_step_size must be >= 1, got {max_batch_size}, {prefill_step_size}"
            )
        self.model, self.tokenizer, self.kv = model, tokenizer, kv
        self.max_batch_size = max_batch_size
        self.prefill_step_size = prefill_step_size
        self.max_kv_size = max_kv_size  # bounds each request's cache; it may then outrun the model's context
        self.context = max_context or (None if max_kv_size else model_max_context(model))
        self.incoming: queue.Queue = queue.Queue()
        self.stats = {"requests": 0, "steps": 0, "largest_batch": 0}
        # MLX streams belong to the thread that made them: the engine thread runs on a
        # thread-local stream, as mlx-lm's generation thread does.
        self._stream = mx.new_thread_local_stream(mx.default_device())
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()

    def submit(self, ids: list[int], sampling: Sampling) -> Request:
        """Queue a generation; raises RequestError if it cannot fit the context."""
        if not ids:
            raise RequestError("the prompt is empty", param="prompt")
        need = len(ids) + sampling.max_tokens
        if self.context is not None and need > self.context:
            raise RequestError(
                f"the prompt's {len(ids)} tokens plus max_tokens={sampling.max_tokens} need {need} "
                f"positions, more than the model's context of {self.context}",
                param="max_tokens",
            )
        request = Request(ids, sampling, self.tokenizer)
        self.incoming.put(request)
        return request

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="turbospark-engine", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self.incoming.put(None)  # wakes a waiting engine
        if self._thread is not None:
            self._thread.join()

    def _run(self) -> None:
        try:
            self._loop()
        finally:
            mx.clear_streams()  # this thread's MLX streams, joined here rather than at process exit

    def _loop(self) -> None:
        with mx.stream(self._stream):
            waiting: list[Request] = []
            running: list[Request] = []
            while not self._stop.is_set():
                self._admit(waiting, block=not waiting and not running)
                try:
                    if waiting and len(running) < self.max_batch_size:
                        if self._prefill_chunk(waiting[0]):
                            running.append(waiting.pop(0))
                    if running:
                        running = self._step(running)
                except Exception as e:  # a failed step fails its requests, not the server
                    for r in waiting + running:
                        r.out.put(RequestError(f"generation failed: {type(e).__name__}: {e}", status=500))
                    waiting, running = [], []

    def _admit(self, waiting: list[Request], block: bool) -> None:
        try:
            item = self.incoming.get(block=block)
            while True:
                if item is not None:
                    waiting.append(item)
                    self.stats["requests"] += 1
                item = self.incoming.get_nowait()
        except queue.Empty:
            pass
        waiting[:] = [r for r in waiting if not r.cancelled.is_set()]

    def _prefill_chunk(self, r: Request) -> bool:
        """Feed the next chunk of r's prompt; True once the prompt is in and its first token sampled."""
        if r.cache is None:
            r.setup(make_cache(
                self.model, kv=self.kv, max_rows=self.prefill_step_size, max_context=self.context,
                max_kv_size=self.max_kv_size,
            ))  # fmt: skip
        end = min(len(r.ids), r.prefilled + self.prefill_step_size)
        logits = self.model(r.history[None, r.prefilled : end], cache=r.cache)
        r.prefilled = end
        if end < len(r.ids):
            eval_cache(r.cache)
            return False
        r.next_token = r.pick(r.history, logits[:, -1, :])
        mx.eval(r.next_token)
        return True

    def _step(self, running: list[Request]) -> list[Request]:
        """Hand out each request's sampled token; feed the unfinished ones back in one pass."""
        going = []
        for r in running:
            token = r.next_token.item()
            r.generated += 1
            text, finish = r.text.add(token)
            r.out.put((text, finish))
            if finish is None and not r.cancelled.is_set():
                r.history = mx.concatenate([r.history, r.next_token.reshape(1)])
                going.append(r)
        if going:
            tokens = mx.concatenate([r.next_token.reshape(1, 1) for r in going])
            batch = going[0].cache if len(going) == 1 else SequenceBatch([r.cache for r in going])
            logits = self.model(tokens, cache=batch)[:, -1, :]
            for b, r in enumerate(going):
                r.next_token = r.pick(r.history, logits[b : b + 1])
            mx.eval([r.next_token for r in going])
            self.stats["steps"] += 1
            self.stats["largest_batch"] = max(self.stats["largest_batch"], len(going))
        return going


def _content(message: Any, i: int) -> dict:
    """A chat message as the template takes it: role and text (text parts joined)."""
    if not isinstance(message, dict) or not isinstance(message.get("role"), str):
        raise RequestError(f"messages[{i}] must be an object with a 'role' string", param="messages")
    content = message.get("content")
    if isinstance(content, list):
        texts = [p.get("text") for p in content if isinstance(p, dict) and p.get("type") == "text"]
        if len(texts) != len(content) or not all(isinstance(t, str) for t in texts):
            raise RequestError(f"messages[{i}].content: only text parts are supported", param="messages")
        content = "".join(texts)
    if not isinstance(content, str):
        raise RequestError(f"messages[{i}].content must be a string or a list of text parts", param="messages")
    return {"role": message["role"], "content": content}


class Handler(BaseHTTPRequestHandler):
    """OpenAI's completion endpoints; `server` carries the engine, tokenizer and model id."""

    server_version = "turbospark-mlx"

    def log_message(self, format: str, *args) -> None:  # requests are not logged to stderr
        pass

    def do_GET(self) -> None:
        if self.path.rstrip("/") == "/v1/models":
            model = {"id": self.server.model_id, "object": "model", "created": self.server.created, "owned_by": "local"}
            self._json(200, {"object": "list", "data": [model]})
        elif self.path.rstrip("/") == "/health":
            self._json(200, {"status": "ok", **self.server.engine.stats})
        else:
            self._error(RequestError(f"no such endpoint: GET {self.path}", status=404))

    def do_POST(self) -> None:
        kinds = {"/v1/completions": "text_completion", "/v1/chat/completions": "chat.completion"}
        kind = kinds.get(self.path.rstrip("/"))
        try:
            if kind is None:
                raise RequestError(f"no such endpoint: POST {self.path}", status=404)
            body = self._body()
            ids = self._prompt_ids(body, chat=kind == "chat.completion")
            stream = body.get("stream", False)
            if not isinstance(stream, bool):
                raise RequestError("'stream' must be true or false", param="stream")
            sampling = Sampling.from_body(body, self.server.default_max_tokens)
            request = self.server.engine.submit(ids, sampling)
        except RequestError as e:
            self._error(e)
            return
        include_usage = bool((body.get("stream_options") or {}).get("include_usage"))
        if stream:
            self._stream(request, kind, include_usage)
        else:
            self._complete(request, kind)

    # -- request --------------------------------------------------------------

    def _body(self) -> dict:
        try:
            length = int(self.headers.get("Content-Length", ""))
        except ValueError:
            raise RequestError("a Content-Length header is required", status=411) from None
        if length > MAX_BODY_BYTES:
            raise RequestError(f"request body of {length} bytes is over the {MAX_BODY_BYTES} limit", status=413)
        raw = self.rfile.read(length)
        try:
            body = json.loads(raw.decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise RequestError(f"the request body is not UTF-8 JSON: {e}") from None
        if not isinstance(body, dict):
            raise RequestError("the request body must be a JSON object")
        return body

    def _prompt_ids(self, body: dict, chat: bool) -> list[int]:
        tokenizer = self.server.tokenizer
        if chat:
            messages = body.get("messages")
            if not isinstance(messages, list) or not messages:
                raise RequestError("'messages' must be a non-empty list", param="messages")
            try:
                return encode_messages(tokenizer, [_content(m, i) for i, m in enumerate(messages)])
            except RequestError:
                raise
            except Exception as e:  # the model's template refused the conversation
                raise RequestError(f"the chat template cannot render these messages: {e}", param="messages") from None
        prompt = body.get("prompt")
        if isinstance(prompt, str):
            return tokenizer.encode(prompt)
        if isinstance(prompt, list) and prompt and all(_is_int(t) for t in prompt):
            vocab = getattr(getattr(self.server.engine.model, "args", None), "vocab_size", None)
            if vocab is not None and not all(0 <= t < vocab for t in prompt):
                raise RequestError(f"prompt token ids must be in [0, {vocab})", param="prompt")
            return list(prompt)
        raise RequestError("'prompt' must be a string or a list of token ids (one prompt per request)", param="prompt")

    # -- response -------------------------------------------------------------

    def _envelope(self, kind: str, request_id: str) -> dict:
        return {"id": request_id, "object": kind, "created": int(time.time()), "model": self.server.model_id}

    def _usage(self, request: Request) -> dict:
        n, cache = len(request.ids), request.cache
        stored, full = cache.bytes_in_use()
        return {
            "prompt_tokens": n,
            "completion_tokens": request.generated,
            "total_tokens": n + request.generated,
            # The package's own field, at the request's end: the bytes its KV cache had allocated
            # (and FP16 would have), and the bytes its positions take as stored and uncompressed.
            "kv_cache": {
                "preset": cache.config.name,
                "bytes": cache.nbytes,
                "fp16_bytes": cache.fp16_nbytes(),
                "bytes_in_use": stored,
                "uncompressed_bytes_in_use": full,
            },
        }

    def _pieces(self, request: Request):
        while True:
            item = request.out.get()
            if isinstance(item, RequestError):
                raise item
            yield item
            if item[1] is not None:
                return

    def _complete(self, request: Request, kind: str) -> None:
        text, finish = "", None
        try:
            for piece, finish in self._pieces(request):
                text += piece
        except RequestError as e:
            self._error(e)
            return
        prefix = "chatcmpl" if kind == "chat.completion" else "cmpl"
        choice = {"index": 0, "finish_reason": finish}
        if kind == "chat.completion":
            choice["message"] = {"role": "assistant", "content": text}
        else:
            choice.update(text=text, logprobs=None)
        body = self._envelope(kind, f"{prefix}-{uuid.uuid4().hex}")
        self._json(200, {**body, "choices": [choice], "usage": self._usage(request)})

    def _stream(self, request: Request, kind: str, include_usage: bool) -> None:
        chat = kind == "chat.completion"
        envelope = self._envelope(
            "chat.completion.chunk" if chat else "text_completion",
            f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}",
        )
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Cache-Control", "no-cache")
        self.end_headers()
        try:
            first = True
            for piece, finish in self._pieces(request):
                if chat:
                    delta = {"role": "assistant", "content": piece} if first else {"content": piece}
                    choice = {"index": 0, "delta": delta, "finish_reason": finish}
                else:
                    choice = {"index": 0, "text": piece, "logprobs": None, "finish_reason": finish}
                self._event({**envelope, "choices": [choice]})
                first = False
            if include_usage:
                self._event({**envelope, "choices": [], "usage": self._usage(request)})
            self.wfile.write(b"data: [DONE]\n\n")
            self.wfile.flush()
        except RequestError as e:  # the status line is sent: the error goes as an event
            self._event({"error": {"message": str(e), "type": "server_error", "code": e.status}})
        except (BrokenPipeError, ConnectionResetError):
            request.cancelled.set()  # the engine drops it at its next step

    def _event(self, payload: dict) -> None:
        self.wfile.write(b"data: " + json.dumps(payload).encode() + b"\n\n")
        self.wfile.flush()

    def _json(self, status: int, payload: dict) -> None:
        data = json.dumps(payload).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _error(self, e: RequestError) -> None:
        kind = "invalid_request_error" if e.status < 500 else "server_error"
        self._json(e.status, {"error": {"message": str(e), "type": kind, "param": e.param, "code": e.status}})


class Server(ThreadingHTTPServer):
    """The HTTP server: `Handler` threads in front of one `Engine`."""

    daemon_threads = True

    def __init__(self, address: tuple[str, int], engine: Engine, model_id: str, default_max_tokens: int = 512):
        super().__init__(address, Handler)
        self.engine = engine
        self.tokenizer = engine.tokenizer
        self.model_id = model_id
        self.default_max_tokens = default_max_tokens
        self.created = int(time.time())

    @property
    def url(self) -> str:
        host, port = self.server_address[:2]
        return f"http://{host}:{port}"
