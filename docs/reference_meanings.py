"""What the reference pages say that the code does not say itself (``generate_reference.py``
reads everything else from the code): the one-line intro of each config section, the meaning of
each option that ``ppojax/run/config.py`` leaves without a comment, the meaning of every metric a
run logs, and a description and example per command line.

Each text here was written by reading the code that uses the option or computes the metric. An
option's comment in config.py wins: the generator refuses a meaning here for an option that has
one there (move the text into config.py as a comment and delete it here, or the other way
round). Text is Markdown; `backticks` mark names and code.
"""

# ---- config sections: one line each -----------------------------------------------------------

RUN_SECTIONS = {
    "": "The run as a whole: the algorithm, its length, logging, checkpoints, resuming, and the "
        "start of a multi-host run.",
    "model": "The models: the policy to fine-tune (also the reference), the reward model, where "
             "the critic starts, and how they compute.",
    "lora": "LoRA: a frozen base plus trained low-rank adapters, the base also the reference "
            "(docs/lora.md).",
    "data": "The prompts: the task or file they come from, and how they are rendered and padded.",
    "reward": "How a response is scored.",
    "env": "Multi-turn rollouts: an environment answers each turn of the policy "
           "(docs/multiturn.md).",
    "eval": "Greedy evaluation on the task's held-out prompts, before and after training.",
    "sampling": "How the responses are sampled during training.",
    "rl": "The RL update: batch, advantage estimator, KL penalty, clipping, rollout correction, "
          "DAPO's options; \"\" leaves an option to the algorithm (ppojax/core/algorithms.py).",
    "optim": "The optimizers: global-norm clipping, then AdamW on a warm-up and decay schedule, "
             "one for the policy (actor) and one for the critic.",
    "mesh": "How the devices are laid out (ppojax/infra/sharding.py).",
}

SUPERVISED_SECTIONS = {
    "": "The run as a whole: seed, logging and checkpoints.",
    "model": "The model trained: the policy (SFT) or a reward model (the model plus a score "
             "head).",
    "data": "The training and held-out examples and how they are encoded.",
    "train": "The training loop: epochs, batch, evaluation and logging.",
    "optim": "The optimizer: global-norm clipping, then AdamW on a warm-up and decay schedule.",
}

# ---- options config.py leaves without a comment ---------------------------------------------


def _schedule(who: str) -> dict:
  """The meanings of an ``optim.actor`` / ``optim.critic`` section's entries."""
  return {
      "lr": f"the {who}'s peak learning rate (AdamW)",
      "warmup_steps": f"optimizer steps of linear warm-up from 0 to the {who}'s lr (0: none)",
      "decay": f"the {who}'s learning rate after the warm-up: kept (\"constant\") or decayed "
               "(\"linear\", \"cosine\") to end_factor × lr at the last optimizer step",
      "end_factor": f"the {who}'s final learning rate as a fraction of lr (with a decay)",
      "weight_decay": f"AdamW's decoupled weight decay of the {who}'s parameters",
  }


_TINY = {
    "vocab_size": "tokens in the vocabulary (with model.tokenizer: the tokenizer's size instead)",
    "hidden_size": "width of the residual stream (the embedding size)",
    "intermediate_size": "width of each layer's MLP",
    "num_layers": "transformer layers",
    "num_heads": "attention heads (each hidden_size / num_heads wide)",
    "num_kv_heads": "key/value heads (fewer than num_heads: grouped-query attention)",
    "max_position_embeddings": "the context length in tokens (prompt + response must fit)",
}

