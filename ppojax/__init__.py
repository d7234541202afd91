"""ppojax: PPO for language models as pure, jit-compiled JAX functions.

Research code can import single pieces::

    from ppojax import advantages, kl, losses, ops, rewards
"""

from ppojax import advantages, kl, losses, ops, rewards

__version__ = "0.1.0"

__all__ = ["advantages", "kl", "losses", "ops", "rewards", "__version__"]
