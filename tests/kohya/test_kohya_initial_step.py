"""sd-scripts' initial_step / initial_epoch / skip_until_initial_step: where a run starts, and what it then does."""
from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from library.config import UserError
from library.config.options import OPTIONS
from library.config.parse import Config
from library.training.start import initial_position
from tests.helpers.runs import train


def config_of(**values) -> Config:
    return Config({**{name: option.default for name, option in OPTIONS.items()}, **values})


def test_initial_position_follows_kohyas_rules():
    # 4 steps per epoch, 2 batches per step
    assert initial_position(config_of(), 4, 2, 20) is None
    assert initial_position(config_of(initial_step=6), 4, 2, 20) == (6, 1, 0)  # data from the epoch's start
    assert initial_position(config_of(initial_step=6, skip_until_initial_step=True), 4, 2, 20) == (6, 1, 4)
    assert initial_position(config_of(initial_epoch=3), 4, 2, 20) == (8, 2, 0)  # (3 - 1) x 4
    assert initial_position(config_of(initial_epoch=3, initial_step=5), 4, 2, 20)[0] == 5  # the step wins
    assert initial_position(config_of(initial_epoch=1), 4, 2, 20) is None
    with pytest.raises(UserError, match="initial_step 20 is not before the end of the run at step 20"):
        initial_position(config_of(initial_step=20), 4, 2, 20)


# SGD keeps no state between steps, so a LoRA saved at step 2 holds all there is to continue from (batches of 1).
SGD_RUN = {"resolution": 64, "caption_extension": ".txt", "seed": 3, "optimizer_type": "SGD", "learning_rate": "0.5",
           "lr_scheduler": "linear", "max_train_steps": 4, "output_name": "r"}


@pytest.mark.usefixtures("fresh_accelerator_state")
def test_continuing_from_a_saved_lora_at_initial_step_reproduces_the_run(tiny_sd1_dir, small_dataset, tmp_path):
    data = small_dataset(tmp_path / "d")
    whole = train(tiny_sd1_dir, data, tmp_path / "a", "--save_every_n_steps", "2", run=SGD_RUN)
    # the step-2 LoRA, started at step 2 with the data skipped there: the same batches, noise and learning rates
    continued = train(tiny_sd1_dir, data, tmp_path / "b", "--network_weights",
                      str(tmp_path / "a" / "r-step00000002.safetensors"), "--initial_step", "2",
                      "--skip_until_initial_step", run=SGD_RUN)
    assert continued.global_step == 4 and len(continued.losses) == 2
    assert continued.losses == whole.losses[2:]
    expected, got = load_file(whole.output_file), load_file(continued.output_file)
    for key in expected:
        torch.testing.assert_close(got[key], expected[key], rtol=0, atol=0, msg=key)
    # without the skip the data starts at the beginning of the epoch (4 images, batch 1: epoch 0, other batches)
    fresh_data = train(tiny_sd1_dir, data, tmp_path / "c", "--network_weights",
                       str(tmp_path / "a" / "r-step00000002.safetensors"), "--initial_step", "2", run=SGD_RUN)
    assert fresh_data.global_step == 4 and fresh_data.losses != whole.losses[2:]
