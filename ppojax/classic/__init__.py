"""Classic-control PPO on ppojax's math core: a CartPole agent that calls the very GAE
(``advantages.gae_episodes``), clipped losses (``losses.ppo_loss``), log-probs and entropy
(``ops``) the language-model step calls; only the network and the environment differ.

    from ppojax.classic import ppo
    hp = ppo.Hyper(env="CartPole-v1")
    state, metrics = jax.jit(ppo.make_train(hp))(jax.random.key(0))            # one run
    states, metrics = jax.jit(jax.vmap(ppo.make_train(hp)))(jax.random.split(key, 16))  # 16 seeds

The environments are gymnax's (``pip install 'ppojax[classic]'``); the whole run (rollouts, GAE,
epochs of shuffled minibatches) is one compiled ``lax.scan``. The CLI:
``python -m ppojax.train --config configs/cartpole.py`` (``ppojax.classic.runner``).
"""

from ppojax.classic import agent, envs, ppo

__all__ = ["agent", "envs", "ppo"]
