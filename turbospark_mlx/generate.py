"""Text generation over a TurboQuant (or FP16) KV cache.

`stream_generate` yields a `GenerationResponse` per token; `generate` returns the
text. The prompt is prefilled in chunks of `prefill_step_size` rows (each chunk
commits M rows at once into the cache); decoding then adds one row per token.
Sampling and logits processors are mlx-lm's (`mlx_lm.sample_utils`).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable, Iterator, Sequence

import mlx.core as mx
import mlx.nn as nn

from .cache import KVCacheManager, make_cache
from .models.base import parallel_group
from .quant.config import DEFAULT_PRESET, TurboQuantConfig

DEFAULT_KV = DEFAULT_PRESET
PROGRESS_MIN_CHUNK = 64  # prefill rows per call when a progress callback asks for 5% steps


@dataclass
class GenerationResponse:
    """One step of `stream_generate`.

    Attributes:
        text: the new text this step (may be empty while a multi-byte character or a
            possible stop string is incomplete).
        token: the token generated this step.
        prompt_tokens, prompt_tps: prompt length and prefill speed (tokens/s).
        generation_tokens, generation_tps: tokens generated so far and decode speed (over the
            tokens after the first, whose time is the prefill's; 0 until there are two).
        peak_memory: peak memory MLX allocated, in GB.
        kv_bytes: bytes the KV cache has allocated now; kv_fp16_bytes: the same capacity as FP16.
        kv_used_bytes, kv_uncompressed_bytes: the bytes the positions held take as stored, and
            as uncompressed rows of `kv_row_dtype` (`KVCacheManager.bytes_in_use`).
        kv: the cache preset's name.
        finish_reason: None while generating, then "stop" or "length".
        from_draft: the token was a draft model's proposal the model accepted.
    """

    text: str
    token: int
    prompt_tokens: int
    prompt_tps: float
    generation_tokens: int
    generation_tps: float
    peak_memory: float
    kv_bytes: int
    kv_fp16_bytes: int
    kv_used_bytes: int
    kv_uncompressed_bytes: int
    kv_row_dtype: str
    kv: str
    finish_reason: str | None = None
    from_draft: bool = False

    def stats_line(self) -> str:
        ratio = self.kv_used_bytes / self.kv_uncompressed_bytes if self.kv_uncompressed_bytes else 1.0

        def count(n: int, tps: float) -> str:
            rate = f"{tps:.1f} tok/s" if tps > 0 else "rate n/a"
            return f"{n} token{'' if n == 1 else 's'}, {rate}"

        return (
            f"prompt: {count(self.prompt_tokens, self.prompt_tps)} | "
            f"generation: {count(self.generation_tokens, self.generation_tps)} | "
            f"peak memory: {self.peak_memory:.3f} GB | "
            f"KV cache ({self.kv}): {self.kv_used_bytes / 2**20:.2f} MiB in use vs "
            f"{self.kv_uncompressed_bytes / 2**20:.2f} MiB as uncompressed {self.kv_row_dtype} "
            f"({ratio:.3f}x), {self.kv_bytes / 2**20:.2f} MiB allocated"
        )


def _vocab_size(model: nn.Module) -> int | None:
    return getattr(getattr(model, "args", None), "vocab_size", None)


def model_max_context(model: nn.Module) -> int | None:
    """The context length a model was trained for (max_position_embeddings), if it says."""
    return getattr(model, "max_context", None)


def encode_prompt(
    tokenizer, prompt: str | Sequence[int], chat: bool = False, system: str | None = None
) -> list[int]:
    """Token ids of a prompt; with chat=True through the tokenizer's chat template."""
    if not isinstance(prompt, str):
        return [int(t) for t in prompt]
    if chat:
        messages = ([{"role": "system", "content": system}] if system else []) + [
            {"role": "user", "content": prompt}
        ]
        return encode_messages(tokenizer, messages)
    return tokenizer.encode(prompt)


QUERY = "<query>"  # stands in for the user's text while the chat template is split around it


def chat_template_parts(tokenizer, system: str | None = None) -> tuple[str, str]:
    """The chat template's text before and after one user message's content.

    A prompt cache holds `before + document`; a later question is fed as `question + after`,
    so the whole is the template applied to `document + question` (mlx-lm's split).
    """
    if getattr(tokenizer, "chat_template", None) is None:
        raise ValueError("this tokenizer has no chat template; generate without chat")
    messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": QUERY}]
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    i = text.index(QUERY)
    return text[:i], text[i + len(QUERY) :]


def encode_messages(tokenizer, messages: Sequence[dict]) -> list[int]:
    """Token ids of a conversation through the tokenizer's chat template, ready for the reply."""
    if getattr(tokenizer, "chat_template", None) is None:
        raise ValueError("this tokenizer has no chat template; generate without chat")
    # The template writes BOS and the turn markers itself.
    text = tokenizer.apply_chat_template(list(messages), add_generation_prompt=True, tokenize=False)
    return tokenizer.encode(text, add_special_tokens=False)


def eval_cache(cache: KVCacheManager) -> None:
    """Evaluate the cache's storage so a long prefill does not build one huge lazy graph."""
    arrays = [a for l in cache.owned_layers().values() for a in l.arrays.values()]
    mx.eval(arrays)


def prefill(
    model: nn.Module,
    cache: KVCacheManager,
    tokens: mx.array,
    prefill_step_size: int = 512,
    progress: Callable[[int, int], None] | None = None,
) -> mx.array:
    """Run the prompt through the model in chunks; returns the logits of its last token, (B, vocab).

    Each chunk of M <= prefill_step_size rows is written and committed at once; with a
    `progress` callback, chunks are at most 5% of the prompt (at least PROGRESS_MIN_CHUNK rows).
    """
    n = tokens.shape[1]
    step = min(prefill_step_size, cache.max_rows)
    if progress is not None:  # report at least every 5% of the prompt (chunks of >= 64 rows)
        step = min(step, max(PROGRESS_MIN_CHUNK, -(-n // 20)))
    logits = None
    for start in range(0, n, step):
        chunk = tokens[:, start : start + step]
        logits = model(chunk, cache=cache)
        if start + step < n:
            eval_cache(cache)  # the logits of inner chunks are never needed, so never computed
        else:
            logits = logits[:, -1, :]
            mx.eval(logits)
        if progress is not None:
            progress(min(start + step, n), n)
    return logits


def token_picker(
    temperature: float = 0.0,
    top_p: float = 0.0,
    top_k: int = 0,
    min_p: float = 0.0,
    repetition_penalty: float | None = None,
    repetition_context_size: int = 20,
) -> Callable[[mx.array, mx.array], mx.array]:
    """pick(history, logits) -> the next token(s): mlx-lm's logits processors, then its sampler."""
    # mlx_lm's package import pulls in transformers: only when generating.
    from mlx_lm.sample_utils import make_logits_processors, make_sampler

    sampler = make_sampler(temperature, top_p=top_p, min_p=min_p, top_k=top_k)
    processors = make_logits_processors(
        repetition_penalty=repetition_penalty, repetition_context_size=repetition_context_size
    )

    def pick(history: mx.array, logits: mx.array) -> mx.array:
        for p in processors:
            logits = p(history, logits)
        logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        return sampler(logprobs)

    return pick


class TextStream:
    """One sequence's tokens turned into text pieces, with its stop conditions.

    `add(token)` returns (new text, finish reason): the text is held back while a
    multi-byte character or a stop string may still be forming; the finish reason is
    "stop" (a stop token or string; neither is in the text), "length" or None.
    """

    def __init__(
        self,
        tokenizer,
        max_tokens: int,
        stop: str | Sequence[str] | None = None,
        stop_tokens: Sequence[int] | None = None,
    ):
        self.max_tokens = max_tokens
        self.stops = [stop] if isinstance(stop, str) else list(stop or [])
        self.stop_ids = (
            set(stop_tokens) if stop_tokens is not None else set(getattr(tokenizer, "eos_token_ids", ()) or ())
        )
        self.detok = tokenizer.detokenizer
        self.detok.reset()
        self.tokens = 0
        self.emitted = 0  # characters of the text already returned
        self.hold = max((len(s) for s in self.stops), default=1) - 1

    def add(self, token: int) -> tuple[str, str | None]:
        self.tokens += 1
        finish = None
        if token in self.stop_ids:
            finish = "stop"
        else:
            self.detok.add_token(token)
            if self.tokens >= self.max_tokens:
                finish = "length"
        if finish is not None:
            self.detok.finalize()  # flush bytes held back for an incomplete character
        text = self.detok.text
        hits = [i for i in (text.find(s, max(0, self.emitted - self.hold)) for s in self.stops) if i >= 0]
        if hits:
            text, finish = text[: min(hits)], "stop"
        safe = len(text) if finish is not None else max(self.emitted, len(text) - self.hold)
        segment, self.emitted = text[self.emitted : safe], max(self.emitted, safe)
        return segment, finish


def stream_generate(
    model: nn.Module,
    tokenizer,
    prompt: str | Sequence[int],
    *,
    kv: str | TurboQuantConfig = DEFAULT_KV,
    cache: KVCacheManager | None = None,
    max_tokens: int = 256,
    temperature: float = 0.0,
    top_p: float = 0.0,
    top_k: int = 0,
    min_p: float = 0.0,
    repetition_penalty: float | None = None,
    repetition_context_size: int = 20,
    seed: int | None = None,
    stop: str | Sequence[str] | None = None,
    stop_tokens: Sequence[int] | None = None,
    chat: bool = False,
    system: str | None = None,
    prefill_step_size: int = 512,
    max_context: int | None = None,
    max_kv_size: int | None = None,
    progress: Callable[[int, int], None] | None = None,
    draft_model: nn.Module | None = None,
    num_draft_tokens: int = 3,
) -> Iterator[GenerationResponse]:
    """Generate from `prompt`, one `GenerationResponse` per token.

    Args:
        model, tokenizer: from `turbospark_mlx.load`.
        prompt: text, or token ids.
        kv: KV preset name ("tq4", "k8v4", "fp16", ...) or a `TurboQuantConfig`;
            ignored when `cache` is given.
        cache: an existing cache to continue (its offset counts towards the context).
        max_tokens: most tokens to generate.
        temperature, top_p, top_k, min_p: sampling (temperature 0 is greedy).
        repetition_penalty, repetition_context_size: mlx-lm's repetition penalty.
        seed: seeds MLX's random generator first, for reproducible sampling.
        stop: strings that end generation (not included in the text).
        stop_tokens: token ids that end generation; default the tokenizer's EOS ids.
        chat: wrap the prompt with the tokenizer's chat template (system: its system message).
        prefill_step_size: prompt rows per forward pass (<= the cache's max_rows).
        max_context: positions the cache may hold; default the model's max_position_embeddings.
        max_kv_size: bound the new cache (`KVCacheManager`): each layer keeps its first
            sink rows and newest max_kv_size - sinks positions, so memory stops growing and
            generation may run past the model's context length (as mlx-lm's
            --max-kv-size); max_context then applies only if given.
        progress: called as progress(done, total) after each prefill chunk.
        draft_model: a smaller model with the same vocabulary for speculative decoding (its
            cache uses the same preset); num_draft_tokens: its proposals per step.
    Raises:
        ValueError: the prompt is empty, or prompt plus max_tokens exceeds the context.
    """
    ids = encode_prompt(tokenizer, prompt, chat=chat, system=system)
    if not ids:
        raise ValueError("the prompt is empty")
    if max_tokens < 1:
        raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
    if prefill_step_size < 1:
        raise ValueError(f"prefill_step_size must be >= 1, got {prefill_step_size}")
    if draft_model is not None:
        if num_draft_tokens < 1:
            raise ValueError(f"num_draft_tokens must be >= 1, got {num_draft_tokens}")
        vocab, draft_vocab = _vocab_size(model), _vocab_size(draft_model)
        if vocab != draft_vocab:
            raise ValueError(f"the draft model's vocabulary ({draft_vocab}) differs from the model's ({vocab})")
    bounded = max_kv_size if cache is None else cache.max_kv_size
    context = max_context or (cache.max_context if cache is not None else None)
    if bounded is None:
        context = context or model_max_context(model)
    start = cache.offset if cache is not None else 0
    if context is not None and start + len(ids) + max_tokens > context:
        raise ValueError(
            f"prompt of {len(ids)} tokens (after {start} cached) plus max_tokens={max_tokens} needs "
            f"{start + len(ids) + max_tokens} positions, more than the context of {context}; "
            "shorten the prompt or lower max_tokens"
        )
    if cache is None:
        cache = make_cache(model, kv=kv, max_rows=prefill_step_size, max_context=context, max_kv_size=max_kv_size)
    group = parallel_group(model)
    if group is not None:
        seed = _shared_seed(seed, group)
    if seed is not None:
        mx.random.seed(seed)
    pick = token_picker(temperature, top_p, top_k, min_p, repetition_penalty, repetition_context_size)
    stream = TextStream(tokenizer, max_tokens, stop, stop_tokens)
    history = mx.array(ids)

    mx.reset_peak_memory()
    tic = time.perf_counter()
    logits = prefill(model, cache, history[None], prefill_step_size, progress)
    y = pick(history, logits)
    mx.eval(y)
    prompt_time = time.perf_counter() - tic
    prompt_tps = len(ids) / prompt_time

    if draft_model is None:
        tokens = _pipelined_tokens(model, cache, history, y, pick, max_tokens)
    else:
        draft_cache = make_cache(
            draft_model, kv=cache.config, max_rows=cache.max_rows, max_context=context, max_kv_size=bounded
        )
        prefill(draft_model, draft_cache, history[None], prefill_step_size)
        tokens = _speculative_tokens(
            model, draft_model, cache, draft_cache, history, y, pick, max_tokens, num_draft_tokens
        )
    try:
        for n, (token, from_draft) in enumerate(tokens, 1):
            segment, finish = stream.add(token)
            if n == 1:
                tic = time.perf_counter()  # decode speed counts the tokens after the first
            gen_time = time.perf_counter() - tic
            used, full = cache.bytes_in_use()
            yield GenerationResponse(
                text=segment,
                token=token,
                prompt_tokens=len(ids),
                prompt_tps=prompt_tps,
                generation_tokens=n,
                generation_tps=(n - 1) / gen_time if n > 1 and gen_time > 0 else 0.0,
                peak_memory=mx.get_peak_memory() / 1e9,
                kv_bytes=cache.nbytes,
                kv_fp16_bytes=cache.fp16_nbytes(),
                kv_used_bytes=used,
                kv_uncompressed_bytes=full,
                kv_row_dtype=str(cache.dtype).removeprefix("mlx.core."),
                kv=cache.config.name,
                finish_reason=finish,
                from_draft=from_draft,
            )
            if finish is not None:
                return
    finally:
        tokens.close()  # gives back the rows computed ahead: the cache holds the tokens fed back


def _pipelined_tokens(model, cache, history, y, pick, max_tokens: int) -> Iterator[tuple[int, bool]]:
    """(token, False) per step. Pipelined like mlx-lm's generate_step: step n + 1 is queued
    before token n is read, so the host builds it while the GPU runs step n; closing the
    iterator trims that step, so the cache holds the prompt and every token but the last."""
    n, ahead = 0, None
    try:
        while True:
            ahead = None
            if n + 1 < max_tokens:
                after = mx.concatenate([history, y.reshape(1)])
                ahead = pick(after, model(y.reshape(1, 1), cache=cache)[:, -1, :])
                mx.async_eval(ahead)
            n += 1
            yield y.item(), False
            if ahead is None:
                return
            history, y, ahead = after, ahead, None
    finally:
        if ahead is not None:
            cache.trim(1)


def _speculative_tokens(
    model, draft_model, cache, draft_cache, history, y, pick, max_tokens: int, num_draft: int
) -> Iterator[tuple[int, bool]]:
    """(token, from_draft) by speculative decoding, as mlx-lm's speculative_generate_step: the
    draft model proposes up to `num_draft` tokens, the model checks them all in one forward
    pass of M rows and keeps the proposals its own sampler agrees with, then its own next
    token. The tokens are the model's (the draft only saves steps). Closing the iterator
    trims the rows checked beyond the last token given, as `_pipelined_tokens` does."""
    produced, excess = 0, 0  # excess: cache rows beyond the tokens given but the last
    try:
        while True:
            produced += 1
            yield y.item(), False
            n = min(num_draft, max_tokens - produced)
            if n < 1:
                return
            seen, drafts, t = mx.concatenate([history, y.reshape(1)]), [], y
            for _ in range(n):  # the draft cache ends holding y and the first n - 1 drafts
                t = pick(seen, draft_model(t.reshape(1, 1), cache=draft_cache)[:, -1, :])
                seen = mx.concatenate([seen, t.reshape(1)])
                drafts.append(t)
            logits = model(seen[-(n + 1) :][None], cache=cache)[0]  # rows for y, d_1 .. d_n
            mains = [pick(seen[: len(history) + 1 + i], logits[i : i + 1]) for i in range(n + 1)]
            mx.eval(mains, drafts)
            k = 0
            while k < n and mains[k].item() == drafts[k].item():
                k += 1
            cache.trim(n - k)  # keep y and the k drafts the model agrees with
            if k < n:
                draft_cache.trim(n - 1 - k)
            else:
                draft_model(drafts[-1].reshape(1, 1), cache=draft_cache)
            history = seen[: len(history) + 1 + k]
            for j in range(k):
                excess = k - j  # rows for d_j+1 .. d_k, not yet given
                produced += 1
                yield drafts[j].item(), True
            excess, y = 0, mains[k]
    finally:
        if excess:
            cache.trim(excess)


def _shared_seed(seed: int | None, group: mx.distributed.Group) -> int:
    """Rank 0's seed (drawn from the clock if None) on every rank of a split model, so that
    sampling from the same logits picks the same token everywhere."""
    mine = (time.time_ns() % 2**31 if seed is None else seed) if group.rank() == 0 else 0
    return int(mx.distributed.all_sum(mx.array(mine, dtype=mx.int32), group=group).item())


def generate(
    model: nn.Module, tokenizer, prompt: str | Sequence[int], *, verbose: bool = False, **kwargs
) -> str:
    """The generated text for `prompt`; kwargs as `stream_generate`. verbose prints it and the stats.

    On a model split over a group (`shard`, `pipeline`) every rank calls this and gets the text;
    verbose prints the text on rank 0 and each rank's stats line (its own KV bytes), tagged.
    """
    group = parallel_group(model)
    rank = 0 if group is None else group.rank()
    text, last = "", None
    for last in stream_generate(model, tokenizer, prompt, **kwargs):
        text += last.text
        if verbose and rank == 0:
            print(last.text, end="", flush=True)
    if verbose and last is not None:
        tag = "" if group is None else f"[rank {rank}/{group.size()}] "
        print(("\n" if rank == 0 else "") + tag + last.stats_line(), flush=True)
    return text
