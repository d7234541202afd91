"""Config validation: every mistake gives one clear message before any model is loaded."""

import ml_collections
import pytest

from ppojax.run import build as build_lib
from ppojax.run import checks as checks_lib
from ppojax.run import config as config_lib
from ppojax.run import models as run_models


def toy(**overrides):
  return build_lib.load_config("configs/toy.py", **overrides)


def test_defaults_and_shipped_configs_pass():
  checks_lib.validate(config_lib.defaults(), num_devices=1)
  checks_lib.validate(toy(), num_devices=1, context_length=64)


def test_unknown_option_suggests_the_nearest_name():
  c = toy()
  c.rl.kl_coeff = 0.1  # a typo adds a new field silently in ml_collections
  with pytest.raises(checks_lib.ConfigError, match=r"unknown config option rl\.kl_coeff; did "
                     r"you mean rl\.kl_coef"):
    checks_lib.validate(c, num_devices=1)


def test_unknown_section_lists_the_options():
  c = toy()
  c.optimiser = ml_collections.ConfigDict({"lr": 1.0})
  with pytest.raises(checks_lib.ConfigError, match="unknown config option optimiser"):
    checks_lib.validate(c, num_devices=1)


def test_user_named_metrics_are_free_form():
  c = toy()
  c.eval.metrics = ml_collections.ConfigDict({"my_metric": "pkg.mod:fn"})
  checks_lib.validate(c, num_devices=1)


@pytest.mark.parametrize("name, value, message", [
    ("rl.clip_eps", "0.2", r"rl\.clip_eps='0\.2' has type str; expected float"),
    ("rl.batch_size", 8.0, r"rl\.batch_size=8\.0 has type float; expected int"),
    ("rl.whiten_advantages", 1, r"rl\.whiten_advantages=1 has type int; expected bool"),
    ("sampling.stop_ids", 2, r"sampling\.stop_ids=2 has type int; expected tuple"),
])
def test_wrong_types(name, value, message):
  c = toy()
  section, field = name.split(".")
  unlocked = c[section].to_dict()  # ConfigDict refuses some of these on assignment already
  unlocked[field] = value
  c[section] = ml_collections.ConfigDict(unlocked, type_safe=False)
  with pytest.raises(checks_lib.ConfigError, match=message):
    checks_lib.validate(c, num_devices=1)


def test_int_for_float_is_fine():
  c = toy()
  c.optim.actor.lr = 1  # ConfigDict keeps it a float anyway; a plain int must pass too
  checks_lib.validate(c, num_devices=1)


@pytest.mark.parametrize("name, value, message", [
    ("reward.kind", "txt", r"reward\.kind='txt' is not one of 'jax', 'python', 'text', 'model'"),
    ("rl.aggregation", "mean", r"rl\.aggregation='mean' is not one of"),
    ("data.task", "gsm8k", r"data\.task='gsm8k' is not one of 'count', 'arith', 'calc', 'file'"),
])
def test_unknown_choices(name, value, message):
  section, field = name.split(".")
  c = toy(**{f"{section}__{field}": value})
  with pytest.raises(checks_lib.ConfigError, match=message):
    checks_lib.validate(c, num_devices=1)


