"""The one table of activation names.

Model layers tag tensors with `jax.ad_checkpoint.checkpoint_name(x, NAME)`;
remat policies (`jmem.memory.remat`) select by these same names.
"""

ACTIVATIONS: dict[str, str] = {
    "layer_input": "residual stream entering a block [batch, seq, embed]",
    "attn_norm": "RMSNorm output before attention [batch, seq, embed]",
    "query": "query projection after RoPE [batch, seq, heads, head_dim]",
    "key": "key projection after RoPE [batch, seq, kv_heads, head_dim]",
    "value": "value projection [batch, seq, kv_heads, head_dim]",
    "attention": "attention context before the output projection [batch, seq, heads, head_dim]",
    "attn_out": "attention output projection [batch, seq, embed]",
    "mlp_norm": "RMSNorm output before the MLP [batch, seq, embed]",
    "mlp_gate": "MLP gate projection [batch, seq, mlp]",
    "mlp_up": "MLP up projection [batch, seq, mlp]",
    "mlp_hidden": "silu(gate) * up [batch, seq, mlp]",
    "mlp_out": "MLP down projection [batch, seq, embed]",
}
