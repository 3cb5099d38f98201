"""RoPE scaling read from GGUF: frequencies against per-frequency numpy formulas (Hugging Face's
definitions of linear / llama3 / yarn, llama.cpp's `rope_freqs.weight` divisors and partial rotary),
and GGUF files with those fields loading into the scaled config."""

import math

import jax.numpy as jnp
import numpy as np
import pytest

import jmem
from jmem.io.gguf import GGUFError, GGUFFile, GGUFTensor, config_from_gguf, permute_rotary, unpermute_rotary
from jmem.io.gguf_writer import byte_tokenizer_metadata, write_gguf
from jmem.models.config import LlamaConfig
from jmem.models.llama import rope
from tests.helpers import logits_of, random_model


def ref_inv_freq(dim, base, kind="none", factor=1.0, low=1.0, high=4.0, orig=8192, beta_fast=32.0, beta_slow=1.0):
    """(inverse frequencies of `dim` rotated dims, cos/sin factor), one frequency at a time."""
    out, attention = [], 1.0
    for j in range(dim // 2):
        f = 1.0 / base ** (2 * j / dim)
        if kind == "linear":
            f = f / factor
        elif kind == "llama3":
            wavelen = 2 * math.pi / f
            if wavelen > orig / low:
                f = f / factor
            elif wavelen >= orig / high:
                s = (orig / wavelen - low) / (high - low)
                f = (1 - s) * f / factor + s * f
        elif kind == "yarn":
            def correction_dim(rot):
                return dim * math.log(orig / (rot * 2 * math.pi)) / (2 * math.log(base))

            lo = max(math.floor(correction_dim(beta_fast)), 0)
            hi = min(math.ceil(correction_dim(beta_slow)), dim - 1)
            if lo == hi:
                hi += 0.001
            ramp = min(max((j - lo) / (hi - lo), 0.0), 1.0)
            extrapolation = 1.0 - ramp
            f = (f / factor) * (1 - extrapolation) + f * extrapolation
            attention = 0.1 * math.log(factor) + 1.0
        out.append(f)
    return np.array(out), attention


CASES = {
    "none": (dict(), dict()),
    "linear": (dict(rope_scaling="linear", rope_factor=8.0), dict(kind="linear", factor=8.0)),
    "llama3": (dict(rope_scaling="llama3", rope_factor=8.0, rope_low_freq_factor=1.0, rope_high_freq_factor=4.0,
                    rope_original_context=8192), dict(kind="llama3", factor=8.0, low=1.0, high=4.0, orig=8192)),
    "yarn": (dict(rope_scaling="yarn", rope_factor=4.0, rope_original_context=4096),
             dict(kind="yarn", factor=4.0, orig=4096)),
}


@pytest.mark.parametrize("case", list(CASES))
def test_rope_frequencies_match_reference(case):
    fields, ref = CASES[case]
    cfg = LlamaConfig.tiny(head_dim=128, rope_base=500000.0, **fields)
    got, scale = cfg.rope_frequencies()
    want, want_scale = ref_inv_freq(128, 500000.0, **ref)
    np.testing.assert_allclose(got, want, rtol=1e-6)
    assert scale == pytest.approx(want_scale)
    if case == "llama3":  # all three regions are exercised: kept, divided, blended
        plain = ref_inv_freq(128, 500000.0)[0]
        ratio = plain / want
        assert np.isclose(ratio, 1).any() and np.isclose(ratio, 8).any() and ((ratio > 1.01) & (ratio < 7.99)).any()
    if case == "yarn":
        plain = ref_inv_freq(128, 500000.0)[0]
        ratio = plain / want
        assert np.isclose(ratio, 1).any() and np.isclose(ratio, 4).any() and ((ratio > 1.01) & (ratio < 3.99)).any()


def test_freq_factors_and_partial_rotary_frequencies():
    factors = np.linspace(1.0, 8.0, 4)
    cfg = LlamaConfig.tiny(head_dim=16, rope_dim=8, rope_freq_factors=list(factors))
    got, scale = cfg.rope_frequencies()
    base = cfg.rope_base
    want = [1.0 / base ** (2 * j / 8) / factors[j] for j in range(4)] + [0.0] * 4  # llama.cpp: theta_j / ff_j
    np.testing.assert_allclose(got, want, rtol=1e-6)
    assert scale == 1.0 and isinstance(cfg.rope_freq_factors, tuple)
    hash(cfg)  # a list from JSON becomes a tuple: the config stays usable as static jit data


def test_rope_rotates_by_the_angles():
    """rope() against an explicit rotation of each (i, i + D/2) pair, with a partial width and a scale."""
    cfg = LlamaConfig.tiny(head_dim=16, rope_dim=12, rope_scaling="yarn", rope_factor=4.0, rope_original_context=64)
    inv, scale = cfg.rope_frequencies()
    rng = np.random.default_rng(0)
    x = rng.normal(size=(2, 5, 3, 16)).astype(np.float32)
    pos = rng.integers(0, 300, size=(2, 5)).astype(np.int32)
    got = np.asarray(rope(jnp.asarray(x), jnp.asarray(pos), inv, scale))
    want = x.copy()
    for b in range(2):
        for t in range(5):
            for i in range(6):  # rotated pairs; pairs 6, 7 stay as they are
                a = pos[b, t] * inv[i]
                c, s = math.cos(a) * scale, math.sin(a) * scale
                x1, x2 = x[b, t, :, i], x[b, t, :, i + 8]
                want[b, t, :, i], want[b, t, :, i + 8] = x1 * c - x2 * s, x2 * c + x1 * s
    np.testing.assert_allclose(got, want, atol=1e-5)


def test_partial_rotary_matches_llama_cpp_layout():
    """llama.cpp rotates adjacent pairs (2j, 2j+1) of the first rope_dim dims of its permuted rows;
    after the loader's unpermute that must be what jmem's rope does."""
    hd, rd, base = 16, 8, 10000.0
    rng = np.random.default_rng(1)
    ours = rng.normal(size=(hd,)).astype(np.float32)  # one head, our (half-split) order
    theirs = permute_rotary(ours[:, None], 1)[:, 0]  # llama.cpp's row order
    p = 37
    rotated = theirs.copy()
    for j in range(rd // 2):
        a = p * base ** (-2 * j / rd)
        x0, x1 = theirs[2 * j], theirs[2 * j + 1]
        rotated[2 * j], rotated[2 * j + 1] = x0 * math.cos(a) - x1 * math.sin(a), x0 * math.sin(a) + x1 * math.cos(a)
    want = unpermute_rotary(rotated[:, None], 1)[:, 0]  # back to our order
    inv, _ = LlamaConfig.tiny(head_dim=hd, rope_dim=rd, rope_base=base).rope_frequencies()
    got = np.asarray(rope(jnp.asarray(ours)[None, None, None], jnp.full((1, 1), p, jnp.int32), inv))[0, 0, 0]
    np.testing.assert_allclose(got, want, atol=1e-5)


def _file(**metadata):
    base = {"general.architecture": "llama", "llama.embedding_length": 64, "llama.attention.head_count": 4,
            "llama.block_count": 2, "llama.feed_forward_length": 128, "llama.vocab_size": 259}
    tensors = metadata.pop("tensors", {})
    return GGUFFile("m.gguf", 3, {**base, **metadata}, tensors)


def test_config_reads_rope_metadata():
    c = config_from_gguf(_file(**{"llama.rope.scaling.type": "linear", "llama.rope.scaling.factor": 8.0}))
    assert (c.rope_scaling, c.rope_factor) == ("linear", 8.0)
    c = config_from_gguf(_file(**{"llama.rope.scaling.type": "yarn", "llama.rope.scaling.factor": 4.0,
                                  "llama.rope.scaling.original_context_length": 4096,
                                  "llama.rope.scaling.yarn_beta_fast": 16.0, "llama.rope.scaling.finetuned": True}))
    assert (c.rope_scaling, c.rope_factor, c.rope_original_context, c.rope_beta_fast) == ("yarn", 4.0, 4096, 16.0)
    c = config_from_gguf(_file(**{"llama.rope.dimension_count": 8}))
    assert c.rope_dim == 8
    ff = np.array([1, 2, 4, 8, 8, 8, 8, 8], np.float32)
    c = config_from_gguf(_file(tensors={"rope_freqs.weight": GGUFTensor("rope_freqs.weight", "F32", (8,), ff)}))
    assert c.rope_freq_factors == tuple(ff.tolist()) and c.rope_scaling == "none"
    c = config_from_gguf(_file(**{"llama.rope.scaling.type": "none", "llama.rope.scaling.factor": 0.0}))
    assert c.rope_scaling == "none"


@pytest.mark.parametrize("metadata,tensors,match", [
    ({"llama.rope.scaling.type": "longrope", "llama.rope.scaling.factor": 4.0}, {},
     "llama.rope.scaling.type='longrope' is not supported; accepted: none, linear, yarn"),
    ({"llama.rope.scaling.attn_factor": 2.0}, {}, "llama.rope.scaling.attn_factor=2.0 is not supported"),
    ({"llama.rope.scaling.yarn_log_multiplier": 0.1}, {}, "llama.rope.scaling.yarn_log_multiplier=0.1 is not"),
    ({"llama.rope.dimension_count": 7}, {}, "llama.rope.dimension_count=7 is not supported"),
    ({"llama.rope.scaling.type": "linear", "llama.rope.scaling.factor": 0.5}, {},
     "llama.rope.scaling.factor=0.5 is not supported; accepted: >= 1"),
    ({}, {"rope_freqs.weight": GGUFTensor("rope_freqs.weight", "F32", (4,), np.ones(4, np.float32))},
     r"rope_freqs.weight has shape \[4\]; accepted: 8 positive"),
])
def test_unsupported_rope_metadata_is_refused(metadata, tensors, match):
    with pytest.raises(GGUFError, match=match):
        config_from_gguf(_file(tensors=tensors, **metadata))


@pytest.mark.parametrize("fields,read_back", [
    (dict(rope_scaling="linear", rope_factor=8.0), dict(rope_scaling="linear", rope_factor=8.0)),
    (dict(rope_scaling="llama3", rope_factor=8.0, rope_original_context=64), None),  # stored as rope_freqs.weight
    (dict(rope_scaling="yarn", rope_factor=4.0, rope_original_context=64),
     dict(rope_scaling="yarn", rope_factor=4.0, rope_original_context=64)),
    (dict(rope_dim=8), dict(rope_dim=8)),
])
def test_scaled_gguf_loads_into_scaled_config(tmp_path, fields, read_back):
    """A file with RoPE scaling loads into a config with the same frequencies; its logits equal the
    in-memory model with that config and differ from the unscaled model's."""
    # the fields the file does not store are set as the loader sets them: the models share one compile
    plain_cfg = LlamaConfig.tiny(norm_eps=float(np.float32(1e-5)), loss_chunk=1024)
    cfg = plain_cfg.replace(**fields)
    model = random_model(cfg, 0)
    path = tmp_path / "scaled.gguf"
    write_gguf(path, cfg, model, tokenizer_metadata=byte_tokenizer_metadata())
    lm = jmem.load(str(path))
    for k, v in (read_back or {}).items():
        assert getattr(lm.config, k) == v
    np.testing.assert_allclose(lm.config.rope_frequencies()[0], cfg.rope_frequencies()[0], rtol=1e-6)
    ids = (np.arange(100, dtype=np.int32) % 259)[None]
    got = logits_of(lm.model, ids)
    np.testing.assert_allclose(got, logits_of(model, ids), atol=1e-4)
    plain = random_model(plain_cfg, 0)  # same weights (same seed and shapes), unscaled RoPE
    assert np.abs(got - logits_of(plain, ids)).max() > 1e-2
