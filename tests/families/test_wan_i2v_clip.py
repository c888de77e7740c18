"""musubi-tuner's clip file for Wan 2.1 I2V: the official open-clip XLM-RoBERTa ViT-H/14 visual tower (and ComfyUI's
clip_vision_h, transformers' names) converted to the CLIPVisionModel WanImageToVideoPipeline uses. The reference is
the tower computed from the official layout's own meaning (torch only: a pre-norm ViT whose `to_qkv` stacks q, k, v,
exact GELU, the class token first, post_norm and `head` for the image embedding)."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import save_file

from library.config import UserError
from library.families.wan import clip as wan_clip

WIDTH, HEADS, LAYERS, MLP, PATCH, GRID, OUT = 160, 2, 3, 96, 14, 2, 24  # heads of 80, as ViT-H/14's


def official_tower(seed: int = 0) -> dict[str, torch.Tensor]:
    """A tiny random state dict in the official file's layout, with a text tower the conversion leaves alone."""
    g = torch.Generator().manual_seed(seed)

    def rand(*shape: int, scale: float = 0.05) -> torch.Tensor:
        return torch.randn(*shape, generator=g) * scale

    state = {"visual.patch_embedding.weight": rand(WIDTH, 3, PATCH, PATCH), "visual.cls_embedding": rand(1, 1, WIDTH),
             "visual.pos_embedding": rand(1, GRID * GRID + 1, WIDTH), "visual.head": rand(WIDTH, OUT),
             "textual.token_embedding.weight": rand(11, 8), "log_scale": torch.tensor(4.6)}
    for norm in ("pre_norm", "post_norm"):
        state[f"visual.{norm}.weight"], state[f"visual.{norm}.bias"] = 1 + rand(WIDTH), rand(WIDTH)
    for i in range(LAYERS):
        block = f"visual.transformer.{i}."
        for norm in ("norm1", "norm2"):
            state[f"{block}{norm}.weight"], state[f"{block}{norm}.bias"] = 1 + rand(WIDTH), rand(WIDTH)
        for name, (out, inp) in {"attn.to_qkv": (3 * WIDTH, WIDTH), "attn.proj": (WIDTH, WIDTH), "mlp.0": (MLP, WIDTH),
                                 "mlp.2": (WIDTH, MLP)}.items():
            state[f"{block}{name}.weight"], state[f"{block}{name}.bias"] = rand(out, inp), rand(out)
    return state


