"""GGUF reading: errors, rotary permutation, loading a written file."""

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


def test_not_gguf(tmp_path):
    p = tmp_path / "x.gguf"
    p.write_bytes(b"hello world, not a model")
    with pytest.raises(GGUFError, match="not a GGUF file"):
        read_gguf(p)


def test_missing(tmp_path):
    with pytest.raises(GGUFError, match="not found"):
        read_gguf(tmp_path / "absent.gguf")


def test_truncated(tmp_path):
    p = _write(tmp_path / "m.gguf", tensors=[("token_embd.weight", np.ones((64, 8), np.float32), None)])
    data = p.read_bytes()
    (tmp_path / "t.gguf").write_bytes(data[: len(data) - 100])
    with pytest.raises(GGUFError, match="truncated"):
        read_gguf(tmp_path / "t.gguf")


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
