"""How the config becomes Accelerator arguments (the multi-process behaviour itself is tested elsewhere)."""
from __future__ import annotations

import datetime
import importlib.util

import pytest
import torch
from accelerate.utils import DistributedDataParallelKwargs, InitProcessGroupKwargs

from library.config import UserError, parse_config
from library.training.accelerator import accelerator_kwargs, allow_fp16_gradients, zero3_refusals


def config_with(tmp_path, *extra: str):
    (tmp_path / "m").mkdir(exist_ok=True)
    config, _ = parse_config(["--pretrained_model_name_or_path", str(tmp_path / "m"), "--train_data_dir",
                              str(tmp_path), "--output_dir", str(tmp_path / "o"), *extra])
    return config


def handler(kwargs, kind):
    found = [h for h in kwargs["kwargs_handlers"] if isinstance(h, kind)]
    return found[0] if found else None


def test_single_process_defaults(tmp_path, monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    kwargs = accelerator_kwargs(config_with(tmp_path))
    assert kwargs["kwargs_handlers"] == []
    assert kwargs["dynamo_backend"] == "no"
    assert kwargs["mixed_precision"] == "no"
    assert "deepspeed_plugin" not in kwargs


def test_process_group_and_ddp_kwargs(tmp_path, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    kwargs = accelerator_kwargs(config_with(tmp_path, "--ddp_timeout", "90", "--ddp_static_graph",
                                            "--ddp_gradient_as_bucket_view", "--gradient_accumulation_steps", "3"))
    group = handler(kwargs, InitProcessGroupKwargs)
    assert group.timeout == datetime.timedelta(minutes=90)
    assert group.backend in ("gloo", "nccl")
    ddp = handler(kwargs, DistributedDataParallelKwargs)
    assert ddp.static_graph and ddp.gradient_as_bucket_view
    assert kwargs["gradient_accumulation_steps"] == 3


def test_no_process_group_handler_in_a_single_process(tmp_path, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "1")
    kwargs = accelerator_kwargs(config_with(tmp_path, "--ddp_timeout", "90"))
    assert handler(kwargs, InitProcessGroupKwargs) is None


def test_torch_compile_leaves_the_accelerator_alone(tmp_path):
    # The trainer compiles the repeated blocks itself; accelerate would compile the whole model.
    assert accelerator_kwargs(config_with(tmp_path, "--torch_compile"))["dynamo_backend"] == "no"


def test_missing_deepspeed_is_a_user_error_with_the_install_command(tmp_path, monkeypatch):
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "deepspeed" else real_find_spec(name, *a))
    with pytest.raises(UserError, match="pip install deepspeed"):
        accelerator_kwargs(config_with(tmp_path, "--deepspeed"))


def test_deepspeed_plugin_batch_sizes(tmp_path, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    kwargs = accelerator_kwargs(config_with(tmp_path, "--deepspeed", "--zero_stage", "2", "--train_batch_size",
                                            "3", "--gradient_accumulation_steps", "4", "--offload_optimizer_device",
                                            "cpu", "--max_grad_norm", "0.5"))
    ds = kwargs["deepspeed_plugin"].deepspeed_config
    assert ds["train_micro_batch_size_per_gpu"] == 3
    assert ds["train_batch_size"] == 3 * 4 * 2
    assert ds["zero_optimization"]["stage"] == 2
    assert ds["zero_optimization"]["offload_optimizer"]["device"] == "cpu"
    assert ds["gradient_clipping"] == 0.5


def test_deepspeed_fp16_uses_kohyas_loss_scale_and_fp16_master_weights_with_zero2_offload(tmp_path):
    config = config_with(tmp_path, "--deepspeed", "--mixed_precision", "fp16", "--zero_stage", "2",
                         "--offload_optimizer_device", "cpu", "--full_fp16")
    fp16 = accelerator_kwargs(config)["deepspeed_plugin"].deepspeed_config["fp16"]
    assert fp16["enabled"] is True and fp16["initial_scale_power"] == 0
    assert fp16["fp16_master_weights_and_grads"] is True
    # The same through the DeepSpeed-only spelling.
    config = config_with(tmp_path, "--deepspeed", "--mixed_precision", "fp16", "--offload_optimizer_device", "cpu",
                         "--fp16_master_weights_and_gradients")
    assert accelerator_kwargs(config)["deepspeed_plugin"].deepspeed_config["fp16"]["fp16_master_weights_and_grads"]


def test_fp16_master_weights_need_zero2_with_cpu_offload(tmp_path, caplog):
    for extra in (("--zero_stage", "3", "--offload_optimizer_device", "cpu"), ("--zero_stage", "2")):
        config = config_with(tmp_path, "--deepspeed", "--mixed_precision", "fp16", "--full_fp16", *extra)
        fp16 = accelerator_kwargs(config)["deepspeed_plugin"].deepspeed_config["fp16"]
        assert "fp16_master_weights_and_grads" not in fp16 and fp16["initial_scale_power"] == 0
    assert "master weights stay fp32" in caplog.text
    # Without fp16 there is no fp16 section for accelerate to keep.
    bf16 = accelerator_kwargs(config_with(tmp_path, "--deepspeed", "--mixed_precision", "bf16"))
    assert "fp16" not in bf16["deepspeed_plugin"].deepspeed_config


def test_full_precision_options_need_the_matching_mixed_precision(tmp_path):
    with pytest.raises(UserError) as e:
        config_with(tmp_path, "--full_fp16", "--full_bf16", "--fp16_master_weights_and_gradients")
    text = str(e.value)
    assert 'full_fp16 needs mixed_precision = "fp16"' in text
    assert 'full_bf16 needs mixed_precision = "bf16"' in text
    assert 'fp16_master_weights_and_gradients needs mixed_precision = "fp16"' in text


def test_full_fp16_lets_the_grad_scaler_unscale_fp16_gradients():
    def scaled_step(patched: bool) -> torch.Tensor:
        torch.manual_seed(0)
        layer = torch.nn.Linear(3, 2).half()
        optimizer = torch.optim.SGD(layer.parameters(), lr=0.1)
        scaler = torch.amp.GradScaler("cpu", init_scale=8.0)
        if patched:
            allow_fp16_gradients(scaler)
        scaler.scale(layer(torch.ones(1, 3, dtype=torch.float16)).float().sum()).backward()
        scaler.unscale_(optimizer)
        return layer.weight.grad

    with pytest.raises(ValueError, match="unscale FP16 gradients"):
        scaled_step(patched=False)
    # d(sum(W x + b))/dW = x for each output row: the unscaled gradient is exactly 1, not the scale 8.
    assert torch.equal(scaled_step(patched=True), torch.ones(2, 3, dtype=torch.float16))


def test_deepspeed_cpu_adam_replaces_only_a_plain_adamw(tmp_path):
    """accelerate swaps an offloaded optimizer for DeepSpeed's CPU Adam with only lr and weight_decay; anything
    else must keep its own optimizer."""
    def forced(*extra):
        config = config_with(tmp_path, "--deepspeed", "--offload_optimizer_device", "cpu", *extra)
        return accelerator_kwargs(config)["deepspeed_plugin"].deepspeed_config.get("zero_force_ds_cpu_optimizer",
                                                                                   True)
    assert forced() and forced("--optimizer_args", "weight_decay=0.1")
    assert not forced("--optimizer_args", "betas=(0.9,0.99)")
    assert not forced("--optimizer_type", "Lion")
    assert not forced("--use_8bit_adam")
    config = config_with(tmp_path, "--deepspeed", "--offload_optimizer_device", "cpu", "--optimizer_type",
                         "SGDNesterov", "--mixed_precision", "fp16", "--full_fp16")
    fp16 = accelerator_kwargs(config)["deepspeed_plugin"].deepspeed_config["fp16"]
    assert "fp16_master_weights_and_grads" not in fp16  # DeepSpeed allows it only with its CPU Adam


def test_kohya_zero3_options_reach_the_deepspeed_config(tmp_path, monkeypatch):
    for name in ("ACCELERATE_DEEPSPEED_ZERO3_INIT", "ACCELERATE_DEEPSPEED_ZERO3_SAVE_16BIT_MODEL",
                 "ACCELERATE_DEEPSPEED_ZERO_STAGE"):
        monkeypatch.delenv(name, raising=False)
    nvme = tmp_path / "nvme"
    nvme.mkdir()
    config = config_with(tmp_path, "--deepspeed", "--zero_stage", "3", "--zero3_save_16bit_model",
                         "--zero3_init_flag", "--offload_optimizer_device", "nvme", "--offload_optimizer_nvme_path",
                         str(nvme), "--offload_param_device", "nvme", "--offload_param_nvme_path", str(nvme))
    plugin = accelerator_kwargs(config)["deepspeed_plugin"]
    zero = plugin.deepspeed_config["zero_optimization"]
    assert zero["stage"] == 3 and zero["stage3_gather_16bit_weights_on_model_save"] is True
    assert zero["offload_optimizer"] == {"device": "nvme", "nvme_path": str(nvme)}
    assert zero["offload_param"] == {"device": "nvme", "nvme_path": str(nvme)}
    assert zero["stage3_max_reuse_distance"] == 0  # else NVMe's swap buffers run out in the second step
    assert plugin.zero3_init_flag is True


def test_nvme_offload_without_libaio_or_zero3_names_both(tmp_path, monkeypatch):
    from deepspeed.accelerator import get_accelerator

    class WithoutLibaio:
        def is_compatible(self, verbose: bool = False) -> bool:
            return False

    monkeypatch.setattr(get_accelerator(), "create_op_builder", lambda name: WithoutLibaio())
    nvme = tmp_path / "nvme"
    nvme.mkdir()
    config = config_with(tmp_path, "--deepspeed", "--zero_stage", "2", "--offload_optimizer_device", "nvme",
                         "--offload_optimizer_nvme_path", str(nvme))
    with pytest.raises(UserError) as caught:
        accelerator_kwargs(config)
    assert "libaio-dev" in str(caught.value) and "needs zero_stage = 3 (got 2:" in str(caught.value)


def test_nvme_offload_needs_its_folder_and_the_nvme_device(tmp_path):
    with pytest.raises(UserError) as caught:
        config_with(tmp_path, "--deepspeed", "--zero_stage", "3", "--offload_optimizer_device", "nvme",
                    "--offload_param_nvme_path", str(tmp_path / "missing"))
    message = str(caught.value)
    assert "offload_optimizer_device = \"nvme\" needs offload_optimizer_nvme_path" in message
    assert "offload_param_nvme_path is set but offload_param_device is None" in message
    assert "missing is not a folder" in message


def test_zero3_refuses_sampling_validation_ema_and_prior_reg_in_one_message(tmp_path):
    config = config_with(tmp_path, "--deepspeed", "--zero_stage", "3", "--ema_decay", "0.99")
    with pytest.raises(UserError) as caught:
        zero3_refusals(config, sampling=True, validating=True, prior_reg=True)
    assert [p.split(":")[0].split(" ")[0] for p in caught.value.problems] == ["prior_reg", "sample_prompts",
                                                                             "validation", "ema_decay"]
    zero3_refusals(config_with(tmp_path, "--deepspeed", "--zero_stage", "3"), sampling=False, validating=False)


@pytest.mark.parametrize("network_args, unused", [
    (["algo=dylora", "block_size=2"], True),  # one block of ranks learns per step
    (["algo=loha", "module_dropout=0.1"], True),  # LyCORIS' module dropout skips whole layers
    (["algo=locon", "module_dropout=0.1"], False),  # kohya's multiplies by zero: every weight gets a gradient
])
def test_ddp_is_told_of_adapter_weights_without_a_gradient(tmp_path, network_args, unused):
    kwargs = accelerator_kwargs(config_with(tmp_path, "--network_module", "lycoris.kohya", "--network_args",
                                            *network_args))
    ddp = handler(kwargs, DistributedDataParallelKwargs)
    assert (ddp is not None and ddp.find_unused_parameters) == unused
