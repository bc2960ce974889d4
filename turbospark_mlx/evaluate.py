"""KV-cache quality: each preset against the FP16 cache on the same model.

`evaluate` reports, per preset:
  - perplexity, mean KL(FP16 || preset) and top-1 agreement, teacher-forced: the
    first `context` tokens of a text are prefilled in chunks through the preset's
    cache (as generation does) and the last `predictions` next-token
    distributions are scored, in float32, against the FP16 cache's;
  - a passkey score: a 5-digit number hidden at evenly spaced depths in filler
    text, then asked for and greedily decoded (`passkey_prompts`);
  - KV bytes (allocated capacity) and peak memory.
Every cache keeps its uncompressed rows in 16 bits (`fp16_dtype`), what a GPU model
stores, so a float32 model on the CPU is measured against the FP16 cache too.
`markdown_table` formats the result; the CLI is `turbospark-mlx eval`.
"""

from __future__ import annotations

import math
import random
import re
import time
import weakref
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator, Sequence

import mlx.core as mx
import mlx.nn as nn

from .cache import KVCacheManager, make_cache, model_dtype
from .generate import model_max_context, prefill
from .quant.config import FP16_BITS, TurboQuantConfig, get_preset

DEFAULT_TEXT = Path("/usr/share/common-licenses/GPL-3")  # Debian base-files: real prose nobody here wrote
REFERENCE = "fp16"
MAX_PREDICTIONS = 1024
PASSKEY_NEW_TOKENS = 8
FILLER = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."
PASSKEY_INTRO = "There is a pass key hidden inside a lot of irrelevant text. Find it and memorize it."
PASSKEY_QUESTION = "What is the pass key?"
PASSKEY_ANSWER = "The pass key is"
MIB = 2**20
KV_BYTES_KIND = "allocated"  # KVCacheManager.nbytes counts allocated capacity, not rows in use

Progress = Callable[[str], None]


def fp16_dtype(model: nn.Module) -> mx.Dtype:
    """The dtype of the harness's uncompressed rows: bfloat16 for a bfloat16 model, else
    float16 (a float32 model's own default cache keeps float32, `model_dtype`)."""
    return mx.bfloat16 if model_dtype(model) == mx.bfloat16 else mx.float16


def default_predictions(context: int) -> int:
    """Positions scored when not given: the last min(1024, context - 1)."""
    return min(MAX_PREDICTIONS, context - 1)


def resolve_presets(presets: Sequence[str | TurboQuantConfig]) -> list[TurboQuantConfig]:
    """Presets to run, FP16 first (the reference, added if missing), duplicates dropped.

    Raises ValueError on an unknown name (listing the valid ones).
    """
    configs = [get_preset(REFERENCE)] + [get_preset(p) for p in presets]
    seen: dict[str, TurboQuantConfig] = {}
    for c in configs:
        seen.setdefault(c.name, c)
    return list(seen.values())


def check_sizes(context: int, predictions: int | None, passkey_depths: int, prefill_step_size: int) -> int:
    """Validate the run's sizes; returns the number of positions to score.

    Each error message starts with the parameter's name (the CLI turns it into the flag).
    """
    if context < 2:
        raise ValueError(f"context must be >= 2, got {context}")
    predictions = default_predictions(context) if predictions is None else predictions
    if not 1 <= predictions <= context - 1:
        raise ValueError(f"predictions must be in [1, context - 1 = {context - 1}], got {predictions}")
    if passkey_depths < 0:
        raise ValueError(f"passkey_depths must be >= 0, got {passkey_depths}")
    if prefill_step_size < 1:
        raise ValueError(f"prefill_step_size must be >= 1, got {prefill_step_size}")
    return predictions


# -- teacher-forced metrics ----------------------------------------------------


def _cache_arrays(cache: KVCacheManager) -> list[mx.array]:
    return [a for l in cache.owned_layers().values() for a in l.arrays.values()]