@pytest.mark.parametrize("name, value, message", [
    ("rl.dual_clip", 1.0, r"rl\.dual_clip=1\.0 must be > 1 \(dual-clip PPO, Ye et al\. 2020; "
     r"3 is usual\) or None to turn it off: .* silently zeroes the gradient of every token with a "
     r"negative advantage"),
    ("rl.dual_clip", 0.5, r"rl\.dual_clip=0\.5 must be > 1"),
    ("rl.clip_eps", 0.0, r"rl\.clip_eps=0\.0 must be in \(0, 1\)"),
    ("rl.clip_eps", 1.0, r"rl\.clip_eps=1\.0 must be in \(0, 1\)"),
    ("rl.clip_eps", None, r"rl\.clip_eps=None must be in \(0, 1\)"),
    ("rl.clip_eps", float("nan"), r"rl\.clip_eps=nan must be in \(0, 1\)"),
    ("rl.value_clip", 0.0, r"rl\.value_clip=0\.0 must be > 0 \(0\.2 is usual\), or None"),
    ("rl.vf_coef", -0.1, r"rl\.vf_coef=-0\.1 must be >= 0"),
    ("rl.ent_coef", -0.01, r"rl\.ent_coef=-0\.01 must be >= 0"),
    ("rl.kl_coef", -0.05, r"rl\.kl_coef=-0\.05 must be >= 0 .* rewards drifting"),
    ("rl.gamma", 1.1, r"rl\.gamma=1\.1 must be in \[0, 1\]"),
    ("rl.lam", -0.5, r"rl\.lam=-0\.5 must be in \[0, 1\]"),
    ("rl.score_clip", 0.0, r"rl\.score_clip=0\.0 must be > 0"),
    ("rl.missing_stop_penalty", -1.0, r"rl\.missing_stop_penalty=-1\.0 must be >= 0: it is "
     r"subtracted from the score"),
    ("optim.max_grad_norm", 0.0, r"optim\.max_grad_norm=0\.0 must be > 0"),
    ("lora.dropout", 1.0, r"lora\.dropout=1\.0 must be in \[0, 1\): the probability of "
     r"dropping"),
    ("lora.dropout", -0.1, r"lora\.dropout=-0\.1 must be in \[0, 1\)"),
    ("rl.pack_fractions", (0.5, 0.25), r"rl\.pack_fractions=\(0\.5, 0\.25\) must be ascending "
     r"numbers in \(0, 1\]"),
    ("rl.pack_fractions", (0.5, 0.5), r"rl\.pack_fractions=\(0\.5, 0\.5\) must be ascending"),
    ("rl.pack_fractions", (0.0,), r"rl\.pack_fractions=\(0\.0,\) must be ascending"),
    ("rl.pack_fractions", (1.5,), r"rl\.pack_fractions=\(1\.5,\) must be ascending"),
])
def test_out_of_range_values(name, value, message):
  c = toy()
  section, field = name.split(".")
  c[section][field] = value
  with pytest.raises(checks_lib.ConfigError, match=message):
    checks_lib.validate(c, num_devices=1)


def test_the_old_single_pack_fraction_names_its_tuple():
  c = toy()
  c.rl.pack_fraction = 0.5  # a ConfigDict takes a new key; the check refuses it
  with pytest.raises(checks_lib.ConfigError, match=r"config option rl\.pack_fraction is now "
                     r"rl\.pack_fractions: write --config\.rl\.pack_fractions="):
    checks_lib.validate(c, num_devices=1)


def test_in_range_edge_values_pass():
  c = toy()
  c.rl.pack_fractions = (0.25, 0.5, 1.0)
  c.rl.dual_clip = 1.5
  c.rl.value_clip = None
  c.rl.vf_coef = 0.0
  c.rl.gamma, c.rl.lam = 1.0, 0.0
  c.rl.score_clip = 5.0
  checks_lib.validate(c, num_devices=1)


def test_lora_dropout_needs_adapters():
  with pytest.raises(checks_lib.ConfigError, match=r"lora\.dropout=0\.1 drops out the LoRA "
                     r"adapters' input, but lora\.rank=0 \(full fine-tuning\) has no adapters"):
    checks_lib.validate(toy(lora__dropout=0.1), num_devices=1)
  checks_lib.validate(toy(lora__dropout=0.1, lora__rank=4), num_devices=1)


def test_adaptive_kl_needs_positive_target_and_horizon():
  c = toy(rl__target_kl=0.0)
  checks_lib.validate(c, num_devices=1)  # not read without adaptive_kl
  c.rl.adaptive_kl = True
  with pytest.raises(checks_lib.ConfigError, match=r"rl\.target_kl=0\.0 must be > 0 with "
                     r"rl\.adaptive_kl"):
    checks_lib.validate(c, num_devices=1)
  c = toy(rl__adaptive_kl=True, rl__kl_horizon=-1.0)
  with pytest.raises(checks_lib.ConfigError, match=r"rl\.kl_horizon=-1\.0 must be > 0"):
    checks_lib.validate(c, num_devices=1)


