"""Supervised fine-tuning for the arithmetic task: SmolLM2-135M-Instruct learns concise correct
answers ("The answer is 68.", "23 + 45 = 68", ...) from ``ppojax.arith.sft_examples``, by the
negative log-likelihood of the response tokens. On a 2-core CPU: under 3 minutes (16 steps of
7 s), held-out response NLL 1.33 -> 0.44 per token, token accuracy 0.64 -> 0.84.

    python -m ppojax.sft --config configs/sft_arith.py --workdir runs/sft
    python -m ppojax.sft --config configs/sft_arith.py --workdir runs/sft \
        --config.data.train=train.jsonl --config.data.eval=eval.jsonl

The result, runs/sft/policy, starts reward-model training (``--config.model.init=...``) and
PPO (``--config.model.policy=...``).
"""

import ml_collections


def get_config() -> ml_collections.ConfigDict:
  c = ml_collections.ConfigDict()
  c.seed = 0  # model init (tiny), data generation and batch order
  c.wandb_project = ""  # log to Weights & Biases too (needs `pip install wandb`)

  c.model = ml_collections.ConfigDict()
  # "smollm2", a GGUF file, a Hugging Face directory or hub id, or "tiny" (random init from
  # model.tiny).
  c.model.init = "smollm2"
  c.model.tokenizer = ""  # where the tokenizer comes from (HF dir, GGUF); needed with "tiny"
  c.model.dtype = "float32"  # compute dtype ("bfloat16" on accelerators)
  c.model.remat = False  # rematerialise layer activations in the backward pass
  c.model.tiny = ml_collections.ConfigDict(dict(  # vocab_size: the tokenizer's
      hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4, num_kv_heads=2,
      max_position_embeddings=128))

  c.data = ml_collections.ConfigDict()
  # "arith" (generated examples), a JSONL/JSON/parquet file or a datasets save_to_disk
  # directory with "prompt" and "response" fields.
  c.data.train = "arith"
  c.data.eval = "arith"  # held-out examples, same kinds of source
  c.data.train_split = "train"  # the split of a DatasetDict directory (and of "arith")
  c.data.eval_split = "test"
  c.data.train_size = 256  # examples generated for "arith"; for files the first N (0: all)
  c.data.eval_size = 128
  c.data.chat_template = True  # render prompts with the tokenizer's chat template
  c.data.system = ""  # system prompt ("": none, i.e. the template's default)
  c.data.max_prompt_len = 64  # tokens; padded length = the longest prompt, at most this
  c.data.max_response_len = 24  # tokens, the EOS included; longer responses are cut
  c.data.truncate = "left"  # too-long prompts: "left" keeps their end, "error" raises

  c.train = ml_collections.ConfigDict()
  c.train.num_epochs = 1.0  # optimizer steps = ceil(num_epochs * train examples / batch_size)
  c.train.batch_size = 16
  c.train.grad_accum = 1  # micro-batches per step (gradients averaged)
  c.train.eval_batch_size = 32
  c.train.eval_every = 0  # evaluate every N steps (0: only before and after training)
  c.train.log_every = 1
  c.train.aggregation = "token_mean"  # "token_mean" or "seq_mean" over response tokens

  c.optim = ml_collections.ConfigDict()
  c.optim.lr = 2e-5
  c.optim.warmup_steps = 0
  c.optim.decay = "cosine"  # "constant", "linear" or "cosine"
  c.optim.end_factor = 0.1  # final lr = end_factor * lr
  c.optim.weight_decay = 0.0
  c.optim.max_grad_norm = 1.0
  return c