def scored_logprobs(
    model: nn.Module, cache: KVCacheManager, tokens: Sequence[int], predictions: int, step: int
) -> Iterator[tuple[int, mx.array]]:
    """Prefill `tokens` through `cache` in `step`-row chunks; yield (position, float32 log-probs).

    Positions len(tokens) - 1 - predictions .. len(tokens) - 2 are scored (each
    predicts a token of the text); a chunk yields the rows of it that are scored.
    """
    n = len(tokens)
    first, ids = n - 1 - predictions, mx.array(tokens)[None]
    for start in range(0, n, step):
        logits = model(ids[:, start : start + step], cache=cache)
        lo, hi = max(first, start), min(n - 1, start + step)
        if lo >= hi:  # no scored row here: only the cache is needed
            mx.eval(_cache_arrays(cache))
            continue
        x = logits[0, lo - start : hi - start].astype(mx.float32)
        lp = x - mx.logsumexp(x, axis=-1, keepdims=True)
        mx.eval(lp, _cache_arrays(cache))
        yield lo, lp


def teacher_forced(
    model: nn.Module,
    cache: KVCacheManager,
    tokens: Sequence[int],
    predictions: int,
    step: int,
    reference: list[mx.array] | None = None,
) -> tuple[dict, list[mx.array]]:
    """Perplexity, mean KL(reference || this) and top-1 agreement over the scored positions.

    Without `reference` this run is its own reference. Returns (metrics, the log-prob
    chunks when this run is the reference, to be that of later runs with the same chunking;
    else [], so that no run but the reference holds predictions x vocab floats).
    """
    targets = mx.array(tokens)
    nll = kl = agree = 0.0
    chunks = []
    for i, (pos, lp) in enumerate(scored_logprobs(model, cache, tokens, predictions, step)):
        ref = lp if reference is None else reference[i]
        tgt = targets[pos + 1 : pos + 1 + lp.shape[0], None]
        nll -= mx.take_along_axis(lp, tgt, axis=-1).sum().item()
        kl += (mx.exp(ref) * (ref - lp)).sum().item()
        agree += (mx.argmax(ref, axis=-1) == mx.argmax(lp, axis=-1)).sum().item()
        if reference is None:
            chunks.append(lp)
    metrics = {
        "perplexity": math.exp(nll / predictions),
        "mean_nll": nll / predictions,
        "mean_kl": kl / predictions,
        "top1_agreement": agree / predictions,
    }
    return metrics, chunks


# -- passkey -------------------------------------------------------------------


def _haystack(n_filler: int, depth_index: int, key: str) -> list[str]:
    """n_filler filler sentences with the needle after the first `depth_index` of them."""
    sentences = [s.strip() + "." for s in FILLER.split(".") if s.strip()]
    filler = [sentences[i % len(sentences)] for i in range(n_filler)]
    needle = f"The pass key is {key}. Remember it. {key} is the pass key."
    return filler[:depth_index] + [needle] + filler[depth_index:]


def _passkey_ids(tokenizer, n_filler: int, depth_index: int, key: str, chat: bool) -> list[int]:
    hay = " ".join([PASSKEY_INTRO, *_haystack(n_filler, depth_index, key)])
    if not chat:
        return tokenizer.encode(f"{hay} {PASSKEY_QUESTION} {PASSKEY_ANSWER}")
    # The template writes BOS and the turn markers; the answer's start goes in the model's turn.
    messages = [{"role": "user", "content": f"{hay} {PASSKEY_QUESTION}"}]
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return tokenizer.encode(text + PASSKEY_ANSWER, add_special_tokens=False)


