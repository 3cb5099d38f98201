"""LoRA adapters loaded and unloaded while serving: the engine, the slots, the HTTP routes."""

import jax
import numpy as np
import pytest
from fastapi.testclient import TestClient
from flax import nnx

from jmem.io.tokenizer import ByteTokenizer
from jmem.models import Llama, LlamaConfig
from jmem.serve.api import create_app
from jmem.serve.engine import Engine, EngineConfig
from jmem.serve.lora import read_adapter, stack_adapters
from jmem.serve.lora_slots import AdapterSlots
from jmem.serve.runner import _step_fn
from tests.helpers import random_adapter
from tests.serve.test_multi_lora import PROMPTS, SMALL, greedy, reference

RUNTIME = dict(num_blocks=40, max_loras=1, max_lora_rank=8, allow_runtime_lora=True, **SMALL)


@pytest.fixture(scope="module")
def model():
    return Llama(LlamaConfig.tiny(), rngs=nnx.Rngs(0))


@pytest.fixture(scope="module")
def files(model, tmp_path_factory):
    d = tmp_path_factory.mktemp("runtime_adapters")
    return {"a": str(random_adapter(model, d / "a.npz", 1, 4, ("wq", "wv", "w_down"))),
            "b": str(random_adapter(model, d / "b.npz", 2, 8, ("wo", "w_up"), alpha=8.0, rslora=True)),
            "c": str(random_adapter(model, d / "c.npz", 3, 2, ("wk", "w_gate")))}


@pytest.fixture(scope="module")
def want(model, files):
    """Greedy continuations of PROMPTS by adapter file (None: the base model), each merged model alone."""
    cache = {}

    def run(path):
        if path not in cache:
            cache[path] = reference(model, path, PROMPTS, 6)
        return cache[path]

    return run


def test_adapter_slots_take_and_free_names():
    slots = AdapterSlots(["a", "b"], num_slots=2)
    slots.add("c")
    with pytest.raises(ValueError, match="LoRA adapter 'c' is already loaded"):
        slots.add("c")
    slots.remove("a")  # its slot 0 is free: c goes there without evicting b
    assert slots.assign(["c"]) == [("c", 0)] and slots.resident == {"b": 1, "c": 0}
    with pytest.raises(ValueError, match="unknown LoRA adapter 'a'"):
        slots.assign(["a"])


def test_adapters_load_and_unload_while_serving(model, files, want):
    """An engine started without adapters: loaded ones serve their merged model's tokens in mixed batches
    (two adapters taking turns in one slot), a load compiles nothing, an unloaded name is refused, and a
    name loaded again from another file is another adapter (no prefix-cache hit on the old one's blocks)."""
    engine = Engine(model, ByteTokenizer(), EngineConfig(**RUNTIME))
    # Every linear target stacked at the largest rank accepted, one slot.
    assert engine.adapters == {} and engine.runner.state["layers"]["w_gate"]["kernel"][...].lora_a.shape == \
        (2, 1, 64, 8)
    engine.load_adapter("a", files["a"])
    engine.load_adapter("b", files["b"])
    names = ["a", None, "b", "a", "b"]
    paths = [None if n is None else files[n] for n in names]
    for i, o in enumerate(engine.generate(PROMPTS, greedy(), adapters=names)):
        assert o.token_ids == want(paths[i])[i], names[i]
    assert engine.metrics()["lora_adapters"] == 2 and engine.metrics()["lora_adapter_loads_total"] >= 2
    compiled, shapes = _step_fn._cache_size(), engine.runner.num_compilations
    engine.load_adapter("c", files["c"])
    names = ["c", None, "a", "c", "a"]
    for i, o in enumerate(engine.generate(PROMPTS, greedy(), adapters=names)):
        assert o.token_ids == want(None if names[i] is None else files[names[i]])[i], names[i]
    # Prefix-cache hits may make new step shapes; a shape run before is not compiled again.
    assert _step_fn._cache_size() - compiled == engine.runner.num_compilations - shapes

    engine.unload_adapter("c")
    assert list(engine.adapters) == ["a", "b"]
    with pytest.raises(ValueError, match="unknown LoRA adapter 'c'; accepted: a, b"):
        engine.generate(PROMPTS[:1], greedy(), adapters=["c"])
    # The prefix cache: the 20-token prompt's two full blocks (run with a above) hit under the same adapter...
    assert engine.generate([PROMPTS[4]], greedy(), adapters=["a"])[0].num_cached_tokens == 16
    # ...and miss under a new adapter of the same name.
    engine.unload_adapter("a")
    engine.load_adapter("a", files["c"])
    o = engine.generate([PROMPTS[4]], greedy(), adapters=["a"])[0]
    assert o.num_cached_tokens == 0 and o.token_ids == want(files["c"])[4]


