"""``ppojax.infra.trees.free``: a tree's buffers deleted now, but none another tree shares."""

import jax
import jax.numpy as jnp
import numpy as np

from ppojax.infra import trees


def test_free_deletes_what_no_kept_array_shares_and_counts_its_bytes():
  shared = jnp.ones((4, 8), jnp.float32)
  tree = {"a": jnp.zeros(16, jnp.float32), "b": shared, "key": jax.random.key(0),
          "host": np.zeros(3), "none": None}
  kept = {"ref": shared, "copy": jnp.copy(tree["a"])}
  assert trees.free(tree, keep=kept) == 16 * 4
  assert tree["a"].is_deleted() and not shared.is_deleted() and not kept["copy"].is_deleted()
  assert not tree["key"].is_deleted()  # typed keys are left (their buffers are not exposed)
  assert trees.free(tree) == 4 * 8 * 4  # twice is fine: what is gone is skipped
  assert shared.is_deleted() and trees.free(tree) == 0


def test_free_on_a_sharded_array_deletes_every_shard():
  devices = jax.devices()
  mesh = jax.sharding.Mesh(np.array(devices), ("x",))
  x = jax.device_put(jnp.arange(8.0 * len(devices)),
                     jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("x")))
  assert trees.free([x]) == x.nbytes and x.is_deleted()