def _most_filler(tokenizer, budget: int, chat: bool) -> int:
    """The most filler sentences whose prompt fits in `budget` tokens (-1: not even none fits)."""
    fits = lambda n: len(_passkey_ids(tokenizer, n, n // 2, "00000", chat)) <= budget  # noqa: E731
    if not fits(0):
        return -1
    lo, hi = 0, budget  # a sentence is at least one token
    while lo < hi:
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid - 1)
    return lo


def passkey_prompts(
    tokenizer, context: int, depths: int, seed: int = 0, chat: bool = False
) -> list[dict]:
    """Passkey prompts that fit `context` with room for the answer.

    Up to `depths` evenly spaced depths from 0 (start) to 1 (end) of the filler (fewer
    when fewer sentence boundaries fit); each gets its own seeded 5-digit key.
    Returns [{"depth", "key", "ids"}]; [] if the context is too small for any.
    """
    budget = context - PASSKEY_NEW_TOKENS
    n = _most_filler(tokenizer, budget, chat)
    m = min(depths, n + 1)
    if m < 1:
        return []
    rng = random.Random(seed)
    prompts = []
    for i in range(m):
        depth = i / (m - 1) if m > 1 else 0.5
        key = str(rng.randrange(10000, 100000))
        k, n_i = round(depth * n), n
        ids = _passkey_ids(tokenizer, n_i, k, key, chat)
        while len(ids) > budget:  # another key may tokenize longer: drop filler after the needle
            n_i -= 1
            ids = _passkey_ids(tokenizer, n_i, min(k, n_i), key, chat)
        prompts.append({"depth": depth, "key": key, "ids": ids})
    return prompts


def greedy_decode(
    model: nn.Module,
    cache: KVCacheManager,
    ids: Sequence[int],
    max_tokens: int,
    step: int,
    stop: set[int],
    logprobs: list[mx.array] | None = None,
) -> list[int]:
    """Prefill `ids` through `cache` (as generation does), then greedily decode up to max_tokens.
    With `logprobs`, each chosen token's log-probabilities over the vocabulary are appended."""
    logits = prefill(model, cache, mx.array(ids)[None], step)
    out: list[int] = []
    while True:
        y = mx.argmax(logits, axis=-1)
        token = y.item()
        if token in stop:
            return out
        out.append(token)
        if logprobs is not None:
            x = logits[0].astype(mx.float32)
            logprobs.append(x - mx.logsumexp(x))
        if len(out) >= max_tokens:
            return out
        logits = model(y.reshape(1, 1), cache=cache)[:, -1, :]


def _digit_tokens(tokenizer, vocab: int) -> dict[str, list[tuple[int, bool]]]:
    """Digit strings -> [(token id, written with leading whitespace)] over the first `vocab` ids
    (decoded once per tokenizer and vocabulary size)."""
    try:
        known = _DIGIT_TOKENS.setdefault(tokenizer, {})
    except TypeError:  # a tokenizer that takes no weak reference: decoded every time
        known = {}
    if vocab not in known:
        found: dict[str, list[tuple[int, bool]]] = {}
        for i in range(vocab):
            try:
                text = tokenizer.decode([i])
            except Exception:  # an id past the tokenizer's vocabulary
                continue
            digits = text.lstrip()
            if digits.isdigit() and digits.isascii():
                found.setdefault(digits, []).append((i, digits != text))
        known[vocab] = found
    return known[vocab]


_DIGIT_TOKENS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def key_margin(tokenizer, key: str, tokens: Sequence[int], logprobs: Sequence[mx.array]) -> float | None:
    """How far greedy decoding is from losing (or finding) the key, in nats.

    From the first answer token that is a number or could begin the key on, each position
    compares the best token that continues the key (a run of its next digits; the first may
    carry leading whitespace) with the best other token: the smallest such margin along the key
    while the answer follows it, or the margin where it leaves it (then negative). None when no
    answer token is a number or could begin the key. A retrieval score flips with a trial's
    luck; the margin says how close each trial was."""
    digits = _digit_tokens(tokenizer, logprobs[0].shape[-1]) if logprobs else {}
    rest, margin = key, None
    for token, lp in zip(tokens, logprobs):
        started = rest != key
        # Tokens for the key's next 1..n digits; whitespace before them only before the first.
        runs = (digits.get(rest[:n], ()) for n in range(1, len(rest) + 1))
        ids = [i for run in runs for i, spaced in run if not (started and spaced)]
        chosen = tokenizer.decode([token]).strip()
        if not started and not (token in ids or chosen[:1].isdigit()):
            continue  # words before the number
        continues = mx.zeros(lp.shape, dtype=mx.bool_)
        if ids:
            continues[mx.array(ids)] = True
        best_in = mx.max(mx.where(continues, lp, -mx.inf)).item()
        best_out = mx.max(mx.where(continues, -mx.inf, lp)).item()
        m = best_in - best_out
        margin = m if margin is None else min(margin, m)
        if token not in ids:
            break
        rest = rest[len(chosen) :]
        if not rest:
            break
    return margin


def found_key(key: str, answer: str) -> bool:
    """Whether `answer` holds `key` as a whole number: '77013' is not found in '177013'."""
    return re.search(rf"(?<!\d){re.escape(key)}(?!\d)", answer) is not None


def passkey_score(
    model: nn.Module,
    tokenizer,
    preset: TurboQuantConfig,
    prompts: list[dict],
    context: int,
    step: int,
    progress: Progress | None = None,
) -> dict:
    """Fraction of `prompts` whose greedy answer holds their key as a number (`found_key`), with
    each answer and its `key_margin`; uncompressed rows in `fp16_dtype`."""
    stop = set(getattr(tokenizer, "eos_token_ids", ()) or ())
    trials = []
    for j, p in enumerate(prompts):
        if progress:
            progress(f"{preset.name}: passkey {j + 1}/{len(prompts)} (depth {p['depth']:.2f})")
        cache = make_cache(model, kv=preset, max_rows=step, max_context=context, dtype=fp16_dtype(model))
        logprobs: list[mx.array] = []
        tokens = greedy_decode(model, cache, p["ids"], PASSKEY_NEW_TOKENS, step, stop, logprobs)
        answer = tokenizer.decode(tokens)
        margin = key_margin(tokenizer, p["key"], tokens, logprobs)
        trials.append({"depth": p["depth"], "key": p["key"], "answer": answer,
                       "hit": found_key(p["key"], answer),
                       "margin": None if margin is None else round(margin, 4)})  # fmt: skip
    hits = sum(t["hit"] for t in trials)
    return {"score": hits / len(trials) if trials else None, "hits": hits, "trials": trials}


# -- the whole run ---------------------------------------------------------------


@dataclass
class _Run:
    """What every preset's run shares: the model, the text's tokens and the passkey prompts."""

    model: nn.Module
    tokenizer: object
    tokens: list[int]
    predictions: int
    step: int
    prompts: list[dict]
    progress: Progress | None

    def say(self, line: str) -> None:
        if self.progress:
            self.progress(line)


def _run_preset(run: _Run, preset: TurboQuantConfig, reference: list[mx.array] | None) -> tuple[dict, list]:
    """One preset's row: teacher-forced metrics, passkey, KV bytes and peak memory."""
    tic = time.perf_counter()
    mx.reset_peak_memory()
    context = len(run.tokens)
    run.say(f"{preset.name}: teacher-forced, {context} tokens, {run.predictions} scored")
    cache = make_cache(
        run.model, kv=preset, max_rows=run.step, max_context=context, dtype=fp16_dtype(run.model)
    )
    metrics, chunks = teacher_forced(run.model, cache, run.tokens, run.predictions, run.step, reference)
    passkey = {"score": None, "hits": None, "trials": []}
    if run.prompts:
        passkey = passkey_score(run.model, run.tokenizer, preset, run.prompts, context, run.step, run.say)
    # The FP16 log-probs held for the KL are the harness's memory, the same in every run.
    held = sum(c.nbytes for c in (reference if reference is not None else chunks))
    row = {
        "preset": preset.name,
        "k_bits": preset.k_bits,
        "v_bits": preset.v_bits,
        **metrics,
        "passkey_score": passkey["score"],
        "passkey_hits": passkey["hits"],
        "passkey_trials": passkey["trials"],
        "kv_bytes": cache.nbytes,
        "kv_fp16_bytes": cache.fp16_nbytes(),
        "kv_ratio_vs_fp16": cache.nbytes / cache.fp16_nbytes(),
        "peak_memory_bytes": mx.get_peak_memory() - held,
        "seconds": time.perf_counter() - tic,
    }
    return row, chunks


def evaluate(
    model: nn.Module,
    tokenizer,
    presets: Sequence[str | TurboQuantConfig],
    text: str | Sequence[int],
    context: int,
    predictions: int | None = None,
    passkey_depths: int = 20,
    prefill_step_size: int = 512,
    *,
    chat: bool = False,
    seed: int = 0,
    progress: Progress | None = None,
) -> dict:
    """Quality of each KV preset against the FP16 cache on `model`.

    Args:
        model, tokenizer: from `turbospark_mlx.load`. The tokenizer may be None when
            `text` is token ids and passkey_depths is 0.
        presets: preset names or configs; "fp16" (the reference) is run first, added if missing.
        text: the text, or its token ids; its first `context` tokens are fed.
        context: tokens fed per teacher-forced run; also the passkey prompts' context.
        predictions: positions scored (the last ones); default min(1024, context - 1).
        passkey_depths: passkey depths (0: no passkey test); fewer if the context is small.
        prefill_step_size: rows per forward pass, the same for every preset.
        chat: passkey prompts through the tokenizer's chat template.
        seed: seeds the passkey keys.
        progress: called with a line of text as each step starts.
    Returns:
        {"context", "predictions", "prefill_step_size", "passkey_depths" (the depths used),
        "kv_bytes_kind", "row_dtype", "results": one dict per preset (FP16 first) with perplexity,
        ppl_delta_pct, mean_kl, top1_agreement (a fraction), passkey_score (None without
        passkey), kv_bytes, kv_fp16_bytes, kv_ratio_vs_fp16, peak_memory_bytes, ...}.
        Peak memory leaves out the FP16 log-probs held for the KL (predictions x vocab
        float32), which every run holds alike.
    Raises:
        ValueError: an unknown preset, a bad size, too short a text, a context beyond the model's.
    """
    configs = resolve_presets(presets)
    predictions = check_sizes(context, predictions, passkey_depths, prefill_step_size)
    if tokenizer is None and (isinstance(text, str) or passkey_depths):
        raise ValueError("without a tokenizer, give the text as token ids and passkey_depths=0")
    if (limit := model_max_context(model)) is not None and context > limit:
        raise ValueError(f"context {context} exceeds the model's context length {limit}")
    ids = list(tokenizer.encode(text)) if isinstance(text, str) else [int(t) for t in text]
    if len(ids) < context:
        raise ValueError(f"the text has {len(ids)} tokens, fewer than context={context}")
    if chat and getattr(tokenizer, "chat_template", None) is None:
        raise ValueError("this tokenizer has no chat template; run the passkey test without chat")
    step = min(prefill_step_size, context)
    prompts = passkey_prompts(tokenizer, context, passkey_depths, seed, chat) if passkey_depths else []
    run = _Run(model, tokenizer, ids[:context], predictions, step, prompts, progress)

    rows, reference = [], None
    for preset in configs:
        row, chunks = _run_preset(run, preset, reference)
        reference = reference if reference is not None else chunks  # the FP16 run's, first
        row["ppl_delta_pct"] = 100 * (row["perplexity"] / rows[0]["perplexity"] - 1) if rows else 0.0
        rows.append(row)
    return {
        "context": context,
        "predictions": predictions,
        "prefill_step_size": step,
        "passkey_depths": [p["depth"] for p in prompts],
        "kv_bytes_kind": KV_BYTES_KIND,
        "row_dtype": str(fp16_dtype(model)).rsplit(".", 1)[-1],
        "results": rows,
    }


def _bits(row: dict) -> str:
    return "16/16" if row["k_bits"] == FP16_BITS else f"{row['k_bits']}/{row['v_bits']}"


def markdown_table(result: dict) -> str:
    """The rows of `evaluate`'s result as a markdown table."""
    rows = f", {result['row_dtype']} rows" if result.get("row_dtype") else ""
    head = (
        "| preset | K/V bits | perplexity | Δ perplexity % | mean KL | top-1 % | passkey "
        f"| KV MiB ({result['kv_bytes_kind']}{rows}) | ×FP16 bytes | peak MiB |"
    )
    lines = [head, "|" + "---|" * 10]
    for r in result["results"]:
        n = len(r["passkey_trials"])
        passkey = f"{r['passkey_hits']}/{n} ({r['passkey_score']:.2f})" if n else "n/a"
        lines.append(
            f"| {r['preset']} | {_bits(r)} | {r['perplexity']:.4f} | {r['ppl_delta_pct']:+.2f} | "
            f"{r['mean_kl']:.5f} | {100 * r['top1_agreement']:.1f} | {passkey} | "
            f"{r['kv_bytes'] / MIB:.2f} | {r['kv_ratio_vs_fp16']:.3f} | {r['peak_memory_bytes'] / MIB:.0f} |"
        )
    return "\n".join(lines)