RUN_OPTIONS = {
    "seed": "the run's random seed: model initialisation, batch order and generated prompts, "
            "sampling and the update's keys",
    "num_iterations": "RL iterations, each one batch of prompts: sample, score, update",
    "log_every": "write a metrics row every N iterations (and for the first, the last and any "
                 "skipped one)",
    "num_processes": "with distributed: the number of processes (0: auto-detect; see "
                     "coordinator_address)",
    "process_id": "with distributed: this process's index (-1: auto-detect; see "
                  "coordinator_address)",
    "model.remat": "rematerialise each layer's activations in the backward pass (recompute "
                   "instead of keep: less memory, more compute; model.remat_policy)",
    **{f"model.tiny.{k}": f"model.policy \"tiny\": {v}" for k, v in _TINY.items()},
    "reward.fn": "the reward as \"module:function\", for reward.kind \"jax\", \"python\" or "
                 "\"text\" (unused by \"model\" and \"env\")",
    "env.high": "guess_number: the largest secret (env.low is the smallest)",
    "eval.batch_size": "held-out prompts per compiled generate call (the last batch is filled up "
                       "with copies whose results are dropped)",
    "data.rg.eval_seed": "task \"reasoning_gym\": the seed of the held-out dataset (its questions "
                         "are skipped in training)",
    "sampling.max_new_tokens": "the response's length limit in tokens (multi-turn: each turn's); "
                               "a response cut off there has no stop token",
    "sampling.temperature": "the softmax temperature of sampling; the update's log-probs are "
                            "taken at it too",
    "sampling.top_k": "sample among the k most likely tokens only (0: all)",
    "sampling.top_p": "nucleus sampling: the smallest set of most likely tokens whose "
                      "probability reaches p (1.0: all)",
    "rl.num_epochs": "passes of the update over each iteration's rollout",
    "rl.num_minibatches": "minibatches per epoch, one optimizer step each",
    "rl.oversample": "with dynamic_sampling: prompts sampled per iteration as a multiple of "
                     "batch_size (1.0: no more than learned from)",
    "rl.gamma": "the discount γ of GAE and the token estimators (1: none, usual for LMs)",
    "rl.lam": "GAE's λ: the bias-variance trade-off of the critic's advantages",
    "rl.clip_eps": "PPO's clip ε: the policy ratio is clipped to [1 − ε, 1 + ε]",
    "rl.clip_eps_high": "the upper clip (asymmetric clip: see clip_eps_low; None: clip_eps)",
    "rl.dual_clip": "dual-clip PPO's c: a negative advantage's term is capped at −c·A "
                    "(None: off)",
    "rl.value_clip": "the critic's value clip: V may move at most this far from V_old "
                     "(None: unclipped value loss)",
    "rl.vf_coef": "the value loss's weight in the total loss",
    "rl.ent_coef": "the entropy bonus's weight in the total loss (0: none)",
    "rl.adaptive_kl": "adapt β (kl_coef is its start) toward target_kl (Ziegler et al. 2019's "
                      "proportional controller); False: β fixed",
    "rl.target_kl": "with adaptive_kl: the KL per sequence (summed over tokens) β is steered to",
    "rl.kl_horizon": "with adaptive_kl: the controller's horizon in samples (larger: slower "
                     "changes of β)",
    "rl.score_clip": "scores clipped to [−c, c] before use (None: off)",
    "rl.missing_stop_penalty": "subtracted from the score of a response without a stop token "
                               "(trl's missing_eos_penalty; 0: none)",
    "rl.whiten_rewards": "scale the token rewards to unit variance over the batch's response "
                         "tokens, keeping their mean (trl's whiten_rewards)",
    "rl.whiten_advantages": "normalise the advantages to mean 0 and variance 1 over the batch's "
                            "response tokens",
    "rl.overlong_factor": "with overlong_buffer: the penalty at the length limit",
    "rl.reject_low": "with reject: the lowest ratio π_old/π_sampler kept in the loss",
    "rl.reject_high": "with reject: the highest ratio π_old/π_sampler kept in the loss",
    "optim.max_grad_norm": "gradients are clipped to this global norm (each model's own)",
    **{f"optim.actor.{k}": v for k, v in _schedule("policy").items()},
    **{f"optim.critic.{k}": v for k, v in _schedule("critic").items()},
}

SUPERVISED_OPTIONS = {
    **{f"model.tiny.{k}": f"model.init \"tiny\": {v}" for k, v in _TINY.items()
       if k != "vocab_size"},
    "data.eval_split": "the split of a DatasetDict directory (and of \"arith\") for the "
                       "held-out data",
    "data.eval_size": "held-out examples (pairs) generated for \"arith\"; for files the first N "
                      "(0: all)",
    "train.eval_batch_size": "held-out rows per evaluation batch",
    "train.log_every": "write a metrics row every N optimizer steps (and with each evaluation)",
    "optim.lr": "the peak learning rate (AdamW)",
    "optim.warmup_steps": "optimizer steps of linear warm-up from 0 to lr (0: none)",
    "optim.weight_decay": "AdamW's decoupled weight decay",
    "optim.max_grad_norm": "gradients are clipped to this global norm",
}

# ---- metrics: (name, meaning, when it is logged; "" always) ---------------------------------
# An UPPER-CASE part of a name stands for a name the run chooses (a program, a metric's name).

