"""`partition_specs`: every weight leaf splits its children along its float kernel's split, and the
split leaf decodes to the same weight."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from jmem.models.dot import partition_specs
from jmem.parallel import make_mesh

W = np.random.default_rng(0).normal(size=(2, 128, 64)).astype(np.float32)  # [layers, in, out]


def _leaf(fmt):
    from jmem.lora import LoRA
    from jmem.quant.awq import InputScaled
    from jmem.quant.fp8 import fp8_quantize
    from jmem.quant.ggml_weight import GGMLWeight
    from jmem.quant.nf4 import nf4_quantize
    from jmem.quant.qtensor import IntTensor

    return {"int4": lambda: IntTensor.quantize(W, bits=4, group_size=32, symmetric=False),
            "int8": lambda: IntTensor.quantize(W, bits=8, group_size=None),
            "nf4": lambda: nf4_quantize(W), "fp8": lambda: fp8_quantize(W),
            "awq": lambda: InputScaled(IntTensor.quantize(W, bits=4, group_size=32), jnp.full((2, 128), 0.5)),
            "Q4_0": lambda: GGMLWeight.from_float(W, "Q4_0"),
            "lora": lambda: LoRA(jnp.asarray(W), jnp.ones((2, 128, 4)), jnp.ones((2, 4, 64)), alpha=4.0)}[fmt]()


@pytest.mark.parametrize("fmt", ["int4", "int8", "nf4", "fp8", "awq", "Q4_0", "lora"])
@pytest.mark.parametrize("split", ["rows", "cols"])
def test_split_leaf_decodes_to_the_same_weight(fmt, split):
    mesh = make_mesh("tensor=2", jax.devices()[:2])
    leaf = _leaf(fmt)
    rows, cols = ("tensor", None) if split == "rows" else (None, "tensor")
    specs = partition_specs(leaf, (None,), rows, cols, row_pieces=2 if split == "rows" else 1)
    placed = jax.device_put(leaf, jax.tree.map(lambda s: NamedSharding(mesh, s), specs,
                                               is_leaf=lambda s: isinstance(s, P)))
    big = max(jax.tree.leaves(placed), key=lambda c: c.size)  # the codes (GGUF: raw [out, bytes])
    axis = {"rows": -2, "cols": -1}[split]
    if fmt == "Q4_0":
        axis = -1 - axis - 2  # raw stores W transposed: rows are its last axis
    assert {s.data.shape[axis] for s in big.addressable_shards} == {big.shape[axis] // 2}
    np.testing.assert_allclose(np.asarray(jax.jit(lambda w: w.dequantize(jnp.float32))(placed)),
                               np.asarray(leaf.dequantize(jnp.float32)), rtol=1e-6, atol=1e-6)
