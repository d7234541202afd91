"""The full set of run options with their defaults: every config file starts from ``defaults()``
and changes what its job needs (``configs/*.py``), so every option is documented once, here.

    from ppojax.config import defaults
    def get_config():
      c = defaults()
      c.model.policy = "smollm2"
      return c
"""

from __future__ import annotations

import ml_collections


def defaults() -> ml_collections.ConfigDict:
  c = ml_collections.ConfigDict()
  c.seed = 0
  c.num_iterations = 100
  c.log_every = 1
  c.sample_every = 10  # print a table of sample generations (0: never)
  c.num_samples = 4
  c.save_every = 50  # checkpoint every N iterations (and at the end), with --workdir
  c.keep = 2  # checkpoints kept
  c.phase_timing = False  # True: run sampling / scoring / update as three timed calls
  c.wandb_project = ""  # log to Weights & Biases too (needs `pip install wandb`)
  c.distributed = False  # jax.distributed.initialize() first (multi-host TPU / GPU)

  c.model = ml_collections.ConfigDict()
  c.model.policy = "smollm2"  # "tiny", "smollm2", a GGUF file, a Hugging Face directory or hub id
  c.model.tokenizer = ""  # replaces the policy's tokenizer (needed for "tiny" on a text task)
  c.model.reward = ""  # reward model checkpoint, with reward.kind = "model"
  c.model.critic_init = "auto"  # "reward" (the RLHF recipe), "policy"; auto: reward if any
  c.model.dtype = "float32"  # compute dtype ("bfloat16" on accelerators)
  c.model.remat = False
  c.model.tiny = ml_collections.ConfigDict(dict(  # model.policy = "tiny": a random-init model
      vocab_size=16, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
      num_kv_heads=2, max_position_embeddings=64))

  c.data = ml_collections.ConfigDict()
  c.data.task = "arith"  # "count" (toy tokens), "arith" (ppojax/arith.py), "file" (data.path)
  c.data.path = ""  # task "file": JSONL / JSON / datasets directory / parquet of prompts
  c.data.eval_path = ""  # task "file": held-out prompts (evaluated before and after training)
  c.data.field = "prompt"  # the prompt column (a string or a list of chat messages)
  c.data.prompt_len = 6  # task "count": tokens per prompt
  c.data.max_prompt_len = 128  # tokens; longer prompts are cut from the left and counted
  c.data.truncate = "left"  # or "error": a too-long prompt stops the run
  c.data.chat_template = True  # render prompts with the tokenizer's chat template
  c.data.system = ""  # a system message for every prompt ("" : the template's default)
  c.data.eval_per_digits = 64  # task "arith": held-out problems per digit count

  c.reward = ml_collections.ConfigDict()
  # "jax": a jnp rule (prompts, prompt_mask, responses, mask) -> [B], traced into the step;
  # "python": a host function of the rollout's NumPy arrays; "text": a trl-style function
  # fn(prompts, completions, **columns) -> list[float] of decoded text; "model": model.reward
  c.reward.kind = "text"
  c.reward.fn = "ppojax.arith:reward"

  c.eval = ml_collections.ConfigDict()  # greedy held-out evaluation (tasks with held-out data)
  c.eval.batch_size = 64
  c.eval.max_new_tokens = 0  # 0: sampling.max_new_tokens
  c.eval.group_by = ""  # a record column to report metrics per value of (e.g. "digits")
  c.eval.metrics = ml_collections.ConfigDict({"score": "ppojax.arith:reward"})  # name: fn
  c.eval.monitor = False  # also score every iteration's sampled responses ("monitor/NAME")

  c.sampling = ml_collections.ConfigDict()
  c.sampling.max_new_tokens = 64
  c.sampling.temperature = 1.0
  c.sampling.top_k = 0
  c.sampling.top_p = 1.0
  c.sampling.min_new_tokens = 0  # stop tokens are banned before this many tokens
  c.sampling.stop_ids = []  # empty: the model's eos_token_id
  c.sampling.pad_id = None  # None: the model's pad id (may equal the stop id)

  c.ppo = ml_collections.ConfigDict()
  c.ppo.batch_size = 64  # prompts (= responses) per iteration
  c.ppo.num_epochs = 1
  c.ppo.num_minibatches = 1
  c.ppo.grad_accum = 1  # micro-batches per minibatch (gradients summed exactly)
  c.ppo.gamma = 1.0
  c.ppo.lam = 0.95
  c.ppo.clip_eps = 0.2
  c.ppo.dual_clip = None
  c.ppo.value_clip = 0.2
  c.ppo.vf_coef = 0.1
  c.ppo.ent_coef = 0.0
  c.ppo.kl_coef = 0.05
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
      lr=3e-6, warmup_steps=0, decay="linear", end_factor=0.0, weight_decay=0.0))
  c.optim.critic = ml_collections.ConfigDict(dict(
      lr=3e-6, warmup_steps=0, decay="linear", end_factor=0.0, weight_decay=0.0))

  c.mesh = ml_collections.ConfigDict()
  c.mesh.shape = (-1, 1, 1)  # (data, fsdp, tensor); -1: all remaining devices
  return c