PREFIXES = {
    "": "Counters and trl's names for what its trainers log.",
    "objective": "The rollout's scores and KL, as the rewards are shaped from them.",
    "rollout": "What was sampled, and what the filters and corrections took out of the loss.",
    "policy": "The policy's update, averaged over its optimizer steps (`_avg`).",
    "val": "The responses' lengths, the critic's values and the policy ratio's statistics "
           "(trl's names).",
    "loss": "The loss terms, averaged over the update's optimizer steps (`_avg`).",
    "update": "The padding-free update (`rl.pack_fractions`), averaged over its micro-batches "
              "and optimizer steps.",
    "episode": "Multi-turn rollouts (`env.name`): per-episode means over the batch.",
    "eval": "The held-out evaluation: greedy completions of the held-out prompts, scored by "
            "`eval.metrics`; logged at step 0 (before), every `eval.every` iterations and "
            "after the last.",
    "eval_BASELINE": "The untrained policy on the held-out prompts with each instruction of "
                     "`eval.baselines` appended, at step 0.",
    "monitor": "`eval.monitor`: the held-out metrics on the iteration's own sampled responses.",
    "nonfinite": "Which checked quantity was NaN or infinite in the iteration (1.0) or not (0.0).",
    "skipped": "Iterations skipped for non-finite values (`rl.max_bad_steps`).",
    "data": "The prompts.",
    "time": "Seconds.",
    "compile": "XLA's compiles in this process so far (`ppojax.infra.compile`).",
    "memory": "Peak memory so far, in MiB.",
}

_UPDATE = "mean over the update's optimizer steps"
_TOOLS = "`env.name` \"tools\""

