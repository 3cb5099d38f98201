"""Odd inputs to the quantizers: one clear ValueError each, raised before any work; llama.cpp's k-quant fallback."""

import re

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jmem.models.llama import Llama, LlamaConfig
from jmem.quant import fp8_quantize, int8_quantize, nf4_quantize, quantize, rtn_quantize
from jmem.quant.api import resolve_group_size
from jmem.quant.ggml import dequantize as ggml_dequantize
from jmem.quant.ggml import fitting_qtype
from jmem.quant.ggml_quantize import quantize as ggml_quantize
from jmem.quant.ggml_weight import GGMLWeight, quantize_gguf_blocks

CFG = LlamaConfig.tiny()


@pytest.fixture(scope="module")
def model():
    return Llama(CFG, rngs=nnx.Rngs(0))


@pytest.mark.parametrize("fn", [rtn_quantize, int8_quantize, nf4_quantize, fp8_quantize])
@pytest.mark.parametrize("shape", [(), (64,), (0, 8), (64, 0), (2, 0, 64, 8)])
def test_leaf_quantizers_refuse_non_matrices(fn, shape):
    msg = f"weight shape {tuple(shape)} is not a weight matrix; accepted: an array with at least 2 axes"
    with pytest.raises(ValueError, match=re.escape(msg)):
        fn(np.ones(shape, np.float32))


def test_int8_takes_any_input_dimension():
    """8-bit codes are not bit-packed: a per-channel int8 of in=10 works and matches a per-column reference."""
    rng = np.random.default_rng(0)
    w = rng.normal(size=(10, 4)).astype(np.float32)
    q = int8_quantize(w)
    assert q.shape == (10, 4) and q.group_size == 10
    scale = np.abs(w).max(axis=0) / 127
    s16 = scale.astype(np.float16)  # the f16 at or above the scale: the grid spans every column
    scale = np.where(s16 < scale, np.nextafter(s16, np.float16(np.inf)), s16).astype(np.float32)
    ref = np.clip(np.round(w / scale), -127, 127) * scale
    np.testing.assert_allclose(np.asarray(q.dequantize()), ref, rtol=1e-6, atol=1e-7)
    # Packed widths still need whole words of 8 rows, and say so.
    with pytest.raises(ValueError, match="per-channel 4-bit codes need an input dimension that is a multiple of 8"):
        rtn_quantize(w, bits=4, group_size=None)


def test_group_size_suggestions_divide_the_dimension():
    w = np.ones((72, 4), np.float32)
    with pytest.raises(ValueError, match=r"group_size=32 does not divide the input dimension 72; accepted: a divisor "
                                         r"of 72 that is a multiple of 8 \(e.g. 8, 24, 72\)"):
        rtn_quantize(w, bits=4, group_size=32)
    with pytest.raises(ValueError, match=r"group_size=12 must be a multiple of 8 .*\(e.g. 8, 24, 72\)"):
        rtn_quantize(w, bits=4, group_size=12)
    assert rtn_quantize(w, bits=4, group_size=24).group_size == 24
    for bad in (0, -8, 8.0):
        with pytest.raises(ValueError, match=rf"group_size={bad} is not a positive integer; accepted: a divisor"):
            rtn_quantize(w, bits=4, group_size=bad)


@pytest.mark.parametrize("group_size", [12, 32, 36])
def test_no_packed_group_fits_advises_8_bits(group_size):
    """In=36 is no multiple of 8: no 4-bit group (nor per channel) fits, and the advice is 8 bits, not a list."""
    w = np.ones((36, 4), np.float32)
    with pytest.raises(ValueError, match=r"nor can any group size: 4-bit codes are packed 8 rows at a time and 36 is "
                                         r"not a multiple of 8; accepted: bits=8 for this matrix$"):
        rtn_quantize(w, bits=4, group_size=group_size)
    with pytest.raises(ValueError, match=r"accepted: bits=8 for this matrix$"):
        resolve_group_size(36, group_size, 4)  # what the model-level quantize uses: no substitute either
    assert rtn_quantize(w, bits=8, group_size=group_size if 36 % group_size == 0 else None).shape == (36, 4)


