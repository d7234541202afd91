"""Seconds per PPO iteration of Google's tunix (``PPOLearner``): the other side of
``ppo_step.py --tunix``.

Table: the tunix rows of docs/performance/peers.md, "PPO iteration vs tunix: `benchmarks/ppo_step.py
--tunix`".

It runs in a virtual environment of its own (``ensure_env``, under ``~/.cache/ppojax``), so that
ppojax's environment stays untouched even where the versions agree: tunix 0.1.7 pulls in grain,
qwix, metrax, tensorflow-datasets and more. ``ppo_step.py --tunix`` creates that environment and
runs this script in it, in the same benchmark run as ppojax's step (before ppojax builds
anything, so the two processes' memory never adds up):

    python benchmarks/peers/tunix_ppo.py --policy DIR --reward DIR --prompts FILE.json \\
        [--response-length 32] [--iterations 3] [--warmup 1] [--temperature 1.0]

``tunix_grpo.py`` (the GRPO side, ``grpo_step.py --tunix``) imports its pieces from here: the
environment, the model config and loader, the tokenizer, the ``RLCluster`` and the timing.

DIR are the Hugging Face directories ppojax exports (``save_model``): the policy as
``LlamaForCausalLM`` and the reward model as ``LlamaForSequenceClassification`` (the policy's
backbone with a one-wide ``score`` head, zero in the benchmark). tunix's Llama-3 model, with a
``ModelConfig`` that is SmolLM2-135M exactly (30 layers, width 576, MLP 1536, 9 heads of 64, 3
KV heads, vocabulary 49152, RoPE θ 1e5, RMSNorm ε 1e-5, tied embeddings), is loaded with tunix's
own safetensors loader: the policy (trained, and the rollout model: they share one set of
weights, tunix's colocated default, so no weight sync runs), the reference (a second copy), the
reward model and the critic (both from the reward directory, as ppojax's ``critic_init =
"reward"``). tunix's Llama-3 has no value head, so the reward model and the critic are its
embedder, decoder layers and final norm with a bias-free linear score head (``ScoreModel``
below; the pattern of tunix's own ``GemmaWithScoreHead``), its weight read from the directory.
FILE holds the prompts as lists of token ids (ppojax's chat prompts, 44 tokens each, no
padding).

What tunix's ``PPOLearner.train`` runs per iteration (one global step: 1 epoch, 1 minibatch, no
gradient accumulation, float32 on the CPU):

* rollout: tunix's "vanilla" sampler: two compiled functions, a prefill and a decode
  ``while_loop`` over a KV cache of P + R slots; top-p sampling with top_p = 1.0 (tunix samples
  only by greedy, top-p/top-k or beam search: top-p 1.0 is plain sampling at the temperature,
  but it sorts the vocabulary every step). The prompt strings are tokenized on the host, the
  completions copied back and detokenized;
* three compiled forwards: the reference's and the rollout policy's per-token log-probs (the
  latter at temperature 1, tunix's ``get_old_per_token_logps``), the critic's values, the
  reward model's scores (four forwards in all, each over the full P + R rows, every position
  through the LM head for the log-probs);
* on the host, with jitted pieces: the token-level rewards (the score on the last token minus
  β·KL per token), GAE, and metrics (several device→host copies);
* two trainers, one after the other: the actor's compiled step (forward + backward of the
  clipped policy loss, AdamW) and then the critic's (clipped value loss, AdamW), each with its
  own optimizer, so the policy forward of the old log-probs and the critic forward of the old
  values are not reused by the update.

Settings as ``ppo_step.py``'s: β = ppojax's ``kl_coef`` (0.01) with the k1 estimator in the
reward (tunix ``kl_method="kl"``), γ = 1, λ = 0.95, ratio clip 0.2, value clip 0.2, AdamW at lr
3e-6 with weight decay 0 and gradient clipping at global norm 1 for both actor and critic,
temperature 1.0. What differs, and how each side is made to match:

* Exact length: tunix has no ``min_new_tokens``. Its sampler stops a row at an ``eos_tokens``
  id; this script passes one id outside the vocabulary (49152), so every row runs all R decode
  steps, as ppojax's with min_new_tokens = max_new_tokens and no stop ids. At every
  ``RLCluster.generate`` call the script counts each completion's tokens other than the pad id
  (tunix's completion mask, ``record_lengths``) and, after the run, fails
  (``peer_env.check_lengths``: a non-zero exit naming the expected and found lengths) if any
  completion is not R tokens long: one that samples the pad id, which tunix would mask.
* Padding: tunix masks every token equal to the tokenizer's pad id (prompts and completions).
  SmolLM2's pad id is ``<|im_end|>`` (2), which the chat prompts contain, so this script's
  tokenizer uses ``<|endoftext|>`` (0) as pad and eos (in no prompt; a completion that samples
  it gets a shorter mask, the same shapes and work).
* Prompts: tunix's rollout takes strings. The script decodes ppojax's token ids to text and
  checks that tunix's tokenization (``Sampler.tokenize``) gives back exactly the same 44 ids.
* The value loss's weight: tunix trains the critic with its own optimizer on the value loss
  alone; ppojax adds vf_coef · value loss to one loss (with Adam, a constant factor on a
  separate parameter set changes little; the work is the same).
* Whitening: tunix's GAE does not whiten the advantages; ppojax does (elementwise, no FLOPs to
  speak of).
* Shared prefix, reuse of the update's forward: ppojax's defaults in ``ppo_step.py`` (the
  24-token chat header once per batch, the single-pass update) have no counterpart in tunix;
  ``ppo_step.py --no-shared-prefix --no-reuse-update-forward`` times ppojax without them.

* A tunix quirk, not a setting: 0.1.7 builds the token-level rewards as ``zeros_like`` of the
  int32 completion ids, so the reward model's score is cast to an integer before the KL penalty
  is subtracted (jax warns). No shapes or work change.

Status: full-size runs (``ppo_step.py --tunix --no-trl``: 16 prompts, 32 new tokens, timed
iterations after the warm-up) have finished; their figures and conditions are in
docs/performance/peers.md ("PPO iteration vs tunix"). tunix's peak resident set there was 14–15 GB,
so the run needs that much free memory beside ppojax's (``TUNIX_RSS_LIMIT_MB`` stops it
earlier, exit code 3).

An iteration is the time between two requests of tunix's trainer for its next batch (the
iterator this script hands to ``train``): rollout, scoring, both updates and tunix's own
bookkeeping of that iteration. The first ``--warmup`` iterations (the first compiles) are not
counted. The last line printed is a JSON object with ``seconds_per_iteration`` (the median),
``peak_rss_mb`` (VmHWM of this process) and the versions used.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time
from pathlib import Path

import peer_env  # this folder; standard library only, so every environment imports it

# What ``ensure_env`` installs: tunix 0.1.7 on the jax / flax / optax that ppojax runs (its own
# environment all the same), and the transformers its tokenizer adapter reads.
TUNIX_REQUIREMENTS = ("google-tunix==0.1.7", "jax==0.10.2", "jaxlib==0.10.2", "flax==0.12.8",
                      "optax==0.2.8", "qwix==0.1.8", "transformers==5.12.1",
                      "safetensors==0.7.0", "numpy==2.4.6")
OUT_OF_VOCAB = 49152  # SmolLM2's vocabulary size: an "eos" id the sampler never draws


def default_env_dir() -> Path:
  return peer_env.cache_dir("tunix-venv")


def ensure_env(directory: Path | None = None) -> Path:
  """The Python of a virtual environment with ``TUNIX_REQUIREMENTS``, created on first use."""
  return peer_env.ensure_env(directory or default_env_dir(), TUNIX_REQUIREMENTS, "tunix",
                             "ppo_step.py --no-tunix")


peak_rss_mb = peer_env.peak_rss_mb


def rss_guard(limit_mb: float, interval_s: float = 0.2):
  """A daemon thread that ends this process (exit code 3, a message on stderr) once its resident
  set passes ``limit_mb``: on a shared machine, before the kernel's OOM killer picks a victim."""
  import threading  # pylint: disable=import-outside-toplevel

  def watch():
    while True:
      with open("/proc/self/status", encoding="ascii") as f:
        rss = next(int(line.split()[1]) for line in f if line.startswith("VmRSS:")) / 1024
      if rss > limit_mb:
        print(f"{Path(sys.argv[0]).stem}: resident set {rss:.0f} MB passed --rss-limit-mb "
              f"{limit_mb:.0f}; stopping", file=sys.stderr, flush=True)
        os._exit(3)  # pylint: disable=protected-access
      time.sleep(interval_s)

  threading.Thread(target=watch, daemon=True).start()


