"""Reward model for the arithmetic task: SmolLM2-135M-Instruct plus a scalar head learns to
prefer correct answers over plausible wrong ones (same wording, only the number differs), from
pairs made by ``ppojax.arith.preference_pairs``. On a 2-core CPU: about 4 minutes (16 steps of
13 s), held-out pairwise accuracy 0.50 -> 0.62 (loss 0.693 -> 0.616); more epochs go further.

    python -m ppojax.train_rm --config configs/rm_arith.py --workdir runs/rm
    python -m ppojax.train_rm --config configs/rm_arith.py --workdir runs/rm \
        --config.model.init=runs/sft/policy --config.data.train=prefs.jsonl --config.data.eval=...

PPO then uses it with ``--config.reward.kind=model --config.model.reward=runs/rm/reward_model``.
"""

import ml_collections


def get_config() -> ml_collections.ConfigDict:
  c = ml_collections.ConfigDict()
  c.seed = 0  # model init (tiny), data generation and batch order
  c.wandb_project = ""  # log to Weights & Biases too (needs `pip install wandb`)

  c.model = ml_collections.ConfigDict()
  # "smollm2", a GGUF file, a Hugging Face directory or hub id (a policy checkpoint gets a zero
  # score head, a reward checkpoint keeps its head), or "tiny" (random init from model.tiny).
  c.model.init = "smollm2"
  c.model.tokenizer = ""  # where the tokenizer comes from (HF dir, GGUF); needed with "tiny"
  c.model.dtype = "float32"  # compute dtype ("bfloat16" on accelerators)
  c.model.remat = False  # rematerialise layer activations in the backward pass
  c.model.tiny = ml_collections.ConfigDict(dict(  # vocab_size: the tokenizer's
      hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4, num_kv_heads=2,
      max_position_embeddings=128))

  c.data = ml_collections.ConfigDict()
  # "arith" (generated pairs), a JSONL/JSON/parquet file or a datasets save_to_disk directory
  # with "prompt", "chosen" and "rejected" fields.
  c.data.train = "arith"
  c.data.eval = "arith"  # held-out pairs, same kinds of source
  c.data.train_split = "train"  # the split of a DatasetDict directory (and of "arith")
  c.data.eval_split = "test"
  c.data.train_size = 256  # pairs generated for "arith"; for files the first N (0: all)
  c.data.eval_size = 128
  c.data.chat_template = True  # render prompts with the tokenizer's chat template
  c.data.system = ""  # system prompt ("": none, i.e. the template's default)
  c.data.max_prompt_len = 64  # tokens; padded length = the longest prompt, at most this
  c.data.max_response_len = 24  # tokens, the EOS included; longer responses are cut
  c.data.truncate = "left"  # too-long prompts: "left" keeps their end, "error" raises

  c.train = ml_collections.ConfigDict()
  c.train.num_epochs = 1.0  # optimizer steps = ceil(num_epochs * train pairs / batch_size)
  c.train.batch_size = 16  # pairs per step (2 * batch_size sequences in one forward pass)
  c.train.grad_accum = 1  # micro-batches per step (gradients averaged)
  c.train.eval_batch_size = 32  # pairs per held-out batch
  c.train.eval_every = 0  # evaluate every N steps (0: only before and after training)
  c.train.log_every = 1

  c.optim = ml_collections.ConfigDict()
  c.optim.lr = 1e-4
  c.optim.head_lr_factor = 30.0  # the score head's lr = factor * lr (it starts at zero)
  c.optim.warmup_steps = 0
  c.optim.decay = "cosine"  # "constant", "linear" or "cosine"
  c.optim.end_factor = 0.1  # final lr = end_factor * lr
  c.optim.weight_decay = 0.0
  c.optim.max_grad_norm = 1.0
  return c
