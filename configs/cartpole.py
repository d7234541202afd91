"""PPO on CartPole-v1 (gymnax) with ppojax's GAE and clipped losses, the whole run one compiled
``lax.scan``: PureJaxRL's hyper-parameters, 4 environments × 128 steps, 500k steps per agent,
4 agents trained at once (``jax.vmap``). Every agent we ran reached the maximum return 500; one
agent's whole run takes 7-20 s including compilation on a shared 2-core CPU (docs/classic.md).

    pip install 'ppojax[classic]'
    python -m ppojax.train --config configs/cartpole.py --workdir /tmp/cartpole \\
        [--config.num_seeds=16] [--config.classic.env=Acrobot-v1]
"""

import ml_collections


def get_config() -> ml_collections.ConfigDict:
  c = ml_collections.ConfigDict()
  c.seed = 0
  c.num_seeds = 4  # agents trained at once, one key each: random.split(key(seed), num_seeds)
  c.log_every = 61  # iterations per compiled chunk, metrics row per iteration (976 = 16 × 61)
  c.target_return = 475.0  # "solved": CartPole-v1's threshold (the maximum return is 500)
  c.wandb_project = ""

  c.classic = ml_collections.ConfigDict()  # ppojax.classic.ppo.Hyper, field for field
  c.classic.env = "CartPole-v1"
  c.classic.num_envs = 4
  c.classic.num_steps = 128
  c.classic.total_timesteps = 500_000
  c.classic.lr = 2.5e-4
  c.classic.anneal_lr = True
  c.classic.num_epochs = 4
  c.classic.num_minibatches = 4
  c.classic.gamma = 0.99
  c.classic.lam = 0.95
  c.classic.clip_eps = 0.2
  c.classic.value_clip = 0.2
  c.classic.ent_coef = 0.01
  c.classic.vf_coef = 0.5
  c.classic.max_grad_norm = 0.5
  c.classic.hidden = 64
  c.classic.depth = 2
  return c
