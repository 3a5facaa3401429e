"""``bench.common.save_figure``: committed plots as 256-colour PNGs, a third of
matplotlib's own size, with the figure still there (``tests.plots.drawn``)."""

from __future__ import annotations

from pathlib import Path

from bench.common import save_figure
from tests.plots import drawn


def test_a_saved_figure_keeps_its_lines_in_fewer_bytes(tmp_path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from PIL import Image

    fig, ax = plt.subplots(figsize=(7, 4))
    for k in range(4):
        ax.plot(range(200), [((i * (k + 3)) % 37) / 37 for i in range(200)], label=f"k={k}")
    ax.legend()
    ax.set(xlabel="step", ylabel="level")
    full = tmp_path / "full.png"
    fig.savefig(full, dpi=120)
    small = save_figure(fig, tmp_path / "small.png")
    plt.close(fig)
    with Image.open(small) as image, Image.open(full) as original:
        assert image.mode == "P" and image.size == original.size
    assert small.stat().st_size < 0.6 * full.stat().st_size
    assert drawn(small) and drawn(full)

    blank, _ = plt.subplots(figsize=(7, 4))
    blank.gca().axis("off")
    empty = save_figure(blank, tmp_path / "empty.png")
    plt.close(blank)
    assert not drawn(empty)
