"""The actor-critic of classic control: two MLPs (policy logits, state value) on one observation.

PureJaxRL's CartPole network (and CleanRL's ``ppo.py``): ``depth`` tanh layers of ``hidden``
units each, orthogonal initialisation with gain √2, the policy head's gain 0.01 (near-uniform
initial policy) and the value head's 1, biases 0. Actor and critic share no parameters.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import linen as nn

Array = jax.Array


class MLP(nn.Module):
  """x → tanh(W_1 x + b_1) → … → W_out h + b_out, orthogonally initialised."""

  hidden: int
  depth: int
  out: int
  out_gain: float

  @nn.compact
  def __call__(self, x: Array) -> Array:
    for _ in range(self.depth):
      x = nn.tanh(nn.Dense(self.hidden, kernel_init=nn.initializers.orthogonal(np.sqrt(2.0)),
                           bias_init=nn.initializers.zeros)(x))
    return nn.Dense(self.out, kernel_init=nn.initializers.orthogonal(self.out_gain),
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
