"""Default config: a tiny random-init transformer learns the *count* task (ppojax/tasks.py) by
PPO with a rule reward, on CPU in about a minute (score ~0.07 → ~0.6).

    python -m ppojax.train --config configs/toy.py --workdir /tmp/toy [--config.ppo.kl_coef=0.1]
"""

import ml_collections


def get_config() -> ml_collections.ConfigDict:
  c = ml_collections.ConfigDict()
  c.seed = 0
  c.num_iterations = 150
  c.log_every = 10
  c.sample_every = 50  # print a table of sample generations (0: never)
  c.num_samples = 4
  c.save_every = 50  # checkpoint every N iterations (and at the end), with --workdir
  c.keep = 2  # checkpoints kept
  c.phase_timing = False  # True: run sampling / scoring / update as three timed calls
  c.wandb_project = ""  # log to Weights & Biases too (needs `pip install wandb`)
  c.distributed = False  # jax.distributed.initialize() first (multi-host TPU / GPU)

  c.model = ml_collections.ConfigDict()
  c.model.policy = "tiny"  # "tiny", "smollm2", a GGUF file, a Hugging Face directory or hub id
  c.model.reward = ""  # reward model checkpoint, with reward.kind = "model"
  c.model.critic_init = "auto"  # "reward" (the RLHF recipe), "policy"; auto: reward if any
  c.model.dtype = "float32"  # compute dtype ("bfloat16" on accelerators)
  c.model.remat = False
  c.model.tiny = ml_collections.ConfigDict(dict(
      vocab_size=16, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
      num_kv_heads=2, max_position_embeddings=64))

  c.data = ml_collections.ConfigDict()
  c.data.task = "count"
  c.data.prompt_len = 6

  c.reward = ml_collections.ConfigDict()
  c.reward.kind = "jax"  # "jax" (traced into the step), "python" (host), "model"
  c.reward.fn = "ppojax.tasks:count_reward"  # for "python": ppojax.tasks:count_reward_numpy

  c.sampling = ml_collections.ConfigDict()
  c.sampling.max_new_tokens = 6
  c.sampling.temperature = 1.0
  c.sampling.top_k = 0
  c.sampling.top_p = 1.0
  c.sampling.min_new_tokens = 0  # stop tokens are banned before this many tokens
  c.sampling.stop_ids = [0]  # empty: the model's eos_token_id
  c.sampling.pad_id = 0  # == the stop id, as in many real tokenizers

  c.ppo = ml_collections.ConfigDict()
  c.ppo.batch_size = 128
  c.ppo.num_epochs = 2
  c.ppo.num_minibatches = 2
  c.ppo.grad_accum = 1  # micro-batches per minibatch (gradients summed exactly)
  c.ppo.gamma = 1.0
  c.ppo.lam = 0.95
  c.ppo.clip_eps = 0.2
  c.ppo.dual_clip = None
  c.ppo.value_clip = 0.2
  c.ppo.vf_coef = 0.1
  c.ppo.ent_coef = 0.0
  c.ppo.kl_coef = 0.01
  c.ppo.kl_estimator = "k1"
  c.ppo.adaptive_kl = False
  c.ppo.target_kl = 6.0
  c.ppo.kl_horizon = 10000.0
  c.ppo.score_clip = None
  c.ppo.missing_stop_penalty = 0.0
  c.ppo.whiten_rewards = False
  c.ppo.whiten_advantages = True
  c.ppo.aggregation = "token_mean"

  c.optim = ml_collections.ConfigDict()
  c.optim.max_grad_norm = 1.0
  c.optim.actor = ml_collections.ConfigDict(dict(
      lr=1e-2, warmup_steps=5, decay="cosine", end_factor=0.1, weight_decay=0.0))
  c.optim.critic = ml_collections.ConfigDict(dict(
      lr=1e-2, warmup_steps=5, decay="cosine", end_factor=0.1, weight_decay=0.0))

  c.mesh = ml_collections.ConfigDict()
  c.mesh.shape = (-1, 1, 1)  # (data, fsdp, tensor); -1: all remaining devices
  return c