@pytest.mark.parametrize("overrides, devices, context, message", [
    ({"rl__batch_size": 31}, 1, None, r"rl\.batch_size=31 is not divisible by "
     r"rl\.num_minibatches × rl\.grad_accum = 2 × 1"),
    ({"rl__batch_size": 8}, 8, None, r"rl\.batch_size=8 is not divisible by "
     r"rl\.num_minibatches × data-parallel devices = 2 × 8"),
    ({"mesh__shape": (2, 1, 1)}, 1, None, r"mesh\.shape=\(2, 1, 1\) does not fit the 1 devices"),
    ({"mesh__shape": (3, -1, 1)}, 8, None, r"mesh\.shape=\(3, -1, 1\) does not fit the 8"),
    ({"mesh__shape": (-1, -1, 1)}, 8, None, r"three sizes"),
    ({"sampling__max_new_tokens": 60}, 1, 64,
     r"prompt \+ response = 6 \+ 60 = 66 tokens exceeds the model's context of 64"),
    ({"rl__num_epochs": 0}, 1, None, r"rl\.num_epochs=0 must be >= 1"),
])
def test_inconsistent_sizes(overrides, devices, context, message):
  with pytest.raises(checks_lib.ConfigError, match=message):
    checks_lib.validate(toy(**overrides), num_devices=devices, context_length=context)


def test_runner_validates_before_loading_any_model(monkeypatch):
  """build() fails on a bad config without touching the model loader."""
  monkeypatch.setattr(run_models, "load_policy", lambda *a: pytest.fail("a model was loaded"))
  c = toy()
  c.rl.kl_coeff = 0.1
  with pytest.raises(checks_lib.ConfigError, match="kl_coeff"):
    build_lib.build(c)


def test_context_length_of_the_tiny_model_is_checked_by_the_runner():
  with pytest.raises(checks_lib.ConfigError, match="exceeds the model's context of 64"):
    build_lib.validate(toy(sampling__max_new_tokens=64))


def test_every_option_can_be_overridden_on_the_command_line():
  """config_flags cannot parse an override of a None or list default; ppojax's defaults are
  typed placeholders and tuples, so stop ids, pad id and the clips can be set with --config."""
  import pathlib  # pylint: disable=import-outside-toplevel

  from absl import flags  # pylint: disable=import-outside-toplevel
  from ml_collections import config_flags  # pylint: disable=import-outside-toplevel
  path = pathlib.Path(__file__).parents[1] / "configs" / "quickstart.py"

  def parse(*overrides):
    argv = ["train", f"--config={path}", *overrides]
    fv = flags.FlagValues()
    config_flags.DEFINE_config_file("config", str(path), flag_values=fv, sys_argv=argv)
    fv(argv)
    return fv.config

  c = parse("--config.sampling.stop_ids=(2, 7)", "--config.sampling.pad_id=0",
            "--config.rl.score_clip=5", "--config.rl.dual_clip=3")
  assert tuple(c.sampling.stop_ids) == (2, 7) and c.sampling.pad_id == 0
  assert c.rl.score_clip == 5.0 and c.rl.dual_clip == 3.0
  checks_lib.validate(c, num_devices=1)
  c = parse("--config.sampling.stop_ids=2")
  assert tuple(c.sampling.stop_ids) == (2,) and c.sampling.pad_id is None


# ---------------------------------------------------------------------------------------------
# The loss functions check their options where they are Python numbers (a research user calling
# them directly gets the error too); traced values pass unchecked under jit.


def _loss_inputs():
  import jax.numpy as jnp  # pylint: disable=import-outside-toplevel
  x = jnp.zeros((2, 3))
  return x, jnp.ones((2, 3), bool)


@pytest.mark.parametrize("kwargs, message", [
    (dict(dual_clip=1.0), r"dual_clip=1\.0 must be > 1 .*or None to turn it off"),
    (dict(dual_clip=0.5), r"dual_clip=0\.5 .*zeroes the gradient of every token with a negative"),
    (dict(clip_eps=0.0), r"clip_eps=0\.0 must be in \(0, 1\)"),
    (dict(clip_eps=1.5), r"clip_eps=1\.5 must be in \(0, 1\)"),
    (dict(clip_eps_low=1.0), r"clip_eps_low=1\.0 must be in \(0, 1\)"),
    (dict(clip_eps_high=-0.1), r"clip_eps_high=-0\.1 must be > 0"),
])
def test_policy_loss_rejects_bad_options(kwargs, message):
  from ppojax.core import losses  # pylint: disable=import-outside-toplevel
  x, m = _loss_inputs()
  with pytest.raises(ValueError, match=message):
    losses.policy_loss(x, x, x, m, **kwargs)
  with pytest.raises(ValueError, match=message):
    losses.ppo_loss(x, x, x, x, x, x, m, **kwargs)