RL_METRICS = [
    ("step", "the iteration (the row's step in metrics.jsonl, TensorBoard and W&B)", ""),
    ("episode", "responses learned from so far: iteration × `rl.batch_size` × "
                "`sampling.num_samples_per_prompt` (trl's episode)", ""),
    ("eps", "episodes (responses) per second since the loop started; the first iterations "
            "include compiling", ""),
    ("lr", "the policy's learning rate in this iteration's update", ""),
    ("reward", "mean score of the responses after score_clip and the missing-stop penalty "
               "(trl GRPOTrainer's reward)", ""),
    ("kl", "mean per-token KL to the reference over response tokens (trl GRPOTrainer's kl)", ""),
    ("completion_length", "mean response length in tokens (trl GRPOTrainer's)", ""),
    ("clip_ratio", "same as `policy/clipfrac_avg` (trl GRPOTrainer's name)", ""),
    ("reward_std", "mean over prompts of the standard deviation of their samples' scores "
                   "(Bessel-corrected)", "`sampling.num_samples_per_prompt` > 1"),
    ("frac_reward_zero_std", "share of prompts whose samples all scored the same (no learning "
                             "signal for a group estimator)",
     "`sampling.num_samples_per_prompt` > 1"),
    ("objective/scores", "mean score after score_clip and the missing-stop penalty (multi-turn: "
                         "plus the turns' rewards)", ""),
    ("objective/scores_raw", "mean score as the reward gave it, before any shaping", ""),
    ("objective/kl", "mean over responses of the KL to the reference summed over tokens "
                     "(`rl.kl_estimator`); 0 without a reference", ""),
    ("objective/non_score_reward", "mean over responses of Σ_t −β·KL_t, the KL penalty in the "
                                   "rewards (0 with the KL in the loss)", ""),
    ("objective/rlhf_reward", "`objective/scores` + `objective/non_score_reward`", ""),
    ("objective/missing_stop_frac", "share of responses without a stop token (cut off by the "
                                    "length limit)", ""),
    ("objective/entropy_masked", "mean over responses of Σ_t −log π(token) of the sampled "
                                 "tokens (trl's objective/entropy without its padding term)", ""),
    ("objective/kl_coef", "β, the KL coefficient used in this iteration (moves with "
                          "`rl.adaptive_kl`)", ""),
    ("objective/overlong_penalty", "mean DAPO soft overlong penalty added to the scores",
     "`rl.overlong_buffer` > 0"),
    ("rollout/logp_mismatch", "mean |log π_learner − log π_sampler| over response tokens: how "
                              "far the sampler's log-probs are from the learner's "
                              "(`sampling.dtype`, the decode's rounding)", ""),
    ("rollout/zero_spread_fraction", "share of the sampled groups whose scores are all equal",
     "`rl.dynamic_sampling`"),
    ("rollout/kept_fraction", "share of the `rl.batch_size` groups learned from that have a "
                              "spread of scores", "`rl.dynamic_sampling`"),
    ("rollout/rows_in_loss", "share of the batch's rows in the loss (the fill of groups without "
                             "a spread is not)", "`rl.dynamic_sampling`"),
    ("rollout/overlong_filtered", "share of responses left out of the loss for being cut off",
     "`rl.overlong_filter`"),
    ("rollout/rejected_tokens", "share of response tokens out of the loss for their ratio "
                                "π_old/π_sampler (`rl.reject_low`, `rl.reject_high`)",
     "`rl.reject`"),
    ("rollout/rejected_sequences", "share of responses with a token out of the loss for its "
                                   "ratio", "`rl.reject`"),
    ("policy/grad_norm_avg", f"the policy gradient's global norm before clipping, {_UPDATE}", ""),
    ("policy/clipfrac_avg", f"share of loss tokens whose policy term the clip decides, {_UPDATE}",
     ""),
    ("policy/dual_clipfrac_avg", f"share of loss tokens capped by dual-clip, {_UPDATE}", ""),
    ("policy/approxkl_masked_avg", f"½·mean (log π − log π_old)² over loss tokens, {_UPDATE}", ""),
    ("policy/entropy_masked_avg", "the policy's entropy over the whole vocabulary per response "
                                  f"token, aggregated as the loss is, {_UPDATE}", ""),
    ("policy/kl_avg", f"mean per-token KL to the reference of the loss's KL term, {_UPDATE}",
     "KL in the loss (`rl.kl_in` \"loss\") with a reference"),
    ("policy/is_weight_avg", f"mean truncated importance weight over loss tokens, {_UPDATE}",
     "`rl.tis_cap`"),
    ("policy/is_truncated_avg", f"share of loss tokens whose weight the cap set, {_UPDATE}",
     "`rl.tis_cap`"),
    ("val/num_stopped", "responses in the batch that end on a stop token (a count)", ""),
    ("val/response_length", "mean response length in tokens", ""),
    ("val/values_rollout", "mean of the critic's values V_old over response tokens", "a critic"),
    ("val/values_avg", f"mean of the critic's values V over loss tokens, {_UPDATE}", "a critic"),
    ("val/error_avg", f"mean squared error (V − R)² over loss tokens, {_UPDATE}", "a critic"),
    ("val/clipfrac_avg", f"share of loss tokens where the clipped value error is the larger, "
                         f"{_UPDATE}", "a critic"),
    ("val/grad_norm_avg", f"the critic gradient's global norm before clipping, {_UPDATE}",
     "a critic"),
    ("val/ratio_masked_avg", f"mean policy ratio π/π_old over loss tokens (GSPO: the sequence's), "
                             f"{_UPDATE}", ""),
    ("val/ratio_token_var_avg", f"variance of that ratio over loss tokens, {_UPDATE}", ""),
    ("loss/policy_avg", f"the policy term, {_UPDATE}", ""),
    ("loss/value_avg", f"the value loss (before vf_coef), {_UPDATE}", "a critic"),
    ("loss/kl_avg", f"the KL term β·agg(KL_t), {_UPDATE}",
     "KL in the loss (`rl.kl_in` \"loss\") with a reference"),
    ("loss/total_avg", f"the total loss, {_UPDATE}", ""),
    ("update/packed_avg", "share of micro-batches that ran packed (1) rather than padded (0)",
     "`rl.pack_fractions`"),
    ("update/pack_rows_avg", "rows run per padded row (the fraction chosen, 1 when padded)",
     "`rl.pack_fractions`"),
    ("update/pack_fill_avg", "share of the rows' positions that hold real tokens",
     "`rl.pack_fractions`"),
    ("episode/turns", "turns the policy took", "multi-turn"),
    ("episode/truncated_turns", "turns cut off by `sampling.max_new_tokens`", "multi-turn"),
    ("episode/done", "share of episodes the environment ended", "multi-turn"),
    ("episode/cut_off", "share of episodes the environment did not end (out of `env.max_turns`, "
                        "or no observation)", "multi-turn"),
    ("episode/no_observation", "turns after which the environment went on without an "
                               "observation (which ends the episode)", "multi-turn"),
    ("episode/obs_share", "the environment's share of the tokens seen", "multi-turn"),
    ("episode/invalid", "turns whose answer the environment could not read", "`env.name` "
                        "\"count_turns\" or \"guess_number\""),
    ("episode/solved", "share of episodes that found the secret", "`env.name` \"guess_number\""),
    ("episode/tool_calls", "tool calls made", _TOOLS),
    ("episode/tool_errors", "tool calls that failed", _TOOLS),
    ("episode/results_cut", "tool results cut to fit `env.obs_tokens`", _TOOLS),
    ("episode/obs_truncated", "observations cut to `env.obs_tokens`", "an environment on the "
                              "host (\"tools\", \"module:factory\")"),
    ("episode/host_round_trips", "round trips between the device and the host for the batch's "
                                 "episodes", "an environment on the host"),
    ("episode/INFO", "a count the environment reports per turn (its info dict), summed over "
                     "the episode", "an environment of your own (\"module:factory\")"),
    ("eval/NAME", "mean of `eval.metrics` NAME over the held-out prompts", "held-out data"),
    ("eval/NAME/COLUMN=VALUE", "the same over the held-out prompts whose record has COLUMN = "
                               "VALUE", "`eval.group_by` = COLUMN"),
    ("eval/reward_model", "mean score of the greedy completions by the reward model (the proxy "
                          "beside the true metrics)", "`reward.kind` \"model\""),
    ("eval_BASELINE/NAME", "`eval/NAME` of the untrained policy with instruction BASELINE "
                           "appended to every held-out prompt", "`eval.baselines`"),
    ("eval_BASELINE/NAME/COLUMN=VALUE", "the same per value of the group column",
     "`eval.baselines` and `eval.group_by`"),
    ("monitor/NAME", "mean of `eval.metrics` NAME over this iteration's sampled responses",
     "`eval.monitor`"),
    ("nonfinite/scores", "the scores were not all finite", ""),
    ("nonfinite/advantages", "the advantages were not all finite", ""),
    ("nonfinite/loss", "a loss term was not finite in some optimizer step", ""),
    ("nonfinite/grad_norm", "a gradient norm was not finite in some optimizer step", ""),
    ("skipped/nonfinite", "1.0: this iteration's update was skipped (state kept)", ""),
    ("skipped/nonfinite_total", "iterations skipped so far in the run", ""),
    ("data/truncated_prompts", "prompts of this batch cut from the left to "
                               "`data.max_prompt_len`", ""),
    ("time/iteration", "the iteration's seconds (sampling, scoring and update)", ""),
    ("time/sampling", "seconds of the rollout (sampling and its forward passes)",
     "the three phases run apart: a host reward or environment, or `phase_timing`"),
    ("time/scoring", "seconds of the scoring", "the three phases run apart"),
    ("time/update", "seconds of the update", "the three phases run apart"),
    ("time/train_s", "seconds in iterations so far, carried across a resume", ""),
    ("time/compile/PROGRAM", "seconds XLA spent compiling (or reading from the persistent cache) "
                             "the programs of PROGRAM: build, step (the fused iteration), rollout, "
                             "score, update, evaluate, other", ""),
    ("compile/count", "XLA programs compiled", ""),
    ("compile/cache_hits", "of them, read from the persistent compilation cache", ""),
    ("memory/peak_rss_mb", "this process's peak resident memory (VmHWM)", ""),
    ("memory/device_peak_mb", "the first local device's peak bytes in use",
     "a device whose allocator counts (GPU, TPU)"),
]

