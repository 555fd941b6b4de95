"""DS4ForCausalLM.from_pretrained: checkpoint fingerprint, keep-quantized loading without dense weights."""

from __future__ import annotations

import pytest
import torch

from ckpt_utils import hf_config, new_model, randomise, save_single, state_of
from ds4_torch import DS4ForCausalLM
from ds4_torch.default_model import DEFAULT_MODEL_DIR, build_default_model
from ds4_torch.loading import checkpoint_fingerprint

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def source():
    return randomise(new_model(hf_config()), seed=0)


def test_from_pretrained_sets_the_checkpoint_fingerprint(source, tmp_path):
    save_single(state_of(source), tmp_path / "a", config_model=source)
    save_single(state_of(randomise(new_model(source.config), seed=1)), tmp_path / "b", config_model=source)
    first, second = DS4ForCausalLM.from_pretrained(tmp_path / "a"), DS4ForCausalLM.from_pretrained(tmp_path / "a")
    assert first.checkpoint_fingerprint == second.checkpoint_fingerprint == checkpoint_fingerprint(tmp_path / "a")
    # same shapes and config, other weights
    assert DS4ForCausalLM.from_pretrained(tmp_path / "b").checkpoint_fingerprint != first.checkpoint_fingerprint


def test_default_model_has_a_fingerprint():
    assert build_default_model().checkpoint_fingerprint == checkpoint_fingerprint(DEFAULT_MODEL_DIR)
