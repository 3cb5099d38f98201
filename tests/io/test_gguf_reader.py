"""GGUF reading: errors, rotary permutation, loading a written file."""

import re

import numpy as np
import pytest

from jmem.io.gguf import GGUFError, config_from_gguf, permute_rotary, read_gguf, unpermute_rotary


def _write(path, arch="llama", tensors=None):
    import gguf

    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(1)
    w.add_embedding_length(8)
    w.add_feed_forward_length(16)
    w.add_head_count(2)
    w.add_context_length(32)
    for name, arr, raw_type in tensors or [("token_embd.weight", np.ones((4, 8), np.float32), None)]:
        w.add_tensor(name, arr, raw_dtype=raw_type)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_metadata_arrays_read_as_the_gguf_package_reads_them(tmp_path):
    """Arrays of strings, numbers and arrays of strings (read flat, as `ReaderField.contents()`): an array
    of arrays of strings read as the first byte of each string before."""
    import gguf

    w = gguf.GGUFWriter(str(tmp_path / "m.gguf"), "llama")
    w.add_array("t.strings", ["ab", "c"])
    w.add_array("t.numbers", [3, 1, 2])
    w.add_array("t.nested", [["ab", "c"], ["d"]])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    ours, theirs = read_gguf(tmp_path / "m.gguf").metadata, gguf.GGUFReader(str(tmp_path / "m.gguf")).fields
    for key, want in (("t.strings", ["ab", "c"]), ("t.numbers", [3, 1, 2]), ("t.nested", ["ab", "c", "d"])):
        assert ours[key] == theirs[key].contents() == want, key


def test_not_gguf(tmp_path):
    p = tmp_path / "x.gguf"
    p.write_bytes(b"hello world, not a model")
    with pytest.raises(GGUFError, match="not a GGUF file"):
        read_gguf(p)


def test_missing(tmp_path):
    with pytest.raises(GGUFError, match="not found"):
        read_gguf(tmp_path / "absent.gguf")


@pytest.mark.parametrize("version", [1, 99])
def test_unsupported_version_is_named(tmp_path, version):
    data = bytearray(_write(tmp_path / "m.gguf").read_bytes())
    data[4:8] = version.to_bytes(4, "little")
    (tmp_path / "v.gguf").write_bytes(bytes(data))
    with pytest.raises(GGUFError, match=f"GGUF version {version} is not supported; accepted: versions 2 and 3"):
        read_gguf(tmp_path / "v.gguf")


def test_version_2_reads_as_version_3(tmp_path):
    """v2 and v3 share the layout (v3 added big-endian files): a v2 header reads to the same file."""
    v3 = _write(tmp_path / "m.gguf")
    data = bytearray(v3.read_bytes())
    data[4:8] = (2).to_bytes(4, "little")
    (tmp_path / "v2.gguf").write_bytes(bytes(data))
    a, b = read_gguf(v3), read_gguf(tmp_path / "v2.gguf")
    assert (a.version, b.version) == (3, 2) and a.metadata == b.metadata and a.tensors.keys() == b.tensors.keys()
    for name in a.tensors:
        np.testing.assert_array_equal(a.tensors[name].data, b.tensors[name].data)


def test_directory_is_named(tmp_path):
    with pytest.raises(GGUFError, match="is a directory; accepted: a .gguf file"):
        read_gguf(tmp_path)


