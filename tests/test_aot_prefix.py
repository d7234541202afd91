"""``ppojax.run.aot`` compiles the prompts a training run would give it: with the shared prefix
(``data.shared_prefix``) whose length a local tokenizer tells, or a length given; and the fit
table (``benchmarks/scale_table.py``) says which rows the compiler refused and which HBM it
does not know."""

import pathlib

import jax
import pytest
from benchmark_script import load

from ppojax.data import encoding
from ppojax.run import aot
from ppojax.run import build as build_lib

ROOT = pathlib.Path(__file__).parents[1]
SCALE = str(ROOT / "configs" / "scale.py") + ":tiny"


@pytest.fixture(scope="module")
def tokenizer_dir(char_tokenizer, tmp_path_factory):
  path = tmp_path_factory.mktemp("tokenizer")
  char_tokenizer.save_pretrained(path)
  return str(path)


def test_a_training_runs_prefix_length_as_its_source_would_take_it(char_tokenizer):
  config = build_lib.load_config(SCALE)
  header = encoding.template_prefix(char_tokenizer, system=None, chat_template=True)
  assert len(header) == 2  # "u:" of the template's user turn ("u:TEXT\na:")
  assert aot.training_prefix_len(config, char_tokenizer) == 2
  assert aot.training_prefix_len(config, None) is None  # only the tokenizer can tell
  config.data.shared_prefix = False
  assert aot.training_prefix_len(config, char_tokenizer) == 0
  config.data.update(shared_prefix=True, task="count")
  assert aot.training_prefix_len(config, None) == 1  # its BOS


def test_the_rollout_compiles_with_the_tokenizers_prefix_and_counts_fewer_flops(tokenizer_dir):
  """With a local tokenizer the prefix is a training run's, the prompts carry it as
  ``Prompts.prefix`` [C] (the rollout's other code path), and the prefix's prefill is counted
  once per batch; without one the report says the prefix is unknown."""
  config = build_lib.load_config(SCALE, model__tokenizer=tokenizer_dir)
  result = aot.compile_step(config, jax.devices()[:1], "rollout")
  assert (result.prefix_len, result.prefix_from) == (2, "training run")
  prompts = result.compiled.args_info[0][2]
  assert prompts.prefix.shape == (2,) and prompts.tokens.shape == (16, 32)
  assert aot.iteration_flops(result.run, 2) < aot.iteration_flops(result.run, 0)
  assert "a shared prefix of 2 tokens" in aot.format_report(aot.report(config, "cpu", result))
  public = build_lib.load_config(SCALE)  # model.policy "tiny": no tokenizer here
  assert aot.training_prefix_len(public, aot.local_tokenizer(public)) is None
  unknown = aot.report(public, "cpu", result._replace(prefix_len=0, prefix_from="unknown"))
  assert "--prefix_len=N" in aot.format_report(unknown)
  mesh = result.run.mesh
  assert aot.abstract_prompts(config, mesh, 5).prefix.shape == (5,)
  assert aot.abstract_prompts(config, mesh).prefix is None
  with pytest.raises(aot.AotError, match="prefix_len=32: a shared prefix is 1 to 31 tokens"):
    aot.abstract_prompts(config, mesh, 32)


def _scale_table():
  return load("scale_table")


@pytest.mark.parametrize("fits, refused, verdict", [
    (True, False, "**fits**"), (False, False, "does not fit"),
    (False, True, "refused by the compiler"), (None, False, "unknown")])
def test_the_fit_table_tells_refusals_and_unknown_hbm_apart(fits, refused, verdict):
  assert _scale_table().verdict_of({"fits": fits, "compiler_out_of_memory": refused}) == verdict
