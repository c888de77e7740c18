"""The end-of-training chart: loss by timestep (training bins and validation timesteps), drawn with Pillow."""
from __future__ import annotations

import math
from pathlib import Path
from typing import Sequence

from PIL import Image, ImageDraw

from library.core.atomic import write_atomically

WIDTH, HEIGHT = 800, 480
LEFT, RIGHT, TOP, BOTTOM = 70, 20, 40, 50
TRAIN_COLOUR = (31, 119, 180)
VALIDATION_COLOUR = (214, 39, 40)
GRID = (225, 225, 225)
TEXT = (40, 40, 40)


def loss_by_timestep_chart(bins: Sequence[tuple[int, int, float]], validation: dict[int, float],
                           num_timesteps: int = 1000, title: str = "loss by timestep") -> Image.Image:
    """Training bins as steps, validation losses as points; the loss axis is logarithmic because the loss
    near t=0 and near t=T differ by orders of magnitude."""
    image = Image.new("RGB", (WIDTH, HEIGHT), "white")
    draw = ImageDraw.Draw(image)
    plot_w, plot_h = WIDTH - LEFT - RIGHT, HEIGHT - TOP - BOTTOM
    values = [v for *_, v in bins] + list(validation.values())
    values = [v for v in values if v > 0 and math.isfinite(v)]
    draw.text((LEFT, 12), title, fill=TEXT)
    if not values:
        draw.text((LEFT, TOP + plot_h // 2), "no losses recorded", fill=TEXT)
        return image
    low, high = math.floor(math.log10(min(values))), math.ceil(math.log10(max(values)))
    if high == low:
        high += 1

    def x(t: float) -> float:
        return LEFT + plot_w * t / num_timesteps

    def y(v: float) -> float:
        return TOP + plot_h * (high - math.log10(max(v, 10.0 ** low))) / (high - low)

    for decade in range(low, high + 1):
        draw.line([(LEFT, y(10.0 ** decade)), (LEFT + plot_w, y(10.0 ** decade))], fill=GRID)
        draw.text((8, y(10.0 ** decade) - 6), f"1e{decade}", fill=TEXT)
    for t in range(0, num_timesteps + 1, max(1, num_timesteps // 10)):
        draw.line([(x(t), TOP), (x(t), TOP + plot_h)], fill=GRID)
        draw.text((x(t) - 10, TOP + plot_h + 6), str(t), fill=TEXT)
    draw.rectangle([LEFT, TOP, LEFT + plot_w, TOP + plot_h], outline=TEXT)
    draw.text((LEFT + plot_w // 2 - 30, HEIGHT - 22), "timestep", fill=TEXT)

    for first, last, value in bins:
        if value > 0 and math.isfinite(value):
            draw.line([(x(first), y(value)), (x(last + 1), y(value))], fill=TRAIN_COLOUR, width=3)
    for t, value in sorted(validation.items()):
        if value > 0 and math.isfinite(value):
            cx, cy = x(t), y(value)
            draw.ellipse([cx - 5, cy - 5, cx + 5, cy + 5], fill=VALIDATION_COLOUR)

    legend_x = LEFT + plot_w - 190
    draw.line([(legend_x, 20), (legend_x + 24, 20)], fill=TRAIN_COLOUR, width=3)
    draw.text((legend_x + 30, 14), "training (bin mean)", fill=TEXT)
    if validation:
        draw.ellipse([legend_x + 7, 27, legend_x + 17, 37], fill=VALIDATION_COLOUR)
        draw.text((legend_x + 30, 27), "validation", fill=TEXT)
    return image


def save_png(image: Image.Image, path: Path) -> None:
    """Written beside and renamed, like every file a user keeps."""
    write_atomically(path, lambda tmp: image.save(tmp, format="PNG"))