def test_big_endian_file_is_refused(tmp_path):
    """gguf can write big-endian files; jmem decodes blocks as little-endian, so it refuses them by name."""
    import gguf

    import jmem

    w = gguf.GGUFWriter(str(tmp_path / "be.gguf"), "llama", endianess=gguf.GGUFEndian.BIG)
    w.add_block_count(1)
    w.add_tensor("token_embd.weight", np.ones((4, 8), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    for read in (read_gguf, jmem.load):
        with pytest.raises(GGUFError, match="be.gguf is a big-endian GGUF file, which jmem does not read; "
                                            "accepted: little-endian GGUF files"):
            read(str(tmp_path / "be.gguf"))


def test_truncated(tmp_path):
    p = _write(tmp_path / "m.gguf", tensors=[("token_embd.weight", np.ones((64, 8), np.float32), None)])
    data = p.read_bytes()
    (tmp_path / "t.gguf").write_bytes(data[: len(data) - 100])
    with pytest.raises(GGUFError, match=f"t.gguf is truncated: tensor token_embd.weight ends at byte {len(data)} "
                                        f"but the file has {len(data) - 100} bytes"):
        read_gguf(tmp_path / "t.gguf")


@pytest.mark.parametrize("field, value, message", [
    ("type", 99, "tensor w has type id 99, which the installed gguf package (gguf "),
    ("offset", 4, "tensor w starts at offset 4, not a multiple of the file's alignment 32; the file is damaged"),
    ("offset", 4096, "is truncated: tensor w ends at byte "),
])
def test_damaged_tensor_info_is_named(tmp_path, field, value, message):
    """A tensor's type id, data offset or extent that the file cannot hold: one error naming the
    tensor (an unknown type read as 'truncated or damaged', a misaligned offset read the wrong bytes)."""
    data = bytearray(_write(tmp_path / "m.gguf", tensors=[("w", np.arange(64, dtype=np.float32).reshape(2, 32), None),
                                                          ("z", np.zeros(64, np.float32), None)]).read_bytes())
    info = data.index(b"\x01\x00\x00\x00\x00\x00\x00\x00w") + 9  # name "w", then n_dims u32, dims 2 x u64
    at = info + 4 + 16 + (0 if field == "type" else 4)  # then type u32, offset u64
    data[at:at + (4 if field == "type" else 8)] = value.to_bytes(4 if field == "type" else 8, "little")
    (tmp_path / "d.gguf").write_bytes(bytes(data))
    with pytest.raises(GGUFError, match=re.escape(message)):
        read_gguf(tmp_path / "d.gguf")


def test_unsupported_architecture(tmp_path):
    gf = read_gguf(_write(tmp_path / "m.gguf", arch="mamba"))
    with pytest.raises(GGUFError, match="architecture 'mamba' is not supported"):
        config_from_gguf(gf)


def test_unsupported_tensor_type(tmp_path):
    import gguf

    from jmem.io.gguf import dequantize_tensor

    raw = np.zeros((4, 8), np.int32)
    gf = read_gguf(_write(tmp_path / "m.gguf", tensors=[("token_embd.weight", raw, gguf.GGMLQuantizationType.I32)]))
    with pytest.raises(GGUFError, match="type I32, which jmem does not read"):
        dequantize_tensor(gf.tensors["token_embd.weight"])


def test_rotary_permutation_round_trip():
    w = np.random.default_rng(0).normal(size=(3 * 8, 5)).astype(np.float32)
    p = permute_rotary(w, 3)
    assert not np.array_equal(p, w)
    np.testing.assert_array_equal(unpermute_rotary(p, 3), w)
    # llama.cpp pairs (i, i + half) of each head as adjacent rows; unpermuting restores halves.
    head = p[:8]
    np.testing.assert_array_equal(head[0::2], w[:4])
    np.testing.assert_array_equal(head[1::2], w[4:8])


def test_missing_required_key_is_one_error(tmp_path):
    from jmem.io.gguf import GGUFFile

    gf = read_gguf(_write(tmp_path / "m.gguf"))  # no vocab_size and no tokenizer.ggml.tokens
    with pytest.raises(GGUFError, match=r"m.gguf: required key tokenizer.ggml.tokens is missing"):
        config_from_gguf(gf)
    meta = {**gf.metadata, "tokenizer.ggml.tokens": ["a"] * 4}
    del meta["llama.attention.head_count"]
    with pytest.raises(GGUFError, match="required key llama.attention.head_count is missing"):
        config_from_gguf(GGUFFile(gf.path, gf.version, meta, gf.tensors))


def test_packed_load_keeps_layers_whose_block_type_varies_packed(tmp_path, caplog):
    """packed=True on a file whose attn_v / ffn_down block types vary across layers (llama.cpp's *_K_M
    pattern): those matrices stay packed (`MixedGGMLWeight`), give the float load's logits, write
    back byte for byte and survive a quantized-directory round trip."""
    import gguf

    import jmem
    from jmem.io.ggml_mixed import MixedGGMLWeight
    from jmem.io.gguf_writer import byte_tokenizer_metadata, write_gguf
    from jmem.quant.ggml_weight import GGMLWeight
    from jmem.quant.saved import save_quantized
    from jmem.models.config import LlamaConfig
    from tests.helpers import logits_of, random_model

    cfg = LlamaConfig.tiny(n_layers=3)
    types = {"blk.0.ffn_down.weight": "Q8_0", "blk.1.attn_v.weight": "Q5_1", "blk.2.attn_v.weight": "Q8_0",
             "*": "Q4_0"}
    path = tmp_path / "mixed.gguf"
    write_gguf(path, cfg, random_model(cfg, 0), tokenizer_metadata=byte_tokenizer_metadata(), qtype_by_tensor=types)
    with caplog.at_level("WARNING", logger="jmem.io"):
        lm = jmem.load(str(path), packed=True)
    assert not [r for r in caplog.records if r.name == "jmem.io"]
    wv, w_down = (getattr(lm.model.layers, n).kernel.get_value() for n in ("wv", "w_down"))
    assert isinstance(wv, MixedGGMLWeight) and wv.layer_types() == ["Q4_0", "Q5_1", "Q8_0"]
    assert isinstance(w_down, MixedGGMLWeight) and w_down.layer_types() == ["Q8_0", "Q4_0", "Q4_0"]
    assert isinstance(lm.model.layers.wq.kernel.get_value(), GGMLWeight)
    assert isinstance(lm.model.head.kernel.get_value(), GGMLWeight)  # untied: the largest matrix of a big vocab
    assert wv.nbytes < 4 * 3 * cfg.dim * cfg.n_kv_heads * cfg.head_dim / 3  # far below float32
    ids = (np.arange(40, dtype=np.int32) % 259)[None]
    want = logits_of(jmem.load(str(path)).model, ids)
    np.testing.assert_allclose(logits_of(lm.model, ids), want, atol=1e-4)
    np.testing.assert_allclose(np.asarray(w_down.dequantize()),
                               np.asarray(jmem.load(str(path)).model.layers.w_down.kernel.get_value()), atol=1e-6)
    copy = tmp_path / "copy.gguf"
    write_gguf(copy, lm.config, lm.model, tokenizer_metadata=lm.source.tokenizer_metadata())
    src, dst = gguf.GGUFReader(str(path)), gguf.GGUFReader(str(copy))
    got = {t.name: (t.tensor_type, bytes(t.data)) for t in dst.tensors}
    blocks = [t for t in src.tensors if t.name.startswith("blk.") or t.name == "output.weight"]  # not the embedding
    assert len(blocks) == 28 and all(got[t.name] == (t.tensor_type, bytes(t.data)) for t in blocks)
    save_quantized(tmp_path / "dir", lm.model, tokenizer=lm.tokenizer, tokenizer_metadata=lm.source.tokenizer_metadata(),
                   quantization={"method": "gguf"})
    again = jmem.load(str(tmp_path / "dir"))
    assert isinstance(again.model.layers.wv.kernel.get_value(), MixedGGMLWeight)
    np.testing.assert_array_equal(logits_of(again.model, ids), logits_of(lm.model, ids))


def test_packed_load_warns_when_float_and_block_layers_mix(tmp_path, caplog):
    import jmem
    from jmem.io.gguf_writer import byte_tokenizer_metadata, write_gguf
    from jmem.models.config import LlamaConfig
    from tests.helpers import random_model

    cfg = LlamaConfig.tiny(n_layers=2)
    path = tmp_path / "m.gguf"
    write_gguf(path, cfg, random_model(cfg, 0), tokenizer_metadata=byte_tokenizer_metadata(),
               qtype_by_tensor={"blk.0.attn_v.weight": "F16", "*": "Q4_0"})
    with caplog.at_level("WARNING", logger="jmem.io"):
        lm = jmem.load(str(path), packed=True)
    lines = [r.getMessage() for r in caplog.records if r.name == "jmem.io"]
    assert lines == ["packed=True: layers.wv.kernel (attn_v) mixes float and block types across layers (F16,Q4_0); "
                     "held as float32: 16,384 bytes instead of 5,248 packed (+11,136)"]
    assert lm.model.layers.wv.kernel.get_value().dtype == np.float32


def test_mixed_weight_refuses_layers_and_types_that_do_not_pair():
    """One layer with two types was kept (zip cut the list; layer_types then named two layers), and
    layers of different row counts or none at all were numpy errors."""
    from jmem.io.ggml_mixed import MixedGGMLWeight
    from jmem.quant.ggml_weight import GGMLWeight

    w = np.random.default_rng(0).normal(size=(64, 16)).astype(np.float32)
    q8, q4 = (np.asarray(GGMLWeight.from_float(w, t).raw) for t in ("Q8_0", "Q4_0"))
    for raws, types, message in (([q8], ["Q8_0", "Q4_0"], "1 layers and 2 types"), ([], [], "0 layers and 0 types"),
                                 ([q8, q4[:8]], ["Q8_0", "Q4_0"], r"layers of \[16, 8\] rows; accepted: one output")):
        with pytest.raises(ValueError, match=rf"^MixedGGMLWeight.from_layers: {message}"):
            MixedGGMLWeight.from_layers(raws, types, in_features=64)
    assert MixedGGMLWeight.from_layers([q8, q4], ["Q8_0", "Q4_0"], in_features=64).layer_types() == ["Q8_0", "Q4_0"]