def test_unloading_waits_for_no_request_and_cuts_none_short(model, files, want):
    """An adapter with an unfinished request is not unloaded (the request finishes with its tokens); a
    request queued before its adapter was replaced fails with a clear error instead of using the new one."""
    engine = Engine(model, ByteTokenizer(), EngineConfig(**RUNTIME))
    engine.load_adapter("b", files["b"])
    stream = engine.add_request(PROMPTS[1], greedy(), adapter="b")
    with pytest.raises(ValueError, match=r"LoRA adapter 'b' serves 1 unfinished request\(s\); accepted: unload "
                                         "it once they have finished"):
        engine.unload_adapter("b")
    engine.run_until_idle()
    ids, o = [], None
    while o is None or not o.finished:
        o = stream.get()
        ids += o.token_ids
    assert ids == want(files["b"])[1]
    engine.unload_adapter("b")
    assert engine.adapters == {} and engine.runner.adapter_slots.resident == {}

    engine.load_adapter("b", files["b"])
    stream = engine.add_request(PROMPTS[1], greedy(), adapter="b")
    # Replaced between the request's check and its admission (as a racing unload and load would).
    engine.runner.remove_adapter("b")
    engine.runner.add_adapter(read_adapter("b", files["a"], engine.runner.state, 8, version=99))
    engine.run_until_idle()
    o = stream.get()
    assert o.finished and o.finish_reason == "error" and o.error_param == "model" and o.error == \
        "LoRA adapter 'b' was unloaded before the request started"
    assert engine.kv.pool.num_used == 0


def test_runtime_loading_refusals(model, files, tmp_path):
    engine = Engine(model, ByteTokenizer(), EngineConfig(**{**RUNTIME, "max_lora_rank": 2}))
    with pytest.raises(ValueError, match=r"rank 4 on wq, above --max-lora-rank=2"):
        engine.load_adapter("a", files["a"])
    with pytest.raises(ValueError, match="LoRA adapter file '.*missing.npz' does not exist"):
        engine.load_adapter("a", str(tmp_path / "missing.npz"))
    other = Llama(LlamaConfig.tiny(dim=32, n_heads=2, n_kv_heads=1, ffn_dim=48), rngs=nnx.Rngs(1))
    with pytest.raises(ValueError, match=r"adapter 'x' \(.*\) has wk A \(2, 32, 2\), B .* which do not fit the "
                                         r"model's wk weight \(2, 64, 32\)"):
        engine.load_adapter("x", str(random_adapter(other, tmp_path / "x.npz", 4, 2, ("wk",))))
    reseeded = random_adapter(Llama(LlamaConfig.tiny(), rngs=nnx.Rngs(5)), tmp_path / "seed5.npz", 4, 2, ("wk",))
    for load in (lambda: engine.load_adapter("x", str(reseeded)), lambda: stack_adapters(model, {"x": reseeded})):
        with pytest.raises(ValueError, match=r"seed5.npz' was trained on another base model: its wk weights do not "
                                             r"match this model's"):
            load()
    bad = dict(np.load(files["c"]))
    for key, value, message in (("wk.lora_a", np.nan, "NaN or infinite values; accepted: finite weights"),
                                ("w_gate.lora_b", np.inf, "NaN or infinite values"),
                                ("wk.lora_b", 1j, r"complex\d+ values; accepted: real floating-point arrays")):
        broken = {**bad, key: bad[key] + 0 * value}  # complex for 1j
        broken[key].flat[0] = value
        np.savez(tmp_path / "bad.npz", **broken)
        with pytest.raises(ValueError, match=rf"adapter '.*bad.npz': {key} holds {message}"):
            engine.load_adapter("bad", str(tmp_path / "bad.npz"))
    # Finite in the file, but B x alpha/rank is inf in the slots: every other adapter's rows turned NaN.
    np.savez(tmp_path / "big.npz", **{**bad, "wk.lora_b": np.full_like(bad["wk.lora_b"], 3e38)})
    with pytest.raises(ValueError, match=r"adapter 'big' \(.*big.npz\): its wk B x alpha/rank is not finite in the "
                                         r"slots' float32; accepted: weights whose scaled values are finite there"):
        engine.load_adapter("big", str(tmp_path / "big.npz"))
    for name in ("", None, 3, " c"):
        with pytest.raises(ValueError, match=f"LoRA adapter name {name!r}; accepted: a non-empty string"):
            engine.load_adapter(name, files["c"])
    engine.load_adapter("c", files["c"])
    with pytest.raises(ValueError, match="LoRA adapter 'c' is already loaded; accepted: a new name, or unload it"):
        engine.load_adapter("c", files["c"])
    with pytest.raises(LookupError, match="LoRA adapter 'a' is not loaded; loaded: c"):
        engine.unload_adapter("a")
    assert list(engine.adapters) == ["c"] and engine.runner.adapter_slots.names == ["c"]

    fixed = Engine(model, ByteTokenizer(), EngineConfig(num_blocks=40, **SMALL), lora_modules={"a": files["a"]})
    for call in (lambda: fixed.load_adapter("c", files["c"]), lambda: fixed.unload_adapter("a")):
        with pytest.raises(ValueError, match="loading and unloading LoRA adapters while serving is off; accepted: "
                                             r"an engine started with allow_runtime_lora=True"):
            call()
    # Without runtime loading the slots hold only what the startup adapters target, at their rank.
    assert "wk" not in fixed.runner.state["layers"] or not hasattr(
        fixed.runner.state["layers"]["wk"]["kernel"][...], "lora_a")


