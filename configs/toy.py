"""Default config: PPO on the toy spelling task with a tabular policy (see ppojax/toy.py).

    python -m ppojax.train --config configs/toy.py [--config.ppo.kl_coef=0.1 ...]
"""

import ml_collections


def get_config() -> ml_collections.ConfigDict:
  c = ml_collections.ConfigDict()
  c.seed = 0
  c.num_iterations = 100
  c.log_every = 10

  c.task = ml_collections.ConfigDict()
  c.task.vocab_size = 8
  c.task.response_length = 8
  c.task.target = [3, 1, 4, 1, 5]  # then the stop token

  c.ppo = ml_collections.ConfigDict()
  c.ppo.stop_ids = [0]  # stop id == pad id, as in many real tokenizers
  c.ppo.pad_id = 0
  c.ppo.batch_size = 64
  c.ppo.num_epochs = 4
  c.ppo.num_minibatches = 4
  c.ppo.temperature = 1.0
  c.ppo.gamma = 1.0
  c.ppo.lam = 0.95
  c.ppo.clip_eps = 0.2
  c.ppo.value_clip = 0.2
  c.ppo.vf_coef = 0.5
  c.ppo.ent_coef = 0.0
  c.ppo.kl_coef = 0.02
  c.ppo.kl_estimator = "k1"
  c.ppo.adaptive_kl = False
  c.ppo.target_kl = 6.0
  c.ppo.kl_horizon = 10000.0
  c.ppo.missing_stop_penalty = 0.1
  c.ppo.whiten_advantages = True
  c.ppo.aggregation = "token_mean"

  c.optim = ml_collections.ConfigDict()
  c.optim.actor_lr = 0.05
  c.optim.critic_lr = 0.1
  c.optim.max_grad_norm = 1.0
  return c
