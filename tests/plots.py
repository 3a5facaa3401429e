"""What a test asks of a plot it made: a PNG of a real figure's size with something drawn on
it (not a blank canvas), however small its file (``bench.common.save_figure`` keeps 256
colours)."""

from __future__ import annotations

from pathlib import Path


def drawn(path: Path, min_ink: float = 0.01) -> bool:
    """Whether ``path`` is a PNG of at least 400 x 150 pixels (a table's figure is short)
    with at least ``min_ink`` of its pixels not white and at least 8 colours (axes, text,
    the data)."""
    import numpy as np
    from PIL import Image

    with Image.open(path) as image:
        pixels = np.asarray(image.convert("RGB"))
    height, width, _ = pixels.shape
    ink = float((pixels != 255).any(axis=2).mean())
    colours = len(np.unique(pixels.reshape(-1, 3), axis=0))
    return width >= 400 and height >= 150 and ink >= min_ink and colours >= 8
