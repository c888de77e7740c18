"""The memory estimate before loading: counted from the files' headers, smaller under lower precisions, and a run
that cannot fit (a simulated limit) refused before loading, naming the options that would fit."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from library.config import UserError, parse_config
from library.memory import estimate as memory
from library.memory.precision import BasePrecision
from library.training.memory_check import check_memory


@pytest.fixture(scope="module")
def files(tiny_flux_dir, tmp_path_factory):
    from library.families.flux.tiny import save_tiny_flux_files

    return save_tiny_flux_files(tiny_flux_dir, tmp_path_factory.mktemp("flux_files"))


def test_counts_come_from_the_headers(files, tiny_flux_dir):
    from diffusers import FluxTransformer2DModel

    counts = memory.count_file(files["transformer"], "denoiser")["denoiser"]
    transformer = FluxTransformer2DModel.from_pretrained(tiny_flux_dir, subfolder="transformer")
    assert counts.matrices + counts.other == sum(p.numel() for p in transformer.parameters())
    assert counts.matrices > counts.other  # the matrices (BFL's fused qkv among them) are most of the weights


def test_lower_precisions_estimate_less(files):
    counts = {"denoiser": memory.count_file(files["transformer"], "denoiser")["denoiser"]}
    totals = [memory.estimate(counts, memory.Settings(kind, kind and "fp8", torch.bfloat16, torch.bfloat16, 4,
                                                      True)).parts["denoiser as stored"]
              for kind in (None, "fp8", "nf4")]
    assert totals[0] > totals[1] > totals[2]
    assert totals[0] - totals[1] == counts["denoiser"].matrices  # 2 bytes a matrix weight in bf16, 1 in fp8


def test_a_base_quantized_as_its_file_is_read_is_counted_as_stored_plus_its_largest_layer(files, tiny_flux_dir,
                                                                                         tmp_path):
    counts = {"denoiser": memory.count_file(files["transformer"], "denoiser")["denoiser"]}
    largest = max(p.numel() for p in memory_tensors(files["transformer"]) if p.ndim >= 2)
    assert counts["denoiser"].largest == largest
    settings = memory.Settings("nf4", "fp8", torch.float32, torch.float32, 4, True, reads_low=True)
    whole = memory.read_bytes(counts["denoiser"], "nf4", settings, denoiser=True)
    streamed = memory.read_bytes(counts["denoiser"], "nf4", dataclasses.replace(settings, quantized_as_read=True),
                                 denoiser=True)
    assert streamed == memory.held_bytes(counts["denoiser"], "nf4", settings) + 4 * largest < whole
    # the trainer's check knows FLUX.1's file loader quantizes as it reads
    from library.training.memory_check import memory_plan

    paths = [f"--{name}={files[name]}" for name in ("clip_l", "t5xxl", "ae")]
    config = parse_config([f"--pretrained_model_name_or_path={files['transformer']}", *paths,
                           f"--model_config={tiny_flux_dir}", f"--train_data_dir={tmp_path}",
                           f"--output_dir={tmp_path}", '--base_model_precision=nf4', "--mixed_precision=no"])[0]
    precision = BasePrecision.from_config(config, torch.float32)
    assert memory_plan(config, torch.device("cpu"), precision, torch.float32).settings.quantized_as_read


def memory_tensors(path):
    from safetensors.torch import load_file

    return list(load_file(path).values())


def test_a_run_that_cannot_fit_stops_before_loading_naming_what_fits(files, tiny_flux_dir, tmp_path):
    paths = [f"--{name}={files[name]}" for name in ("clip_l", "t5xxl", "ae")]
    config, _ = parse_config([f"--pretrained_model_name_or_path={files['transformer']}", *paths,
                              f"--model_config={tiny_flux_dir}", f"--train_data_dir={tmp_path}",
                              f"--output_dir={tmp_path / 'out'}", "--mixed_precision=bf16",
                              "--gradient_checkpointing"])
    where = (torch.device("cpu"), 1)  # the device and the processes sharing it
    precision = BasePrecision.from_config(config, torch.bfloat16)

    def need(kind):
        counts: dict[str, memory.Counts] = {}
        for path, part in memory.model_files(files["transformer"], {"text": [files["clip_l"], files["t5xxl"]],
                                                                     "vae": [files["ae"]]}):
            for name, found in memory.count_file(path, part).items():
                counts[name] = counts.get(name, memory.Counts()) + found
        return memory.estimate(counts, memory.Settings(kind, kind and "fp8", torch.bfloat16, torch.bfloat16,
                                                       config.network_dim, True)).total

    check_memory(config, *where, precision, torch.bfloat16, available=need(None) + 1)  # fits: no error
    limit = (need(None) + need("fp8")) / 2
    with pytest.raises(UserError) as refused:
        check_memory(config, *where, precision, torch.bfloat16, available=limit)
    text = "\n".join(refused.value.problems)
    assert "stopped before loading" in text
    assert 'base_model_precision = "fp8"' in text and 'base_model_precision = "nf4"' in text
    with pytest.raises(UserError, match="none of base_model_precision"):
        check_memory(config, *where, precision, torch.bfloat16, available=1.0)


def test_a_full_matrix_network_dim_counts_no_more_than_the_matrices(files):
    counts = {"denoiser": memory.count_file(files["transformer"], "denoiser")["denoiser"]}
    huge = memory.estimate(counts, memory.Settings(None, None, torch.bfloat16, torch.bfloat16, 100000, True))
    assert huge.parts["LoRA and optimizer"] == counts["denoiser"].matrices * 16


# --- FLUX.2 [dev] by phase ------------------------------------------------------------------------------------------

def flux2_dev_counts():
    """FLUX.2 [dev]'s components at full size, built on the meta device: the transformer of musubi's Flux2Params
    (8 double and 48 single blocks, 6144 wide, text width 3 x 5120, guidance input), Mistral Small 3.1's language
    model (what is loaded from musubi's text-encoder files) and FLUX.2's autoencoder; and the transformer."""
    from accelerate import init_empty_weights
    from diffusers import AutoencoderKLFlux2, Flux2Transformer2DModel
    from transformers import MistralConfig, MistralForCausalLM

    from library.families.flux2.mistral import TEXT_CONFIG

    with init_empty_weights():
        transformer = Flux2Transformer2DModel(
            patch_size=1, in_channels=128, num_layers=8, num_single_layers=48, attention_head_dim=128,
            num_attention_heads=48, joint_attention_dim=15360, timestep_guidance_channels=256, mlp_ratio=3.0,
            axes_dims_rope=(32, 32, 32, 32), guidance_embeds=True)
        parts = {"denoiser": transformer, "text": MistralForCausalLM(MistralConfig(**TEXT_CONFIG)),
                 "vae": AutoencoderKLFlux2()}
    counts = {}
    for name, model in parts.items():  # by their keys, as a file's header is counted
        counts[name] = memory.count_tensors(
            ((key, tuple(tensor.shape), "BF16") for key, tensor in model.state_dict().items()), name)[name]
    return counts, transformer


def test_flux2_dev_is_planned_by_phase_and_its_training_phase_fits_24_gib_with_fp8_or_nf4_and_block_swap():
    """32 B of transformer and 24 B of Mistral cannot share a 24 GiB card; each phase alone can: the text encoder
    (fp8) while its outputs are cached, then the transformer stored in fp8 or 4 bits with musubi's 29 blocks
    swapped (6 double and 44 single blocks: 85 % of its weights in host memory)."""
    from library.families.flux2.family import Flux2

    counts, transformer = flux2_dev_counts()
    assert 32.0e9 < counts["denoiser"].matrices + counts["denoiser"].other < 32.5e9
    assert 23.0e9 < counts["text"].matrices + counts["text"].other < 24.0e9
    share = memory.swapped_share(transformer, Flux2("dev").block_swap_plan(transformer, 29))
    assert 0.84 < share < 0.86
    budget = 24 * memory.GIB
    for base in ("fp8", "nf4"):
        settings = memory.Settings(base, "fp8", torch.bfloat16, torch.bfloat16, 32, True, swapped_fraction=share)
        planned = memory.phases(counts, settings)
        text, training = planned[memory.TEXT_PHASE], planned[memory.TRAINING_PHASE]
        assert set(text.parts) == {"text encoders", "VAE"}  # no transformer while encoding
        assert "text encoders" not in training.parts and "denoiser as stored" in training.parts
        assert text.total <= budget and training.total <= budget, memory.describe_phases(planned)
        assert training.parts["denoiser as stored"] == pytest.approx(
            memory.held_bytes(counts["denoiser"], base, settings) * (1 - share))
        assert memory.estimate(counts, settings).total > budget  # all at once it would not fit
    unswapped = memory.phases(counts, memory.Settings("fp8", "fp8", torch.bfloat16, torch.bfloat16, 32, True))
    assert unswapped[memory.TRAINING_PHASE].total > budget  # fp8 alone is 30 GiB of transformer
    bf16 = memory.phases(counts, memory.Settings(None, None, torch.bfloat16, torch.bfloat16, 32, True))
    assert bf16[memory.TEXT_PHASE].total > budget  # Mistral in bf16 is 44 GiB


def wan14b_counts():
    """Wan 2.1 T2V 14B's transformer (diffusers' WanTransformer3DModel with the released shapes, on the meta device)
    and UMT5-XXL, counted as a file of their keys would be."""
    from accelerate import init_empty_weights
    from diffusers import WanTransformer3DModel

    with init_empty_weights():
        transformer = WanTransformer3DModel(patch_size=(1, 2, 2), num_attention_heads=40, attention_head_dim=128,
                                            in_channels=16, out_channels=16, text_dim=4096, freq_dim=256,
                                            ffn_dim=13824, num_layers=40, cross_attn_norm=True,
                                            qk_norm="rms_norm_across_heads", eps=1e-6)
    state = [(key, tuple(tensor.shape), "BF16") for key, tensor in transformer.state_dict().items()]
    counts = memory.count_tensors(state, "denoiser")
    counts["text"] = memory.Counts(matrices=5_670_000_000)  # UMT5-XXL's encoder
    return counts, transformer


def test_wan_14b_video_counts_frames_times_tokens_and_fits_24_gib_by_phase_with_fp8_or_nf4_and_block_swap():
    from library.families.wan.family import Wan

    counts, transformer = wan14b_counts()
    denoiser = counts["denoiser"]
    assert 14.0e9 < denoiser.matrices + denoiser.other < 14.5e9
    assert (denoiser.blocks, denoiser.width) == (40, 5120)  # told from the keys
    share = memory.swapped_share(transformer, Wan().block_swap_plan(transformer, 20))
    assert 0.45 < share < 0.5
    budget = 24 * memory.GIB

    def training(base, frames, swapped=share, **more):
        tokens = (480 // 16) * (832 // 16) * ((frames - 1) // 4 + 1)  # 480 x 832, Wan's 4x temporal VAE
        settings = memory.Settings(base, "fp8", torch.bfloat16, torch.bfloat16, 32, True, swapped_fraction=swapped,
                                   tokens=tokens, **more)
        return sum(memory.phases(counts, settings)[memory.TRAINING_PHASE].parts.values())

    short, long = (memory.phases(counts, memory.Settings(
        "fp8", "fp8", torch.bfloat16, torch.bfloat16, 32, True, tokens=(480 // 16) * (832 // 16) * latent_frames))[
        memory.TRAINING_PHASE].parts["activations"] for latent_frames in (9, 21))
    assert long > 2 * short  # 81 frames' 21 latent frames against 33's 9
    for base in ("fp8", "nf4"):
        assert training(base, 33) <= budget
        assert training(base, 81) > budget  # 81 frames keep 40 block inputs of 335 MB
    # unless they wait on the host (cpu_offload_checkpointing, which kohya's rule keeps from block swap): with NF4
    assert training("nf4", 81, 0.0, offload_checkpoints=True) <= budget < training("fp8", 81, 0.0,
                                                                                       offload_checkpoints=True)
