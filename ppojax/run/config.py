"""The full set of run options with their defaults: every config file starts from ``defaults()``
and changes what its job needs (``configs/*.py``), so every option is documented once, here.

    from ppojax.run.config import defaults
    def get_config():
      c = defaults()
      c.model.policy = "smollm2"
      return c

``supervised_defaults()`` holds the supervised stages' options; the checks of a config
(``validate``, ``ConfigError``, ...) are ``ppojax.run.checks``.
"""

from __future__ import annotations

import ml_collections
from ml_collections import config_dict



def defaults() -> ml_collections.ConfigDict:
  c = ml_collections.ConfigDict()
  c.seed = 0
  # ppo, grpo, dr_grpo, rloo, reinforce_pp, gspo or cispo (core/algorithms.py): the defaults
  # of rl.estimator, kl_in, aggregation, kl_estimator and loss_mode (each left "" below)
  c.algorithm = "ppo"
  c.num_iterations = 100
  c.log_every = 1
  c.sample_every = 10  # print a table of sample generations (0: never)
  c.sample_table_rows = 4  # rows in each sample table
  c.save_every = 50  # checkpoint every N iterations (and at the end), with --workdir
  c.keep = 2  # checkpoints kept (with 2 or more, a corrupt latest one falls back to the one before)
  # a rerun resumes only its own run (docs/explanation/runs.md); changes accepted deliberately,
  # comma-separated fields or sections: "seed,rl.batch_size"
  c.resume_allow_changes = ""
  c.phase_timing = False  # True: run sampling / scoring / update as three timed calls
  c.wandb_project = ""  # log to Weights & Biases too (needs `pip install 'ppojax[wandb]'`)
  c.distributed = False  # jax.distributed.initialize() first (multi-host TPU / GPU / CPU)
  # where the cluster is not auto-detected (SLURM, Open MPI, TPU and k8s are): the coordinator
  # "host:port", the number of processes and this one's index (""/0/-1: auto-detect)
  c.coordinator_address = ""
  c.num_processes = 0
  c.process_id = -1

  c.model = ml_collections.ConfigDict()
  c.model.policy = "smollm2"  # "tiny", "smollm2", a GGUF file, a Hugging Face directory or hub id
  c.model.tokenizer = ""  # replaces the policy's tokenizer (needed for "tiny" on a text task)
  c.model.reward = ""  # reward model checkpoint, with reward.kind = "model"
  c.model.critic_init = "auto"  # "reward" (the RLHF recipe), "policy"; auto: reward if any
  c.model.dtype = "float32"  # compute dtype ("bfloat16" on accelerators)
  c.model.remat = False
  # with remat: what each layer keeps for the backward pass ("nothing": recompute all of it;
  # "dots": keep matmul outputs; "dots_no_batch": keep weight-matmul outputs only)
  c.model.remat_policy = "nothing"
  # the reference and the reward model (never trained) stored in this dtype ("": as the
  # trained models; "bfloat16": half their memory; docs/scale.md)
  c.model.frozen_dtype = ""
  # layers as one nn.scan (one compiled layer body, faster compile) or unrolled (False: no
  # stacked per-layer weights and activations to slice and update; longer compile)
  c.model.scan_layers = True
  # attention in prefills and full-sequence passes: "auto" (cuDNN's fused kernel on NVIDIA GPUs
  # in bf16/fp16, else "einsum"), "einsum", "xla" (jax.nn.dot_product_attention) or "cudnn"
  c.model.attention = "auto"
  # a decode step's attention: "auto" (a fused Pallas kernel over the live slots on one NVIDIA
  # GPU in bf16/fp16, else "einsum"), "einsum" or "pallas" (off a GPU: Pallas's interpreter)
  c.model.decode_attention = "auto"
  c.model.tiny = ml_collections.ConfigDict(dict(  # model.policy = "tiny": a random-init model
      vocab_size=16, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
      num_kv_heads=2, max_position_embeddings=64))

  # LoRA: a frozen base plus trained low-rank adapters, the base also the reference
  # (docs/lora.md)
  c.lora = ml_collections.ConfigDict()
  c.lora.rank = 0  # r (0: full fine-tuning)
  c.lora.alpha = 16.0  # the adapters' output is scaled by alpha / rank
  # dropout p on the adapters' input in the update only, y = x·W + (α/r)·(dropout_p(x)·A)·B
  # (peft's lora_dropout); p > 0 turns rl.reuse_update_forward off
  c.lora.dropout = 0.0
  c.lora.targets = "all-linear"  # layers: q,k,v,o,gate,up,down (or peft's q_proj, ...)
  c.lora.base_dtype = ""  # the frozen base's dtype ("bfloat16": half its memory; "": float32)
  # the critic as its own adapters + value head on the policy's frozen base: one copy of the
  # base weights in the whole run
  c.lora.critic = False

  c.data = ml_collections.ConfigDict()
  # "count" (toy tokens), "arith" (ppojax/tasks/arith.py), "file" (data.path), "reasoning_gym"
  # (a reasoning-gym generator, data.rg: ppojax/tasks/reasoning.py; pip install -e ".[reasoning]")
  c.data.task = "arith"
  c.data.path = ""  # task "file": JSONL / JSON / datasets directory / parquet of prompts
  c.data.eval_path = ""  # task "file": held-out prompts (evaluated before and after training)
  c.data.field = "prompt"  # the prompt column (a string or a list of chat messages)
  c.data.prompt_len = 6  # task "count": tokens per prompt
  c.data.max_prompt_len = 128  # tokens; longer prompts are cut from the left and counted
  # a batch pads to the next multiple of this ≥ its longest prompt (at most max_prompt_len): one
  # compiled step per bucket; 0: always max_prompt_len
  c.data.prompt_bucket = 64
  c.data.truncate = "left"  # or "error": a too-long prompt stops the run
  c.data.chat_template = True  # render prompts with the tokenizer's chat template
  # each string prompt as str.format(prompt=...): a base model's raw-text frame, e.g.
  # "Question: {prompt}\nAnswer:" (configs/quickstart_gemma3.py); "{prompt}": as it is
  c.data.prompt_format = "{prompt}"
  # a system message for every prompt ("" : the template's default); a template without a system
  # role (Gemma's) gets it in the first user message, as Gemma 3's: "SYSTEM\n\nUSER"
  c.data.system = ""
  # the chat template's own variables (trl's and verl's chat_template_kwargs), e.g. Qwen3's
  # {"enable_thinking": False}: answer without a <think> block (docs/from-trl.md, configs/qwen3_*)
  c.data.chat_template_kwargs = ml_collections.ConfigDict()
  # the tokens every prompt begins with (the chat template's header) run once per batch, not
  # once per row: the same numbers, fewer FLOPs (docs/explanation/step.md)
  c.data.shared_prefix = True
  c.data.eval_per_digits = 64  # task "arith": held-out problems per digit count
  c.data.eval_size = 128  # task "calc": held-out problems
  # task "reasoning_gym": reasoning_gym.create_dataset(dataset, seed=..., size=..., **options);
  # held out: the dataset of eval_seed and eval_size, skipped in training (tasks/reasoning.py)
  c.data.rg = ml_collections.ConfigDict()
  c.data.rg.dataset = ""  # e.g. "chain_sum", "basic_arithmetic", "gsm_symbolic"
  c.data.rg.options = ml_collections.ConfigDict()  # the dataset's config fields
  c.data.rg.eval_seed = 10_000
  c.data.rg.eval_size = 128  # generated held-out questions (0: no held-out evaluation)
  # the answer in a completion: its last <answer> tag, else its "last_line" (any answer type)
  # or its "last_number" (numeric answers); scored by the dataset's own score_answer
  c.data.rg.extract = "last_line"

  c.reward = ml_collections.ConfigDict()
  # "jax": a jnp rule (prompts, prompt_mask, responses, mask) -> [B], traced; "python": NumPy
  # arrays; "text": trl-style fn(prompts, completions, **columns); "model"; "env": env.name's
  c.reward.kind = "text"
  c.reward.fn = "ppojax.tasks.arith:reward"

  c.env = ml_collections.ConfigDict()  # multi-turn rollouts (docs/multiturn.md)
  # "" (one turn), "count_turns", "guess_number" (traced into the step), "tools" (env.tools, on
  # the host) or "module:factory"
  c.env.name = ""
  c.env.max_turns = 4  # turns per episode, each up to sampling.max_new_tokens tokens
  c.env.obs_tokens = 16  # tokens per observation (the environment's answer to a turn)
  c.env.low = 1  # guess_number: the secret's range, low ... high
  c.env.high = 20
  c.env.reward_per_turn = 0.0  # guess_number: the reward lost per turn spent before the right one
  c.env.format_reward = 0.0  # guess_number: the reward of each guess that is a number in range
  c.env.tools = ""  # "tools": the functions offered, "module:fn,module:fn"
  c.env.tool_format = "qwen3"  # how calls are written (data/tool_formats.py: qwen3 = hermes)

  c.eval = ml_collections.ConfigDict()  # greedy held-out evaluation (tasks with held-out data)
  c.eval.batch_size = 64
  c.eval.max_new_tokens = 0  # 0: sampling.max_new_tokens
  c.eval.group_by = ""  # a record column to report metrics per value of (e.g. "digits")
  c.eval.metrics = ml_collections.ConfigDict({"score": "ppojax.tasks.arith:reward"})  # name: fn
  c.eval.monitor = False  # also score every iteration's sampled responses ("monitor/NAME")
  c.eval.every = 0  # also evaluate after every N-th iteration (0: only before and after)
  # the untrained policy also evaluated with each instruction appended to every held-out
  # prompt (docs/learning.md), e.g. {"instructed": "Reply with just the number."}
  c.eval.baselines = ml_collections.ConfigDict()

  c.sampling = ml_collections.ConfigDict()
  c.sampling.max_new_tokens = 64
  c.sampling.temperature = 1.0
  c.sampling.top_k = 0
  c.sampling.top_p = 1.0
  c.sampling.min_new_tokens = 0  # stop tokens are banned before this many tokens
  # responses sampled per prompt (a group, one prefill): rl.batch_size prompts give
  # batch_size × n responses per iteration; the group estimators (grpo, dr_grpo, rloo) need n >= 2
  c.sampling.num_samples_per_prompt = 1
  # the sampler's compute dtype ("": model.dtype), e.g. "bfloat16" sampling for a float32
  # learner: "rollout/logp_mismatch" reports the log-prob gap, rl.tis_cap corrects for it
  c.sampling.dtype = ""
  # the decode's layers: "scan" (one layer body: compiles fast), "unroll" (no per-token copy of
  # weights or cache), "auto" (scan for TPU, whose compiler copies neither; unroll elsewhere)
  c.sampling.decode_layers = "auto"
  # decode steps between checks of the stop condition (0: 8 on a GPU, whose loop checks on the
  # host, else 1); the samples are the same whatever it is
  c.sampling.stop_check_every = 0
  # tuples and placeholders so that --config.sampling.stop_ids="(2, 3)" etc. parse
  c.sampling.stop_ids = ()  # empty: the model's eos_token_id
  # None: the model's pad id (may equal the stop id)
  c.sampling.pad_id = config_dict.placeholder(int)

  c.rl = ml_collections.ConfigDict()
  c.rl.batch_size = 64  # prompts per iteration (× sampling.num_samples_per_prompt responses)
  # the advantage estimator (core/advantages.py): gae (with a critic), grpo, dr_grpo, rloo,
  # reinforce_pp; "" here and below: the algorithm's (core/algorithms.py)
  c.rl.estimator = ""
  c.rl.kl_in = ""  # the KL penalty β·KL as a reward ("reward", PPO) or a loss term ("loss", GRPO)
  c.rl.num_epochs = 1
  c.rl.num_minibatches = 1
  c.rl.grad_accum = 1  # micro-batches per minibatch (gradients summed exactly)
  # parts the rollout's forward passes run in, one after another: less memory, the same
  # numbers (0: num_minibatches × grad_accum, the update's micro-batches)
  c.rl.forward_micro_batches = 0
  # truncated importance sampling: each token's policy term weighted by
  # min(π_old/π_sampler, tis_cap), for a sampler in another dtype; None: off
  c.rl.tis_cap = config_dict.placeholder(float)
  c.rl.tis_level = "token"  # the ratio capped: each token's, or the response's product
  # rollout correction by rejection: "token", "sequence" or "geometric" (the product's |y|-th
  # root) ratios π_old/π_sampler outside [reject_low, reject_high] leave the loss ("": off)
  c.rl.reject = ""
  c.rl.reject_low = 0.5
  c.rl.reject_high = 2.0
  # DAPO's soft overlong punishment: the score penalised linearly over the last
  # overlong_buffer tokens before max_new_tokens, −overlong_factor at the limit (0: off)
  c.rl.overlong_buffer = 0
  c.rl.overlong_factor = 1.0
  c.rl.overlong_filter = False  # DAPO's overlong filtering: cut-off responses leave the loss
  # DAPO's dynamic sampling: sample round(batch_size × oversample) prompts' groups, learn from
  # batch_size of them, those whose scores differ first (core/selection.py)
  c.rl.dynamic_sampling = False
  c.rl.oversample = 1.0
  c.rl.gamma = 1.0
  c.rl.lam = 0.95
  c.rl.clip_eps = 0.2
  # asymmetric clip: the ratio is clipped to [1 − clip_eps_low, 1 + clip_eps_high] (None: clip_eps;
  # DAPO's clip-higher is 0.2 / 0.28; with loss_mode "cispo", clip_eps_low >= 1 is no floor)
  c.rl.clip_eps_low = config_dict.placeholder(float)
  c.rl.clip_eps_high = config_dict.placeholder(float)
  c.rl.dual_clip = config_dict.placeholder(float)
  c.rl.value_clip = 0.2
  c.rl.vf_coef = 0.1
  c.rl.ent_coef = 0.0
  c.rl.kl_coef = 0.05  # β; 0 (and no adaptive_kl): no KL, and no reference model is held
  c.rl.kl_estimator = ""  # k1 (kl), k2 (mse), k3, abs, clamp (ppojax/core/kl.py)
  c.rl.adaptive_kl = False
  c.rl.target_kl = 6.0
  c.rl.kl_horizon = 10000.0
  c.rl.score_clip = config_dict.placeholder(float)
  c.rl.missing_stop_penalty = 0.0
  c.rl.whiten_rewards = False
  c.rl.whiten_advantages = True
  # how token losses become one (ops.aggregate; docs/algorithms.md): "token_mean",
  # "seq_mean_token_mean" (= "seq_mean", GRPO) or "seq_mean_token_sum_norm" (Dr. GRPO)
  c.rl.aggregation = ""
  # the policy term (core/surrogates.py): "clip" (PPO's token ratio), "gspo" / "gspo_token"
  # (the sequence's ratio), "cispo" (a REINFORCE term weighted by the clipped ratio)
  c.rl.loss_mode = ""
  # log π_old from "recompute" (a forward pass after sampling) or "sampler" (generate()'s own,
  # as trl's; one forward pass fewer, equal up to the KV-cache decode's rounding)
  c.rl.old_logprobs = "recompute"
  # with 1 epoch × 1 minibatch × 1 micro-batch, the old log-probs and values from the update's
  # own forward pass (two forward passes fewer; docs/explanation/step.md); False: the rollout's
  c.rl.reuse_update_forward = True
  # padding-free update: a micro-batch's n sequences packed into the fewest ⌈f·n⌉ rows, f from
  # this ascending tuple, that hold them, else padded (docs/explanation/step.md); (): off
  c.rl.pack_fractions = ()
  # a non-finite iteration is skipped (skipped/nonfinite); after this many in a row the run
  # saves its last good state and stops (0: never stop)
  c.rl.max_bad_steps = 3

  c.optim = ml_collections.ConfigDict()
  c.optim.max_grad_norm = 1.0
  c.optim.state_dtype = "float32"  # Adam's moments ("bfloat16": 4 bytes per parameter, not 8)
  c.optim.actor = ml_collections.ConfigDict(dict(
      lr=3e-6, warmup_steps=0, decay="linear", end_factor=0.0, weight_decay=0.0))
  c.optim.critic = ml_collections.ConfigDict(dict(
      lr=3e-6, warmup_steps=0, decay="linear", end_factor=0.0, weight_decay=0.0))

  c.mesh = ml_collections.ConfigDict()
  c.mesh.shape = (-1, 1, 1)  # (data, fsdp, tensor); -1: all remaining devices
  return c


