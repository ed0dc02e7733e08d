"""The loss plot written next to a training run's metrics."""

from __future__ import annotations

from pathlib import Path


def plot_loss(steps: list[int], losses: list[float], path: str | Path, title: str = "fastft training loss") -> Path:
    """Draw training loss against step into a PNG file.

    Args:
        steps: Optimizer steps.
        losses: Loss at each step.
        path: The PNG file to write.
        title: Plot title.

    Returns:
        The written path.
    """
    import matplotlib

    matplotlib.use("Agg")  # no display on servers and CI
    import matplotlib.pyplot as plt

    figure, axis = plt.subplots(figsize=(7, 4), dpi=120)
    axis.plot(steps, losses, marker="o", markersize=2.5, linewidth=0.8, alpha=0.6, label="loss per step")
    window = max(1, len(losses) // 10)
    if window > 1:
        # Small-batch losses are noisy; a trailing mean shows the trend the noise hides.
        axis.plot(steps, _trailing_mean(losses, window), linewidth=2.0, label=f"mean of last {window}")
        axis.legend()
    axis.set_xlabel("step")
    axis.set_ylabel("training loss")
    axis.set_title(title)
    axis.grid(alpha=0.3)
    figure.tight_layout()
    figure.savefig(path)
    plt.close(figure)
    return Path(path)


def _trailing_mean(values: list[float], window: int) -> list[float]:
    means, total = [], 0.0
    for index, value in enumerate(values):
        total += value - (values[index - window] if index >= window else 0.0)
        means.append(total / min(index + 1, window))
    return means
