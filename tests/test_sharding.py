"""Parameters placed by the models' partition rules on a simulated 8-device CPU mesh give the same
outputs as on one device. Runs in a subprocess: the device count is fixed at JAX start-up."""

import textwrap

import pytest

SCRIPT = textwrap.dedent("""
    import jax, jax.numpy as jnp, numpy as np
    from ppojax.infra import sharding
    from ppojax.models import (CausalLM, ModelConfig, ValueModel, partition_rules,
                               positions_from_mask)

    assert jax.device_count() == 8, jax.devices()
    for model_type in ("llama", "gpt2"):
      gpt2 = model_type == "gpt2"
      cfg = ModelConfig(model_type=model_type, vocab_size=64, hidden_size=32, intermediate_size=64,
                        num_layers=2, num_heads=4, num_kv_heads=4 if gpt2 else 2, head_dim=8,
                        max_position_embeddings=32, norm_eps=1e-5, tie_word_embeddings=gpt2,
                        qkv_bias=gpt2, out_bias=gpt2)
      tokens = jax.random.randint(jax.random.key(0), (8, 10), 0, 64)
      mask = jnp.arange(10)[None] >= jnp.arange(8)[:, None] % 4   # ragged left padding
      pos = positions_from_mask(mask)
      for module in (CausalLM(cfg), ValueModel(cfg)):
        params = module.init(jax.random.key(1), tokens, pos, mask)["params"]
        ref = module.apply({"params": params}, tokens, pos, mask)[0]
        for shape in ((8, 1, 1), (2, 2, 2), (1, 2, 4)):
          mesh = sharding.make_mesh(shape)
          shardings = sharding.param_shardings(params, mesh, partition_rules())
          placed = jax.device_put(params, shardings)
          batch = jax.device_put((tokens, pos, mask), sharding.batch_sharding(mesh))
          out = jax.jit(lambda p, b: module.apply({"params": p}, *b)[0])(placed, batch)
          err = float(jnp.max(jnp.abs(jnp.where(mask[..., None] if out.ndim == 3 else mask,
                                                 out - ref, 0))))
          assert err < 1e-5, (model_type, type(module).__name__, shape, err)
          if shape == (1, 2, 4):
            q = placed["model"]["layers"]["attn"]["q"]["kernel"]
            assert q.sharding.spec == jax.sharding.PartitionSpec(None, "fsdp", "tensor"), q.sharding
    print("OK")
""")


def test_sharded_forward_matches_single_device(run_on_8_cpu_devices):
  run_on_8_cpu_devices(SCRIPT)


def test_mesh_shape_errors():
  import jax  # pylint: disable=import-outside-toplevel

  from ppojax.infra import sharding  # pylint: disable=import-outside-toplevel
  n = jax.device_count()
  with pytest.raises(ValueError, match="needs"):
    sharding.make_mesh((n + 1, 1, 1))
  with pytest.raises(ValueError, match="at most one"):
    sharding.make_mesh((-1, -1, 1))


VOCAB_SCRIPT = textwrap.dedent("""
    import re
    import jax, jax.numpy as jnp, numpy as np
    from jax.sharding import NamedSharding, PartitionSpec as P
    from ppojax.infra import sharding

    V, D, B, T = 256, 32, 8, 6
    table = jax.random.normal(jax.random.key(0), (V, D))
    tokens = jax.random.randint(jax.random.key(1), (B, T), 0, V)
    x = jax.random.normal(jax.random.key(2), (B, T, D))
    dot = lambda x, e: jnp.einsum("btd,vd->btv", x, e)

    def loss(table, tokens, x):
      e = jnp.take(table, tokens, axis=0)
      logits = sharding.shard_rows(sharding.vocab_parallel_logits(x + e, table, dot))
      return jnp.sum(jax.nn.log_softmax(logits) * jnp.cos(logits))

    want = jax.jit(jax.value_and_grad(loss))(table, tokens, x)
    for shape in ((8, 1, 1), (1, 8, 1), (2, 2, 2), (1, 2, 4)):
      mesh = sharding.make_mesh(shape)
      rows = sharding.batch_sharding(mesh)
      table_sharding = NamedSharding(mesh, P("tensor", "fsdp"))  # the embedding's partition rule
      placed = jax.device_put((table, tokens, x), (table_sharding, rows, rows))
      with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
        fn = jax.jit(jax.value_and_grad(loss), out_shardings=(None, placed[0].sharding))
        got = fn(*placed)
        hlo = fn.lower(*placed).compile().as_text()
      np.testing.assert_allclose(got[0], want[0], rtol=1e-5)
      np.testing.assert_allclose(got[1], want[1], rtol=1e-5, atol=1e-6 * np.abs(want[1]).max())
      if shape[1] * shape[2] > 1:  # vocabulary-parallel: no product forms a whole [V, D]
        whole = [l for l in hlo.splitlines()
                 if re.search(rf"= [a-z0-9]+\\[{V},{D}\\].* (dot|convolution)\\(", l)]
        assert not whole, (shape, whole[:3])
    print("OK")
""")


def test_vocab_parallel_logits_match_and_never_form_the_whole_table_gradient(
    run_on_8_cpu_devices):
  """``sharding.vocab_parallel_logits`` (tied embeddings) under meshes with several "tensor" ×
  "fsdp" devices gives the plain computation's values and table gradient, and no product in the
  compiled program forms a whole [V, D] (the head's table or its gradient)."""
  run_on_8_cpu_devices(VOCAB_SCRIPT)