def supervised_defaults() -> ml_collections.ConfigDict:
  """The options of the supervised stages (``ppojax.supervised.sft``,
  ``ppojax.supervised.train_rm``) with defaults; ``configs/sft_arith.py`` and
  ``configs/rm_arith.py`` start from it."""
  c = ml_collections.ConfigDict()
  c.seed = 0  # model init (tiny), data generation and batch order
  c.wandb_project = ""  # log to Weights & Biases too (needs `pip install 'ppojax[wandb]'`)
  c.save_every = 50  # checkpoint every N steps (and at the end), with --workdir
  c.keep = 2  # checkpoints kept (with 2 or more, a corrupt latest one falls back to the one before)
  c.resume_allow_changes = ""  # as in defaults(): fields a resumed run may change deliberately

  c.model = ml_collections.ConfigDict()
  # "smollm2", a GGUF file, a Hugging Face directory or hub id, or "tiny"; a reward model
  # from a policy checkpoint gets a zero score head
  c.model.init = "smollm2"
  c.model.tokenizer = ""  # where the tokenizer comes from (HF dir, GGUF); needed with "tiny"
  c.model.dtype = "float32"  # compute dtype ("bfloat16" on accelerators)
  c.model.remat = False  # rematerialise layer activations in the backward pass
  c.model.scan_layers = True  # one nn.scan over the layers; False: unrolled (longer compile)
  c.model.tiny = ml_collections.ConfigDict(dict(  # vocab_size: the tokenizer's
      hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4, num_kv_heads=2,
      max_position_embeddings=128))

  c.data = ml_collections.ConfigDict()
  # "arith" (generated), a JSONL/JSON/parquet file or a datasets directory: "prompt" and
  # "response" (SFT) or "prompt", "chosen" and "rejected" (reward model)
  c.data.train = "arith"
  c.data.eval = "arith"  # held-out data, same kinds of source
  c.data.train_split = "train"  # the split of a DatasetDict directory (and of "arith")
  c.data.eval_split = "test"
  c.data.train_size = 256  # examples (pairs) generated for "arith"; for files the first N (0: all)
  c.data.eval_size = 128
  c.data.chat_template = True  # render prompts with the tokenizer's chat template
  c.data.system = ""  # system prompt ("": none, i.e. the template's default)
  # the chat template's variables, e.g. {"enable_thinking": False} (as in defaults())
  c.data.chat_template_kwargs = ml_collections.ConfigDict()
  c.data.max_prompt_len = 64  # tokens; padded length = the longest prompt, at most this
  c.data.max_response_len = 24  # tokens, the EOS included; longer responses are cut
  c.data.truncate = "left"  # too-long prompts: "left" keeps their end, "error" raises

  c.train = ml_collections.ConfigDict()
  c.train.num_epochs = 1.0  # optimizer steps = ceil(num_epochs * train rows / batch_size)
  c.train.batch_size = 16  # examples (pairs: 2 * batch_size sequences in one forward pass)
  c.train.grad_accum = 1  # micro-batches per step (weighted by their share of the loss: exact)
  c.train.aggregation = "token_mean"  # SFT: ops.AGGREGATIONS over response tokens
  c.train.eval_batch_size = 32
  c.train.eval_every = 0  # evaluate every N steps (0: only before and after; -1: each epoch)
  c.train.log_every = 1

  c.optim = ml_collections.ConfigDict()
  c.optim.lr = 2e-5
  c.optim.warmup_steps = 0
  c.optim.decay = "cosine"  # "constant", "linear" or "cosine"
  c.optim.end_factor = 0.1  # final lr = end_factor * lr
  c.optim.weight_decay = 0.0
  c.optim.max_grad_norm = 1.0
  c.optim.head_lr_factor = 1.0  # a reward model's score head: lr × factor (it starts at zero)
  return c
