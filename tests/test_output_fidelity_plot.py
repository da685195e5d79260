"""The output-level fidelity plot draws a mean KL of 0 at 0: it drew it at a made-up 1e-6 on a log axis, a value no
row measured (the caption reads nats/token)."""

from __future__ import annotations

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402

from slake.quality.output_fidelity import draw_kl_vs_budget, plot_kl_vs_budget  # noqa: E402


def _row(method: str, budget: int, kl: float, tokens: int = 4) -> dict:
    return {"method": method, "budget": budget, "kind": "answer", "kl": kl, "tokens": tokens}


def _lines(rows: list[dict]):
    fig, ax = plt.subplots()
    try:
        draw_kl_vs_budget(rows, ax)
        return {ln.get_label(): list(ln.get_ydata()) for ln in ax.get_lines()}, ax.get_yscale()
    finally:
        plt.close(fig)


def test_a_mean_kl_of_zero_is_drawn_at_zero_on_a_symlog_axis():
    rows = [_row("snapkv", 64, 0.5), _row("snapkv", 128, 0.02), _row("snapkv", 4096, 0.0)]
    lines, scale = _lines(rows)
    assert lines["snapkv"] == [0.5, 0.02, 0.0]
    assert scale == "symlog"


def test_positive_means_keep_a_log_axis_and_a_nan_mean_is_left_out():
    rows = [_row("h2o", 64, 0.5), _row("h2o", 128, float("nan")), _row("h2o", 256, 0.1)]
    lines, scale = _lines(rows)
    assert lines["h2o"] == [0.5, 0.1]
    assert scale == "log"


def test_the_png_is_written(tmp_path):
    path = tmp_path / "kl.png"
    plot_kl_vs_budget([_row("tova", 64, 0.3), _row("tova", 128, 0.0)], str(path))
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_set_log_y_puts_zero_on_the_axis_and_ignores_nan():
    from slake.optional_plots import set_log_y

    fig, ax = plt.subplots()
    try:
        set_log_y(ax, [0.0, 0.25, float("nan"), 3.0])
        assert ax.get_yscale() == "symlog" and ax.yaxis.get_transform().linthresh == 0.25
        set_log_y(ax, [float("nan"), 0.25])
        assert ax.get_yscale() == "log"
        set_log_y(ax, [0.0])  # nothing positive: a linear segment of 1e-6
        assert ax.yaxis.get_transform().linthresh == 1e-6
    finally:
        plt.close(fig)


def test_the_per_layer_attention_plot_draws_an_error_of_zero_at_zero(tmp_path, monkeypatch):
    from slake.quality import fidelity

    scales = []
    real = plt.Axes.set_yscale
    monkeypatch.setattr(plt.Axes, "set_yscale", lambda ax, s, **kw: scales.append(s) or real(ax, s, **kw))
    rows = [
        {"method": "snapkv", "linear_cache": False, "budget": b, "layer": layer, "rel_err": err}
        for b, errs in ((64, (0.3, 0.1)), (4096, (0.0, 0.0)))
        for layer, err in enumerate(errs)
    ]
    fidelity.plot_per_layer(rows, str(tmp_path / "layers.png"))
    assert scales == ["symlog"]