_RM = "`ppojax.train_rm`"
_SFT = "`ppojax.sft`"

SUPERVISED_METRICS = [
    ("step", "the optimizer step (0: the evaluation before training)", ""),
    ("epoch", "passes over the training rows so far", ""),
    ("lr", "the learning rate of this step", ""),
    ("train/loss", "the step's loss (SFT: the response NLL; reward model: Bradley-Terry)", ""),
    ("train/grad_norm", "the gradient's global norm before clipping", ""),
    ("train/accuracy", "share of the batch's pairs whose chosen response scored higher", _RM),
    ("train/margin", "mean score of chosen minus rejected over the batch", _RM),
    ("eval/rows", "held-out rows evaluated", "each evaluation"),
    ("eval/nll", "held-out response NLL per token", f"{_SFT}, each evaluation"),
    ("eval/token_accuracy", "share of held-out response tokens the model predicts greedily",
     f"{_SFT}, each evaluation"),
    ("eval/accuracy", "share of held-out pairs ranked right (a tie counts ½)",
     f"{_RM}, each evaluation"),
    ("eval/accuracy/SOURCE", "the same over the pairs from SOURCE (\"synthetic\", \"policy\": "
                             "`ppojax.preferences`)", f"{_RM}, pairs with a source column"),
    ("eval/loss", "held-out Bradley-Terry loss", f"{_RM}, each evaluation"),
    ("eval/margin", "held-out mean score of chosen minus rejected", f"{_RM}, each evaluation"),
    ("data/train_examples", "training examples", f"{_SFT}, step 0"),
    ("data/eval_examples", "held-out examples", f"{_SFT}, step 0"),
    ("data/train_pairs", "training pairs", f"{_RM}, step 0"),
    ("data/eval_pairs", "held-out pairs", f"{_RM}, step 0"),
    ("data/prompt_len", "the padded prompt length in tokens (the longest prompt)", "step 0"),
    ("data/response_len", "the padded response length in tokens", "step 0"),
    ("data/truncated_prompts", "prompts cut to `data.max_prompt_len`", "step 0"),
    ("data/truncated_responses", "responses cut to `data.max_response_len`", "step 0"),
    ("time/compile/PROGRAM", "seconds XLA spent compiling the programs of PROGRAM: train, "
                             "evaluate, other", ""),
    ("compile/count", "XLA programs compiled", ""),
    ("compile/cache_hits", "of them, read from the persistent compilation cache", ""),
]

