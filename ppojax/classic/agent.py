"""The actor-critic of classic control: two MLPs (policy logits, state value) on one observation.

PureJaxRL's CartPole network (and CleanRL's ``ppo.py``): ``depth`` tanh layers of ``hidden``
units each, orthogonal initialisation with gain √2, the policy head's gain 0.01 (near-uniform
initial policy) and the value head's 1, biases 0. Actor and critic share no parameters.

The orthogonal matrices come from ``orthogonal`` below, flax's initializer with its QR kept
unbatched under ``jax.vmap`` (issue 28: a batched QR can deadlock XLA:CPU's thread pool).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import linen as nn

Array = jax.Array


def orthogonal(scale: float):
  """``nn.initializers.orthogonal(scale)`` whose QR factorisations run one matrix at a time
  under ``jax.vmap``: same values, bit for bit.

  Why (issue 28): vmapped, flax's initializer is one batched ``lapack_sgeqrf_ffi`` call per
  layer. On XLA:CPU (jaxlib 0.10.2) a batched LAPACK call with enough work splits the batch
  into tasks on the intra-op thread pool and blocks its own pool thread until they finish
  (jaxlib's ``ParallelBatchMap``). The network's initialisation holds six independent QRs;
  when as many of them as the pool has threads (two on a 2-core machine) run at once, every
  pool thread waits for tasks queued behind the others and the call never returns (``gdb``:
  each ``tf_XLAEigen`` thread in ``lapack_sgeqrf_ffi`` → ``ParallelBatchMap`` →
  ``BlockingCounter::Wait``). A batch of one matrix runs inline, which is why one seed without
  ``vmap`` never hung. Here the vmap rule maps the unbatched initializer over the batch
  (``lax.map``): each QR has a batch of one.
  """
  base = nn.initializers.orthogonal(scale)

  def init(key: Array, shape, dtype=jnp.float32) -> Array:
    draw = jax.custom_batching.custom_vmap(lambda k: base(k, shape, dtype))

    @draw.def_vmap
    def _one_matrix_at_a_time(axis_size, in_batched, keys):
      del axis_size
      if not in_batched[0]:
        return draw(keys), False
      return jax.lax.map(draw, keys), True

    return draw(key)

  return init


class MLP(nn.Module):
  """x → tanh(W_1 x + b_1) → … → W_out h + b_out, orthogonally initialised."""

  hidden: int
  depth: int
  out: int
  out_gain: float

  @nn.compact
  def __call__(self, x: Array) -> Array:
    for _ in range(self.depth):
      x = nn.tanh(nn.Dense(self.hidden, kernel_init=orthogonal(np.sqrt(2.0)),
                           bias_init=nn.initializers.zeros)(x))
    return nn.Dense(self.out, kernel_init=orthogonal(self.out_gain),
                    bias_init=nn.initializers.zeros)(x)


class ActorCritic(nn.Module):
  """obs [..., D] → (logits [..., A] float32, value [...] float32)."""

  num_actions: int
  hidden: int = 64
  depth: int = 2

  @nn.compact
  def __call__(self, obs: Array) -> tuple[Array, Array]:
    obs = obs.astype(jnp.float32)
    logits = MLP(self.hidden, self.depth, self.num_actions, 0.01, name="actor")(obs)
    value = MLP(self.hidden, self.depth, 1, 1.0, name="critic")(obs)
    return logits, value[..., 0]