def test_other_losses_reject_bad_options():
  from ppojax.core import losses  # pylint: disable=import-outside-toplevel
  x, m = _loss_inputs()
  with pytest.raises(ValueError, match=r"clip_range=0\.0 must be > 0"):
    losses.value_loss(x, x, x, m, clip_range=0.0)
  with pytest.raises(ValueError, match=r"clip_range=-1 must be > 0"):
    losses.ppo_loss(x, x, x, x, x, x, m, value_clip=-1)
  with pytest.raises(ValueError, match=r"vf_coef=-0\.1 must be >= 0"):
    losses.ppo_loss(x, x, x, x, x, x, m, vf_coef=-0.1)
  with pytest.raises(ValueError, match=r"coef=-0\.01 must be >= 0 \(β of the KL"):
    losses.kl_loss(x, x, m, coef=-0.01)


def test_loss_options_in_range_and_traced_values_pass():
  import jax  # pylint: disable=import-outside-toplevel
  import jax.numpy as jnp  # pylint: disable=import-outside-toplevel

  from ppojax.core import losses  # pylint: disable=import-outside-toplevel
  x, m = _loss_inputs()
  losses.policy_loss(x, x, x, m, clip_eps=0.1, clip_eps_low=0.2, clip_eps_high=1.5,
                     dual_clip=3)
  losses.value_loss(x, x, x, m, clip_range=None)
  losses.ppo_loss(x, x, x, x, x, x, m, vf_coef=0, value_clip=None, dual_clip=None)
  # Under jit the values are tracers: not checked (and not an error), whatever they hold.
  loss = jax.jit(lambda c: losses.policy_loss(x, x, x, m, dual_clip=c)[0])(jnp.float32(0.5))
  assert float(loss) == 0.0


def test_aggregation_choices_are_the_ones_ops_knows():
  """config's accepted rl.aggregation values are exactly ops.aggregate's modes (and "": the
  algorithm's), its estimators the registry's, its KL estimators ppojax.core.kl's."""
  from ppojax.core import advantages, algorithms, kl, ops  # pylint: disable=import-outside-toplevel
  assert tuple(checks_lib.CHOICES["rl.aggregation"]) == ("", *ops.AGGREGATIONS)
  assert tuple(checks_lib.CHOICES["rl.estimator"]) == ("", *advantages.ESTIMATORS)
  assert tuple(checks_lib.CHOICES["rl.kl_estimator"]) == ("", *kl.KL_ESTIMATORS)
  assert tuple(checks_lib.CHOICES["algorithm"]) == tuple(algorithms.ALGORITHMS)
  for a in algorithms.ALGORITHMS.values():  # every default is a valid choice
    assert a.estimator in advantages.ESTIMATORS and a.aggregation in ops.AGGREGATIONS
    assert a.kl_estimator in kl.KL_ESTIMATORS and a.kl_in in algorithms.KL_PLACEMENTS


def test_a_loss_option_has_one_range_and_one_message():
  """The config's check and the loss's own check of an option read one table
  (``options.OPTION_RANGES``): the same requirement, word for word."""
  from ppojax.core import losses  # pylint: disable=import-outside-toplevel
  x, m = _loss_inputs()
  with pytest.raises(checks_lib.ConfigError) as from_config:
    build_lib.validate(toy(rl__dual_clip=0.5))
  with pytest.raises(ValueError) as from_loss:
    losses.policy_loss(x, x, x, m, dual_clip=0.5)
  assert str(from_config.value) == "rl." + str(from_loss.value)


@pytest.mark.parametrize("name, value", [("save_every", 0), ("keep", 0)])
def test_checkpoint_cadence_is_checked_before_anything_loads(name, value):
  """save_every=0 used to pass the checks and fail in the checkpointer after the models loaded."""
  with pytest.raises(checks_lib.ConfigError, match=f"{name}={value} must be an integer >= 1"):
    checks_lib.validate(toy(**{name: value}), num_devices=1)