def test_http_routes_load_and_unload(model, files, want):
    """vLLM's /v1/load_lora_adapter and /v1/unload_lora_adapter: the adapter is listed and served once
    loaded, gone once unloaded; every refusal is an OpenAI-shaped error naming the field."""
    engine = Engine(model, ByteTokenizer(), EngineConfig(**RUNTIME))
    with TestClient(create_app(engine, "m")) as client:
        r = client.post("/v1/load_lora_adapter", json={"lora_name": "sql", "lora_path": files["b"]})
        assert r.status_code == 200 and r.text == "Success: LoRA adapter 'sql' added successfully."
        assert [m["id"] for m in client.get("/v1/models").json()["data"]] == ["m", "sql"]
        r = client.post("/v1/completions", json={"model": "sql", "prompt": PROMPTS[2], "max_tokens": 6,
                                                 "temperature": 0, "ignore_eos": True})
        assert r.status_code == 200
        assert r.json()["choices"][0]["text"] == ByteTokenizer().decode(want(files["b"])[2])

        def error(path, body, status):
            r = client.post(path, json=body)
            assert r.status_code == status, r.text
            return r.json()["error"]

        e = error("/v1/load_lora_adapter", {"lora_name": "sql", "lora_path": files["a"]}, 400)
        assert e["param"] == "lora_name" and e["message"] == ("LoRA adapter 'sql' is already loaded; accepted: a new "
                                                              "name, or unload it first")
        e = error("/v1/load_lora_adapter", {"lora_name": "m", "lora_path": files["a"]}, 400)
        assert e["message"] == "lora_name 'm' is the base model's name; accepted: a new name"
        e = error("/v1/load_lora_adapter", {"lora_name": "x", "lora_path": "/nonexistent.npz"}, 400)
        assert e["param"] == "lora_path" and "'/nonexistent.npz' does not exist" in e["message"]
        e = error("/v1/load_lora_adapter", {"lora_name": "x"}, 400)
        assert e["param"] == "lora_path"
        e = error("/v1/load_lora_adapter", {"lora_name": " ", "lora_path": files["a"]}, 400)
        assert e["param"] == "lora_name" and e["message"] == (
            "LoRA adapter name ' '; accepted: a non-empty string without surrounding spaces")
        e = error("/v1/unload_lora_adapter", {"lora_name": "x"}, 404)
        assert e["code"] == "model_not_found" and e["message"] == "LoRA adapter 'x' is not loaded; loaded: sql"
        r = client.post("/v1/unload_lora_adapter", json={"lora_name": "sql"})
        assert r.status_code == 200 and r.text == "Success: LoRA adapter 'sql' removed successfully."
        e = error("/v1/completions", {"model": "sql", "prompt": "x", "max_tokens": 1}, 404)
        assert e["code"] == "model_not_found"
        assert [m["id"] for m in client.get("/v1/models").json()["data"]] == ["m"]
        assert engine.kv.pool.num_used == 0

    fixed = Engine(model, ByteTokenizer(), EngineConfig(num_blocks=40, **SMALL))
    with TestClient(create_app(fixed, "m")) as client:
        for body in ({"lora_name": "sql", "lora_path": files["b"]}, {}):  # whatever the body
            r = client.post("/v1/load_lora_adapter", json=body)
            assert r.status_code == 404 and r.json()["error"]["message"] == (
                "/v1/load_lora_adapter is off on this server; accepted: a server started with --allow-runtime-lora")


def test_runtime_loading_under_tensor_parallelism(model, files, want):
    """Adapters loaded into a tensor-parallel engine (tp=2) are split like the slots and give the merged
    models' tokens, taking turns in its one slot (written into the split leaves, which keep their layout)."""
    engine = Engine(model, ByteTokenizer(), EngineConfig(**RUNTIME, tensor_parallel_size=2))
    engine.load_adapter("a", files["a"])
    engine.load_adapter("b", files["b"])
    shardings = [x.sharding for x in jax.tree.leaves(engine.runner.state)]
    names = ["a", None, "b", "a", "b"]
    for i, o in enumerate(engine.generate(PROMPTS, greedy(), adapters=names)):
        assert o.token_ids == want(None if names[i] is None else files[names[i]])[i], names[i]
    assert engine.runner.adapter_slots.num_loads > 0
    assert [x.sharding for x in jax.tree.leaves(engine.runner.state)] == shardings
    w_up = engine.runner.state["layers"]["w_up"]["kernel"][...]
    assert w_up.lora_b.sharding.spec[-1] == "tensor"  # B of a column-parallel weight: split on its columns