def smollm2_config(model_dir: str):
  """tunix's Llama-3 ``ModelConfig`` from a ppojax-exported config.json (SmolLM2-135M: 30
  layers, 576 wide, 9 heads of 64, 3 KV heads, tied embeddings)."""
  from tunix.models.llama3 import model as llama  # pylint: disable=import-outside-toplevel
  hf = json.loads((Path(model_dir) / "config.json").read_text())
  return llama.ModelConfig(
      num_layers=hf["num_hidden_layers"], vocab_size=hf["vocab_size"],
      embed_dim=hf["hidden_size"], hidden_dim=hf["intermediate_size"],
      num_heads=hf["num_attention_heads"], head_dim=hf["head_dim"],
      num_kv_heads=hf["num_key_value_heads"], rope_theta=int(hf["rope_theta"]),
      norm_eps=hf["rms_norm_eps"], weight_tying=hf["tie_word_embeddings"])


def score_model_class():
  """``ScoreModel``: tunix's Llama-3 backbone (embedder, decoder layers, final norm) with a
  1-wide linear score per position, the form tunix's PPO expects of a critic or reward model
  (called like the LM, returning [B, T, 1])."""
  # pylint: disable=import-outside-toplevel
  import jax.numpy as jnp
  from flax import nnx

  class ScoreModel(nnx.Module):
    def __init__(self, backbone, score_weight):
      self.backbone = backbone
      self.score = nnx.Linear(backbone.config.embed_dim, 1, use_bias=False,
                              rngs=nnx.Rngs(0))
      self.score.kernel.set_value(jnp.asarray(score_weight.reshape(1, -1).T,
                                              self.score.kernel.get_value().dtype))

    def __call__(self, input_tokens, positions, cache=None, attention_mask=None,
                 segment_ids=None):  # segment_ids: passed by tunix, unused (no packing)
      del cache, segment_ids
      m = self.backbone
      x = m.embedder.encode(input_tokens)
      for layer in m.layers:
        _, x = layer(x, positions, None, attention_mask)
      return self.score(m.final_norm(x)), None

  return ScoreModel