CLASSIC_METRICS = [
    ("step", "the iteration", ""),
    ("env_steps", "environment steps per agent so far", ""),
    ("sps", "environment steps per second, all agents together", ""),
    ("episode/return", "mean over agents of each environment's last finished episode's return",
     ""),
    ("episode/return_min", "the worst agent's `episode/return`", ""),
    ("episode/length", "mean length of the last finished episodes", ""),
    ("episode/finished", "episodes finished so far (an agent's environments together)", ""),
    ("episode/terminated_frac", "share of the iteration's steps that ended an episode", ""),
    ("episode/truncated_frac", "share of the iteration's steps that hit the time limit", ""),
    ("objective/advantage_raw", "mean GAE advantage before whitening", ""),
    ("loss/policy", "the clipped policy loss", ""),
    ("loss/value", "the value loss", ""),
    ("loss/total", "the total loss", ""),
    ("policy/approxkl_masked", "½·mean (log π − log π_old)²", ""),
    ("policy/clipfrac", "share of steps whose policy term the clip decides", ""),
    ("policy/dual_clipfrac", "share capped by dual-clip (0: off)", ""),
    ("policy/entropy_masked", "mean policy entropy", ""),
    ("val/values", "mean value prediction", ""),
    ("val/error", "mean squared error (V − R)²", ""),
    ("val/clipfrac", "share of steps where the clipped value error is the larger", ""),
    ("val/ratio_masked", "mean policy ratio π/π_old", ""),
    ("val/ratio_token_var", "variance of the policy ratio", ""),
]

# ---- command lines ---------------------------------------------------------------------------

COMMANDS = {
    "ppojax.train": (
        "Trains a policy by RL (PPO, GRPO, ... `algorithm`) from a config of the run options; "
        "a config with a `classic` section trains a classic-control agent instead.",
        "python -m ppojax.train --config configs/toy.py --workdir runs/toy "
        "--config.num_iterations=60"),
    "ppojax.sft": (
        "Supervised fine-tuning on prompt-response pairs (the supervised options).",
        "python -m ppojax.sft --config configs/sft_arith.py --workdir runs/sft"),
    "ppojax.train_rm": (
        "Trains a reward model on preference pairs (the supervised options).",
        "python -m ppojax.train_rm --config configs/rm_arith.py --workdir runs/rm "
        "--config.model.init=runs/sft/policy"),
    "ppojax.preferences": (
        "Writes preference pairs from a policy's own mistakes, for `ppojax.train_rm`.",
        "python -m ppojax.preferences --config configs/rlhf_arith.py --out prefs/train.jsonl "
        "--config.model.policy=runs/sft/policy --n 256"),
    "ppojax.aot": (
        "Compiles the RL step for a TPU topology on this machine (no TPU needed) and reports "
        "its memory; it keeps nothing in the compilation cache (`--compile_cache` is refused "
        "with a message).",
        "python -m ppojax.aot --config configs/scale.py:qwen2_5_0_5b --topology v5e:2x4"),
}
