"""musubi-tuner's exclude_patterns / include_patterns network_args: parsing, and the layers they leave to each
musubi family (Wan here; the others in their own test files), by musubi's rule in networks/lora.py: full matches on
the original module names, left out when an exclude pattern matches and no include pattern does."""
from __future__ import annotations

import pytest
from diffusers import WanTransformer3DModel

from library.config.network_args import parse_network_args
from library.families.flux import lora as flux_lora
from library.families.wan import lora as wan_lora


def args(*values: str, module: str = "networks.lora_wan"):
    net, problems = parse_network_args(list(values), None, module)
    assert not problems, problems
    return net


def test_patterns_are_python_lists_of_regular_expressions_and_bad_ones_are_named():
    net = args("exclude_patterns=[r'.*']", "include_patterns=[r'.*cross_attn\\.(k|v)', '.*ffn.*']")
    assert net.exclude_patterns == (".*",) and net.include_patterns == (r".*cross_attn\.(k|v)", ".*ffn.*")
    _, problems = parse_network_args(["exclude_patterns=.*cross_attn.*", "include_patterns=['(unclosed']"], None,
                                     "networks.lora_wan")
    assert len(problems) == 2
    assert "exclude_patterns" in problems[0] and "list of regular expressions" in problems[0]
    assert "include_patterns" in problems[1] and "'(unclosed'" in problems[1]
    _, problems = parse_network_args(["exclude_patterns=[r'.*']"], None, "lycoris.kohya")
    assert problems and "preset" in problems[0]


@pytest.fixture(scope="module")
def transformer():
    return WanTransformer3DModel(patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=8, in_channels=4,
                                 out_channels=4, text_dim=8, freq_dim=16, ffn_dim=16, num_layers=3)


def test_wan_patterns_match_musubis_original_names_in_full(transformer):
    everything = wan_lora.targets(transformer, args())
    assert len(everything) == 3 * 10
    # musubi's docs: everything out, then the cross-attention's text projections back in
    kv = wan_lora.targets(transformer, args("exclude_patterns=[r'.*']", "include_patterns=[r'.*cross_attn\\.(k|v)']"))
    assert kv == [f"blocks.{i}.attn2.{name}" for i in range(3) for name in ("to_k", "to_v")]
    # a block range out; a pattern matched in part only ("cross_attn" alone) excludes nothing
    later = wan_lora.targets(transformer, args(r"exclude_patterns=['blocks\.[01]\..*', 'cross_attn']"))
    assert later == [name for name in everything if name.startswith("blocks.2.")]
    # include patterns alone bring nothing new: every layer is in already
    assert wan_lora.targets(transformer, args("include_patterns=['.*ffn.*']")) == everything
    with pytest.raises(ValueError, match="leave no Wan layer to train.*'blocks.0.self_attn.q'"):
        wan_lora.targets(transformer, args("exclude_patterns=['.*']"))


def test_families_trained_with_kohyas_modules_refuse_them():
    net = args("exclude_patterns=['.*single_blocks.*']", module="networks.lora_flux")
    with pytest.raises(ValueError, match="exclude_patterns: musubi-tuner's.*FLUX trains kohya's networks.lora_flux"):
        flux_lora.targets(None, 4, 4.0, net)
