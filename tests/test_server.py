"""`turbospark-mlx server`: real HTTP requests against a server on 127.0.0.1. Completions and chat
completions (plain and streamed) give `generate`'s text for the same greedy prompt, two concurrent
streams run batched and each still equals `generate`, bad requests get OpenAI-style errors, and the
CLI starts, serves and stops on Ctrl-C without a traceback."""

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request

import pytest
from conftest import plain
from test_loading import varied_model, write_hf_dir

import turbospark_mlx as ts
from turbospark_mlx.server import Engine, Server

KV = plain("tq4")  # short test prompts fit a shipped preset's FP16 window: plain codes are read here
TEMPLATE = "{% for m in messages %}{{ m['role'] }} : {{ m['content'] }} {% endfor %}w1 :"
PROMPTS = ["w3 w4 w5 w6 w7", "w9 w8 w7 w6 w5 w4 w3 w2 w1 w10 w11"]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = write_hf_dir(tmp_path_factory.mktemp("served") / "tiny", varied_model())
    config = json.loads((path / "tokenizer_config.json").read_text())
    (path / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": TEMPLATE}))
    return path


@pytest.fixture(scope="module")
def loaded(model_dir):
    return ts.load(str(model_dir))


@contextlib.contextmanager
def serving(model, tokenizer, start_engine=True, kv=KV, **kwargs):
    engine = Engine(model, tokenizer, kv=kv, prefill_step_size=4, **kwargs)
    server = Server(("127.0.0.1", 0), engine, "tiny", default_max_tokens=12)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    if start_engine:
        engine.start()
    try:
        yield server
    finally:
        server.shutdown()
        server.server_close()
        engine.stop()


def request(url, path, body=None, raw=None):
    data = raw if raw is not None else (json.dumps(body).encode() if body is not None else None)
    req = urllib.request.Request(url + path, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def events(url, path, body):
    req = urllib.request.Request(url + path, data=json.dumps({**body, "stream": True}).encode())
    out = []
    with urllib.request.urlopen(req, timeout=120) as r:
        assert r.headers["Content-Type"] == "text/event-stream"
        for line in r:
            if line.startswith(b"data: "):
                if line.strip() == b"data: [DONE]":
                    return out
                out.append(json.loads(line[6:]))
    raise AssertionError("the stream ended without [DONE]")


def expected(loaded, prompt, max_tokens, **kwargs):
    model, tokenizer = loaded
    return ts.generate(model, tokenizer, prompt, kv=KV, max_tokens=max_tokens, prefill_step_size=4, **kwargs)


def test_completions_equal_generate(loaded):
    with serving(*loaded) as server:
        for prompt in PROMPTS:
            status, body = request(server.url, "/v1/completions", {"prompt": prompt, "max_tokens": 16})
            assert status == 200, body
            assert body["object"] == "text_completion" and body["model"] == "tiny"
            assert body["choices"][0]["text"] == expected(loaded, prompt, 16)
            usage = body["usage"]
            assert usage["prompt_tokens"] == len(loaded[1].encode(prompt))
            assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
            kv = usage["kv_cache"]
            assert 0 < kv["bytes"] < kv["fp16_bytes"] and 0 < kv["bytes_in_use"] <= kv["bytes"]
            assert kv["uncompressed_bytes_in_use"] > 0
        # A stop string: the text ends before it, as generate's does.
        full = expected(loaded, PROMPTS[0], 16)
        stop = full.split()[2]
        status, body = request(server.url, "/v1/completions", {"prompt": PROMPTS[0], "max_tokens": 16, "stop": stop})
        assert body["choices"][0] == {
            "index": 0, "finish_reason": "stop", "text": expected(loaded, PROMPTS[0], 16, stop=stop), "logprobs": None,
        }
        # No max_tokens: the server's default (12 here).
        status, body = request(server.url, "/v1/completions", {"prompt": PROMPTS[1]})
        assert body["choices"][0]["text"] == expected(loaded, PROMPTS[1], 12)


def test_max_kv_size_bounds_each_request(loaded):
    """Requests on bounded caches (sink rows + the newest positions) answer as generate does
    with the same bound."""
    model, tokenizer = loaded
    with serving(model, tokenizer, kv="fp16", max_kv_size=12) as server:
        status, body = request(server.url, "/v1/completions", {"prompt": PROMPTS[1], "max_tokens": 24})
    want = ts.generate(model, tokenizer, PROMPTS[1], kv="fp16", max_tokens=24, prefill_step_size=4, max_kv_size=12)
    assert status == 200 and body["choices"][0]["text"] == want
    unbounded = ts.generate(model, tokenizer, PROMPTS[1], kv="fp16", max_tokens=24, prefill_step_size=4)
    assert want != unbounded  # the bound changes what is attended to


def test_chat_completions_equal_generate_with_the_template(loaded):
    messages = [{"role": "system", "content": "w20 w21"}, {"role": "user", "content": PROMPTS[0]}]
    with serving(*loaded) as server:
        status, body = request(server.url, "/v1/chat/completions", {"messages": messages, "max_tokens": 10})
        assert status == 200, body
        message = body["choices"][0]["message"]
        assert message == {
            "role": "assistant",
            "content": expected(loaded, PROMPTS[0], 10, chat=True, system="w20 w21"),
        }
        parts = [{**messages[1], "content": [{"type": "text", "text": PROMPTS[0]}]}]
        status, body = request(server.url, "/v1/chat/completions", {"messages": parts, "max_tokens": 10})
        assert body["choices"][0]["message"]["content"] == expected(loaded, PROMPTS[0], 10, chat=True)


def test_two_concurrent_streams_run_batched_and_each_equals_generate(loaded):
    with serving(*loaded, start_engine=False) as server:
        results = {}

        def run(i, path, body):
            results[i] = events(server.url, path, body)

        threads = [
            threading.Thread(target=run, args=(0, "/v1/completions", {"prompt": PROMPTS[1], "max_tokens": 20})),
            threading.Thread(
                target=run,
                args=(1, "/v1/chat/completions", {
                    "messages": [{"role": "user", "content": PROMPTS[0]}], "max_tokens": 14,
                    "stream_options": {"include_usage": True},
                }),
            ),
        ]
        for t in threads:
            t.start()
        deadline = time.time() + 60
        while server.engine.incoming.qsize() < 2:  # both queued before the engine takes any
            assert time.time() < deadline, "the requests never reached the engine"
            time.sleep(0.01)
        server.engine.start()
        for t in threads:
            t.join(120)
        assert server.engine.stats["largest_batch"] == 2
    text = "".join(e["choices"][0]["text"] for e in results[0])
    assert text == expected(loaded, PROMPTS[1], 20)
    assert results[0][-1]["choices"][0]["finish_reason"] in ("stop", "length")
    chunks = [e for e in results[1] if e["choices"]]
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    assert all(e["object"] == "chat.completion.chunk" for e in results[1])
    reply = "".join(e["choices"][0]["delta"]["content"] for e in chunks)
    assert reply == expected(loaded, PROMPTS[0], 14, chat=True)
    usage = results[1][-1]["usage"]
    assert results[1][-1]["choices"] == [] and usage["completion_tokens"] == len(chunks)


@pytest.mark.parametrize(
    "path, body, status, message",
    [
        ("/v1/completions", {"max_tokens": 4}, 400, "'prompt' must be"),
        ("/v1/completions", {"prompt": ["w3", "w4"]}, 400, "one prompt per request"),
        ("/v1/completions", {"prompt": [1, 999]}, 400, "token ids must be in"),
        ("/v1/completions", {"prompt": "w3", "max_tokens": 0}, 400, "'max_tokens' must be an integer >= 1"),
        ("/v1/completions", {"prompt": "w3", "temperature": -1}, 400, "'temperature' must be"),
        ("/v1/completions", {"prompt": "w3", "top_p": 2}, 400, "'top_p' must be"),
        ("/v1/completions", {"prompt": "w3", "stop": [""]}, 400, "'stop' must be"),
        ("/v1/completions", {"prompt": "w3", "n": 2}, 400, "'n' must be 1"),
        ("/v1/completions", {"prompt": "w3", "seed": 1}, 400, "'seed' is not supported"),
        ("/v1/completions", {"prompt": "w3", "stream": "yes"}, 400, "'stream' must be"),
        ("/v1/completions", {"prompt": "w3 " * 40, "max_tokens": 40}, 400, "more than the model's context of 64"),
        ("/v1/chat/completions", {"messages": []}, 400, "'messages' must be a non-empty list"),
        ("/v1/chat/completions", {"messages": [{"content": "w3"}]}, 400, "messages[0] must be an object"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, 400, "only text"),
        ("/v1/embeddings", {"input": "w3"}, 404, "no such endpoint"),
    ],
)
def test_bad_requests_get_openai_errors(loaded, path, body, status, message):
    with serving(*loaded) as server:
        got, payload = request(server.url, path, body)
        assert got == status
        assert message in payload["error"]["message"]
        assert payload["error"]["type"] == "invalid_request_error"
        # The server keeps serving.
        ok, good = request(server.url, "/v1/completions", {"prompt": "w3", "max_tokens": 2})
        assert ok == 200 and good["usage"]["completion_tokens"] >= 1


def test_bodies_that_are_not_json_objects_and_the_get_endpoints(loaded):
    with serving(*loaded) as server:
        for raw, message in [(b"{not json", "not UTF-8 JSON"), (b"\xff\xfe", "not UTF-8 JSON"), (b"[1]", "JSON object")]:
            status, payload = request(server.url, "/v1/completions", raw=raw)
            assert status == 400 and message in payload["error"]["message"]
        status, models = request(server.url, "/v1/models")
        assert status == 200 and [m["id"] for m in models["data"]] == ["tiny"]
        status, health = request(server.url, "/health")
        assert status == 200 and health["status"] == "ok"
        status, payload = request(server.url, "/nowhere")
        assert status == 404


@pytest.mark.parametrize("stop", [signal.SIGINT, signal.SIGTERM])
def test_cli_server_serves_and_stops_on_ctrl_c_or_sigterm(model_dir, loaded, stop):
    env = dict(os.environ, TURBOSPARK_CPU_BLAS="reference", PYTHONFAULTHANDLER="1")
    proc = subprocess.Popen(
        [sys.executable, "-m", "turbospark_mlx", "server", "--model", str(model_dir), "--port", "0",
         "--kv", "tq4", "--max-tokens", "8"],
        stderr=subprocess.PIPE, text=True, env=env,
    )
    try:
        lines = []
        while not (lines and "serving" in lines[-1]):
            line = proc.stderr.readline()
            assert line, f"the server exited: {''.join(lines)}"
            lines.append(line)
        url = lines[-1].split(" at ")[1].split()[0]
        status, body = request(url, "/v1/completions", {"prompt": PROMPTS[0]})
        assert status == 200
        model, tokenizer = loaded
        assert body["choices"][0]["text"] == ts.generate(model, tokenizer, PROMPTS[0], kv="tq4", max_tokens=8)
        assert body["usage"]["kv_cache"]["preset"] == "tq4"
        proc.send_signal(stop)
        try:
            rc = proc.wait(60)
        except subprocess.TimeoutExpired:  # dump every thread's stack (faulthandler) to say where it hangs
            proc.send_signal(signal.SIGABRT)
            pytest.fail(f"the server did not stop within 60 s of signal {stop}:\n{proc.communicate(timeout=30)[1][-6000:]}")
        assert rc == 0
        rest = proc.stderr.read()
        assert "Traceback" not in rest and "stopped" in rest
    finally:
        proc.kill()
        proc.stderr.close()


def test_cli_server_checks_its_flags_before_loading(capsys):
    from turbospark_mlx import cli

    assert cli.main(["server", "--port", "70000"]) == 2
    assert "--port must be in [0, 65535], got 70000" in capsys.readouterr().err
    assert cli.main(["server", "--max-batch-size", "0"]) == 2
    assert "--max-batch-size must be >= 1" in capsys.readouterr().err
