"""PPO at real sizes with a GSM8K-like shape: 64 prompts x 256 prompt tokens, 256 response
tokens, policy + reference + reward model + critic (initialised from the reward model), the
four models of the same architecture. One config per model, chosen by the argument:

    python -m ppojax.aot --config configs/scale.py:qwen2_5_0_5b --topology v5e:2x4
    python -m ppojax.aot --config configs/scale.py:llama3_1_8b --topology v5e:4x4
    python -m ppojax.train --config configs/scale.py:qwen2_5_1_5b --workdir runs/q15 \\
        --config.model.policy=/path/to/Qwen2.5-1.5B-Instruct \\
        --config.model.reward=/path/to/a/reward_model --config.data.path=prompts.jsonl

Shapes come from the models' public config.json values (ppojax/models/public.py), so
``ppojax.run.aot`` compiles any of them without weights; a training run reads the weights from the
local directories given as ``model.policy`` and ``model.reward``. Argument "tiny" is a small
random model of the same recipe, for tests.
"""

import ml_collections

from ppojax.run.config import defaults

MODELS = {
    "qwen2_5_0_5b": "Qwen/Qwen2.5-0.5B-Instruct",
    "qwen2_5_1_5b": "Qwen/Qwen2.5-1.5B-Instruct",
    "qwen2_5_7b": "Qwen/Qwen2.5-7B-Instruct",
    "llama3_2_1b": "meta-llama/Llama-3.2-1B-Instruct",
    "llama3_2_3b": "meta-llama/Llama-3.2-3B-Instruct",
    "llama3_1_8b": "meta-llama/Llama-3.1-8B-Instruct",
    "qwen3_0_6b": "Qwen/Qwen3-0.6B",
    "qwen3_1_7b": "Qwen/Qwen3-1.7B",
    "qwen3_4b": "Qwen/Qwen3-4B",
    "qwen3_8b": "Qwen/Qwen3-8B",
    "gemma3_1b": "google/gemma-3-1b-it",
    "gemma3_4b": "google/gemma-3-4b-it",
    "gemma3_12b": "google/gemma-3-12b-it",
    "tiny": "tiny",
}


def get_config(model: str = "qwen2_5_0_5b") -> ml_collections.ConfigDict:
  if model not in MODELS:
    raise ValueError(f"configs/scale.py:{model}: choose one of {', '.join(MODELS)}")
  c = defaults()
  c.num_iterations = 100
  c.model.policy = MODELS[model]
  c.model.reward = MODELS[model]  # a reward model of the policy's architecture (score head)
  c.model.critic_init = "reward"
  c.model.dtype = "bfloat16"  # compute; trained parameters float32 (the master weights)
  c.model.remat = True
  c.model.frozen_dtype = "bfloat16"  # reference and reward model: 2 bytes per parameter
  if model in ("qwen2_5_7b", "llama3_1_8b", "qwen3_8b", "gemma3_12b"):
    c.optim.state_dtype = "bfloat16"  # Adam's moments: 4 bytes per parameter, not 8
  if model == "llama3_1_8b":  # PPO on v5e 4x4: 15.50 GiB unrolled, 16.70 scanned (docs/scale.md);
    c.sampling.decode_layers = "unroll"  # GRPO is smaller scanned (11.25 GiB): pass "scan"
  c.reward.kind = "model"

  c.data.task = "file"  # data.path: prompts, JSONL with a "prompt" field
  c.data.max_prompt_len = 256
  c.sampling.max_new_tokens = 256
  c.sampling.temperature = 1.0

  c.rl.batch_size = 64
  c.rl.num_epochs = 1
  c.rl.num_minibatches = 1
  c.mesh.shape = (1, -1, 1)  # all devices on the fsdp axis
  if model == "tiny":
    c.model.tiny.update(vocab_size=512, max_position_embeddings=1024)
    c.data.max_prompt_len, c.sampling.max_new_tokens, c.rl.batch_size = 32, 16, 16
    c.sampling.stop_ids, c.sampling.pad_id = (0,), 0
  return c