def tokenizer_and_texts(policy_dir: str, prompts: list[list[int]]):
  """SmolLM2's tokenizer as tunix's rollout uses it (left padding; ``<|endoftext|>``, id 0, as
  pad and eos: tunix masks every pad id, and SmolLM2's own pad ``<|im_end|>`` is in the chat
  prompts) and the prompts decoded to the strings tunix's rollout takes."""
  from transformers import PreTrainedTokenizerFast  # pylint: disable=import-outside-toplevel
  if len({len(p) for p in prompts}) != 1:
    raise ValueError("every prompt must have the same number of tokens")
  tokenizer = PreTrainedTokenizerFast(tokenizer_file=str(Path(policy_dir) / "tokenizer.json"),
                                      padding_side="left")
  tokenizer.pad_token = tokenizer.eos_token = tokenizer.convert_ids_to_tokens(0)
  return tokenizer, [tokenizer.decode(p, skip_special_tokens=False) for p in prompts]


def loader(model_dir: str):
  """The mesh tunix's roles run on (the one CPU device, over the axes tunix's models annotate)
  and ``load(directory)``: tunix's Llama-3 with ``smollm2_config``, float32, from a
  safetensors directory by tunix's own loader."""
  # pylint: disable=import-outside-toplevel
  import jax
  from tunix.models.llama3 import params as llama_params
  config = smollm2_config(model_dir)
  mesh = jax.make_mesh((1, 1), ("fsdp", "tp"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
  load = lambda d: llama_params.create_model_from_safe_tensors(  # noqa: E731
      d, config, mesh=mesh, dtype=jax.numpy.float32)
  return mesh, load


def adamw(lr: float):
  """AdamW at a constant ``lr``, weight decay 0, after clipping at global norm 1 (ppojax's)."""
  import optax  # pylint: disable=import-outside-toplevel
  return optax.chain(optax.clip_by_global_norm(1.0),
                     optax.adamw(lr, b1=0.9, b2=0.999, weight_decay=0.0))


def make_cluster(*, mesh, actor, reference, tokenizer, prompt_length: int,
                 response_length: int, temperature: float, batch: int, max_steps: int,
                 lr: float, critic=None, reward=None):
  """tunix's ``RLCluster`` over one mesh: the vanilla rollout engine sharing the actor's
  weights (no offloading, no weight sync), exactly ``response_length`` new tokens (an eos id
  outside the vocabulary), top-p 1 at ``temperature``, float32; one minibatch and one micro
  batch of ``batch`` prompts everywhere; no evaluation, checkpoints or metric logging. The
  critic gets an optimizer of its own where there is one."""
  # pylint: disable=import-outside-toplevel
  import jax
  from tunix.rl import rl_cluster as rl
  from tunix.rl.rollout import base_rollout
  rollout_config = base_rollout.RolloutConfig(
      max_tokens_to_generate=response_length, max_prompt_length=prompt_length,
      kv_cache_size=prompt_length + response_length, temperature=temperature, top_p=1.0,
      top_k=None, eos_tokens=[OUT_OF_VOCAB], data_type=jax.numpy.float32)
  training_config = rl.RLTrainingConfig(
      actor_optimizer=adamw(lr), critic_optimizer=None if critic is None else adamw(lr),
      eval_every_n_steps=10**9, max_steps=max_steps, mini_batch_size=batch,
      train_micro_batch_size=batch, rollout_micro_batch_size=batch,
      compute_logps_micro_batch_size=batch, checkpoint_root_directory=None,
      pbar_description=None, metrics_logging_options=None)
  cluster_config = rl.ClusterConfig(
      role_to_mesh={role: mesh for role in rl.Role}, rollout_engine="vanilla",
      offload_to_cpu=False, training_config=training_config, rollout_config=rollout_config)
  return rl.RLCluster(actor=actor, critic=critic, reference=reference, reward=reward,
                      tokenizer=tokenizer, cluster_config=cluster_config)


def check_tokenization(cluster, texts: list[str], prompts: list[list[int]]):
  """That tunix's rollout tokenizes each prompt string back to exactly ppojax's ids."""
  sampler = cluster.rollout._sampler  # pylint: disable=protected-access
  for text, ids in zip(texts, prompts):
    if list(sampler.tokenize(text)) != list(ids):
      raise RuntimeError(f"tunix tokenizes a prompt differently: {list(sampler.tokenize(text))}"
                         f" vs ppojax's {ids}")


def timed_train(learner, batch: dict, n_iterations: int) -> list[float]:
  """Runs ``learner.train`` on ``n_iterations`` copies of ``batch``; the seconds of each
  iteration: the time between two requests of tunix's trainer for its next batch."""
  name, marks = Path(sys.argv[0]).stem, []

  def batches():  # one mark per request for a batch: an iteration lies between two marks
    for i in range(n_iterations):
      marks.append(time.perf_counter())
      print(f"{name}: iteration {i}, RSS {peak_rss_mb('VmRSS'):.0f} MB, peak so far "
            f"{peak_rss_mb():.0f} MB", file=sys.stderr, flush=True)
      yield dict(batch)  # a fresh dict: tunix's pipeline replaces its leaves
    marks.append(time.perf_counter())

  learner.train(batches())
  if len(marks) == n_iterations:  # the trainer stopped at max_steps without asking again
    marks.append(time.perf_counter())
  steps = [b - a for a, b in zip(marks, marks[1:])]
  if len(steps) != n_iterations:
    raise RuntimeError(f"tunix ran {len(steps)} iterations, expected {n_iterations}")
  return steps


def record_lengths(cluster, pad_id: int = 0) -> list[list[int]]:
  """A list that gathers, at each ``cluster.generate`` call (tunix's rollout), the lengths of
  its completions as tunix's completion mask counts them: the tokens other than ``pad_id``
  (the tokenizer's pad, ``tokenizer_and_texts``)."""
  import numpy as np  # pylint: disable=import-outside-toplevel
  calls, generate = [], cluster.generate

  def recording(*args, **kwargs):
    out = generate(*args, **kwargs)
    calls.append([int(np.sum(np.asarray(t) != pad_id)) for t in out.tokens])
    return out

  cluster.generate = recording
  return calls


def check_lengths(calls: list[list[int]], n_calls: int, response_length: int) -> None:
  """That tunix generated ``n_calls`` times and every completion is ``response_length`` tokens
  (``record_lengths``' lists; ``peer_env.check_lengths``)."""
  if len(calls) != n_calls:
    raise RuntimeError(f"tunix generated {len(calls)} times, expected {n_calls}")
  peer_env.check_lengths([n for call in calls for n in call], response_length,
                         "tunix's completions")


def versions() -> dict:
  """The versions of what this environment runs."""
  # pylint: disable=import-outside-toplevel
  from importlib import metadata

  import jax
  import numpy as np
  import transformers
  return {"tunix": metadata.version("google-tunix"), "jax": jax.__version__,
          "flax": metadata.version("flax"), "transformers": transformers.__version__,
          "devices": str(jax.devices()), "numpy": np.__version__}


def main():
  parser = peer_env.ppo_arguments(__doc__.splitlines()[0])
  parser.add_argument("--temperature", type=float, default=1.0)
  parser.add_argument("--kl-coef", type=float, default=0.01)
  parser.add_argument("--rss-limit-mb", type=float, default=0,
                      help="stop (exit code 3) once the resident set passes this (0: no limit)")
  args = parser.parse_args()
  if args.rss_limit_mb:
    rss_guard(args.rss_limit_mb)
  os.environ.setdefault("JAX_PLATFORMS", "cpu")

  # pylint: disable=import-outside-toplevel
  import numpy as np
  import safetensors.numpy
  from tunix.rl.ppo import ppo_learner

  prompts = json.loads(Path(args.prompts).read_text())
  tokenizer, texts = tokenizer_and_texts(args.policy, prompts)
  batch, p_len, r_len = len(prompts), len(prompts[0]), args.response_length
  n_iterations = args.warmup + args.iterations

  mesh, load = loader(args.policy)
  t0 = time.perf_counter()
  actor, reference = load(args.policy), load(args.policy)
  score = safetensors.numpy.load_file(str(Path(args.reward) / "model.safetensors"))["score.weight"]
  score_model = score_model_class()
  critic = score_model(load(args.reward), score)
  reward = score_model(load(args.reward), score)
  cluster = make_cluster(mesh=mesh, actor=actor, critic=critic, reference=reference,
                         reward=reward, tokenizer=tokenizer, prompt_length=p_len,
                         response_length=r_len, temperature=args.temperature, batch=batch,
                         max_steps=n_iterations, lr=args.lr)
  del actor, critic, reference, reward
  check_tokenization(cluster, texts, prompts)
  algo = ppo_learner.PPOConfig(num_iterations=1, beta=args.kl_coef, kl_method="kl",
                               gamma=1.0, gae_lambda=0.95, epsilon=0.2, clip_range_value=0.2)
  lengths = record_lengths(cluster)
  learner = ppo_learner.PPOLearner(rl_cluster=cluster, ppo_config=algo)
  build_s = time.perf_counter() - t0
  print(f"tunix_ppo: built in {build_s:.0f} s, RSS {peak_rss_mb('VmRSS'):.0f} MB, peak "
        f"{peak_rss_mb():.0f} MB", file=sys.stderr, flush=True)

  # an array: tunix's pipeline maps over leaves
  steps = timed_train(learner, {"prompts": np.array(texts)}, n_iterations)
  check_lengths(lengths, n_iterations, r_len)
  timed = steps[args.warmup:]
  print(json.dumps({
      "seconds_per_iteration": statistics.median(timed), "iterations": timed,
      "warmup_seconds": steps[:args.warmup], "build_seconds": build_s, "batch": batch,
      "prompt_length": p_len, "response_length": r_len,
      "completion_lengths": sorted({n for call in lengths for n in call}), **versions(),
      "peak_rss_mb": peak_rss_mb()}))


if __name__ == "__main__":
  sys.exit(main())