def reference(state: dict[str, torch.Tensor], pixels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(the hidden states after all blocks but the last, as Wan's `visual(..., use_31_block=True)`; the image
    embedding post_norm(class token) @ head), from the official layout."""
    def norm(x: torch.Tensor, name: str) -> torch.Tensor:
        return F.layer_norm(x, (WIDTH,), state[f"{name}.weight"], state[f"{name}.bias"], 1e-5)

    def linear(x: torch.Tensor, name: str) -> torch.Tensor:
        return F.linear(x, state[f"{name}.weight"], state[f"{name}.bias"])

    b = pixels.shape[0]
    x = F.conv2d(pixels, state["visual.patch_embedding.weight"], stride=PATCH).flatten(2).transpose(1, 2)
    x = torch.cat([state["visual.cls_embedding"].expand(b, -1, -1), x], dim=1) + state["visual.pos_embedding"]
    x = norm(x, "visual.pre_norm")
    outputs = []
    for i in range(LAYERS):
        block = f"visual.transformer.{i}."
        q, k, v = linear(norm(x, block + "norm1"), block + "attn.to_qkv").view(b, -1, 3, HEADS, WIDTH // HEADS
                                                                                 ).unbind(2)
        attended = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))
        x = x + linear(attended.transpose(1, 2).reshape(b, -1, WIDTH), block + "attn.proj")
        x = x + linear(F.gelu(linear(norm(x, block + "norm2"), block + "mlp.0")), block + "mlp.2")
        outputs.append(x)
    return outputs[-2], norm(outputs[-1][:, 0], "visual.post_norm") @ state["visual.head"]


def test_the_official_tower_converts_to_clipvisionmodel_with_the_same_embeddings(tmp_path):
    from transformers import CLIPVisionModelWithProjection

    state = official_tower()
    path = tmp_path / "models_clip_open-clip-xlm-roberta-tiny.pth"
    torch.save(state, path)
    assert wan_clip.clip_file_problems(path) == []
    encoder, processor = wan_clip.load_clip_vision(path, torch.float32, None)
    assert (encoder.config.hidden_size, encoder.config.num_attention_heads, encoder.config.num_hidden_layers,
            encoder.config.image_size, encoder.config.hidden_act) == (WIDTH, HEADS, LAYERS, PATCH * GRID, "gelu")
    assert processor.crop_size == {"height": PATCH * GRID, "width": PATCH * GRID}
    pixels = torch.randn(2, 3, PATCH * GRID, PATCH * GRID, generator=torch.Generator().manual_seed(1))
    penultimate, embedding = reference(state, pixels)
    with torch.no_grad():
        ours = encoder(pixel_values=pixels, output_hidden_states=True).hidden_states[-2]
        tower = wan_clip.vision_state_dict(state)
        projected = CLIPVisionModelWithProjection(encoder.config)
        projected.vision_model.load_state_dict(encoder.state_dict())
        projected.visual_projection.weight.copy_(tower[wan_clip.PROJECTION])
        image_embeds = projected(pixel_values=pixels).image_embeds
    torch.testing.assert_close(ours, penultimate, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(image_embeds, embedding, rtol=1e-5, atol=1e-5)
    assert not torch.allclose(penultimate, reference(official_tower(1), pixels)[0], atol=1e-3)  # the weights matter
    # the text tower is not part of it, and the official layout comes back from the converted names
    assert not any(k.startswith("textual") for k in tower)
    back = wan_clip.wan_state_dict(tower)
    assert back.keys() == {k for k in state if k.startswith("visual.")}
    assert all(torch.equal(back[k], state[k]) for k in back)


def test_comfyuis_clip_vision_h_layout_reads_as_the_same_model(tmp_path):
    state = official_tower()
    official = tmp_path / "official.pth"
    torch.save(state, official)
    tower = wan_clip.vision_state_dict(state)
    comfy = tmp_path / "clip_vision_h.safetensors"
    save_file({("" if k == wan_clip.PROJECTION else "vision_model.") + k: v.clone() for k, v in tower.items()},
              str(comfy))
    assert wan_clip.layout(wan_clip.tensor_shapes(comfy)) == "transformers"
    one, _ = wan_clip.load_clip_vision(official, torch.float32, None)
    two, _ = wan_clip.load_clip_vision(comfy, torch.float32, None)
    assert one.state_dict().keys() == two.state_dict().keys()
    assert all(torch.equal(v, two.state_dict()[k]) for k, v in one.state_dict().items())


def test_a_file_of_another_layout_or_width_is_named(tmp_path):
    other = tmp_path / "umt5.safetensors"
    save_file({"shared.weight": torch.zeros(4, 4)}, str(other))
    assert "not a CLIP vision file" in wan_clip.clip_file_problems(other)[0]
    assert "no such file" in wan_clip.clip_file_problems(tmp_path / "missing.pth")[0]
    pickled = tmp_path / "pickled.pth"
    torch.save({"weights": object()}, pickled)
    assert "cannot be read" in wan_clip.clip_file_problems(pickled)[0]
    narrow = official_tower()
    narrow["visual.patch_embedding.weight"] = torch.zeros(48, 3, PATCH, PATCH)
    with pytest.raises(UserError, match="ViT-H"):
        wan_clip.vision_config(wan_clip.vision_state_dict(narrow), None, "narrow.pth")