def test_quantizing_a_quantized_model_is_refused(model):
    q4 = quantize(model, "rtn", bits=4, group_size=32)
    with pytest.raises(ValueError, match=r"the model is already quantized \(wq: int4, group size 32\); accepted: "
                                         "the float model"):
        quantize(q4, "rtn", bits=4, group_size=32)
    nf4 = quantize(model, "nf4")
    with pytest.raises(ValueError, match=r"already quantized \(wq: nf4\)"):
        quantize(nf4, "int8")
    with pytest.raises(ValueError, match=r"already quantized \(wq: int4, group size 32\)"):
        quantize_gguf_blocks(q4, "Q8_0")


def test_quantizing_a_model_with_adapters_names_the_adapter(model):
    """Refused with its own reason (it said "already quantized (wq: LoRA)" of a float base)."""
    from jmem.lora import apply_lora

    with pytest.raises(ValueError, match=r"^wq carries a LoRA adapter; accepted: a model without adapters \(quantize "
                                         r"before apply_lora, or merge or remove_adapters first\)$"):
        quantize(apply_lora(model, targets=("wq",)), "nf4")


def test_calibration_ids_outside_the_vocabulary(model):
    with pytest.raises(ValueError, match=r"calibration token ids range over 100000..100000; accepted: ids of the "
                                         r"model's vocabulary, 0..258"):
        quantize(model, "gptq", bits=4, group_size=32, calibration=np.full((2, 16), 100000, np.int32))
    with pytest.raises(ValueError, match=r"range over -1..5"):
        quantize(model, "awq", bits=4, group_size=32, calibration=np.array([[-1, 5, 3, 2]], np.int32))
    with pytest.raises(ValueError, match=r"max_seqs=0; accepted: a positive integer"):
        quantize(model, "gptq", bits=4, group_size=32, calibration=np.ones((2, 16), np.int32), max_seqs=0)


def test_calibration_windows_fit_the_model(model):
    ctx = model.config.max_seq_len
    with pytest.raises(ValueError, match=rf"calibration windows of {ctx + 8} tokens exceed the model's context of "
                                         rf"{ctx}; accepted: seq_len \(or the T of \[B, T\] ids\) <= {ctx}"):
        quantize(model, "gptq", bits=4, group_size=32, calibration=np.ones((1, ctx + 8), np.int32))
    with pytest.raises(ValueError, match=r"calibration token ids of shape \(2, 2, 8\); accepted: an int array "
                                         r"\[B, T\] or a list of 1-D int arrays"):
        quantize(model, "awq", bits=4, group_size=32, calibration=np.ones((2, 2, 8), np.int32))


def test_fitting_qtype_follows_llama_cpp():
    assert [fitting_qtype(t, 576).name for t in ("Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K")] == \
        ["IQ4_NL", "IQ4_NL", "Q5_0", "Q5_1", "Q8_0"]
    assert fitting_qtype("Q4_K", 1536).name == "Q4_K" and fitting_qtype("Q4_0", 576).name == "Q4_0"
    assert fitting_qtype("Q6_K", 48).name == "F16"  # neither the super-block nor Q8_0's 32 divides 48


def test_gguf_blocks_fall_back_per_matrix():
    """Width 64 (q/k/v/o, gate/up inputs) takes Q4_K's fallback Q5_0; the MLP width 256 (down) keeps Q4_K."""
    m = Llama(LlamaConfig.tiny(ffn_dim=256), rngs=nnx.Rngs(1))
    lines = []
    qm, types = quantize_gguf_blocks(m, "q4_k", log=lines.append)
    assert types == {"wq": "Q5_0", "wk": "Q5_0", "wv": "Q5_0", "wo": "Q5_0", "w_gate": "Q5_0", "w_up": "Q5_0",
                     "w_down": "Q4_K"}
    assert lines == ["Q4_K: row length 64 is not a multiple of its block size 256; stored as Q5_0 (llama.cpp's "
                     "fallback): wq, wk, wv, wo, w_gate, w_up"]
    src, got = m.layers.weights(), qm.layers.weights()
    for name, t in types.items():
        leaf = got[name]
        assert isinstance(leaf, GGMLWeight) and leaf.qtype.name == t
        w_OI = np.swapaxes(np.asarray(src[name]), -1, -2)
        ref = np.swapaxes(np.asarray(ggml_dequantize(ggml_quantize(w_OI, t), t)), -1, -2)
        np.testing.assert_array_equal(np.asarray(leaf.dequantize()), ref)
    assert isinstance(src["wq"], jnp.ndarray)  # the source model is untouched
