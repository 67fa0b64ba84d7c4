"""The benchmarks' pictures: PIL only (no plotting library to install), one chart frame shared by all of them.

Chart          a canvas with a title, a y axis with ticks, and value -> pixel mapping
ratio_picture  on/off ratio (median, min-max whiskers) against batch size or concurrency, a line at 1.0
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

#: Series colours, in order; the mixed-load bars use the first two for step and request.
COLOURS = ((46, 117, 182), (214, 96, 77), (84, 160, 84), (150, 100, 180), (200, 160, 40))


class Chart:
    """A white canvas with a title and a y axis from `low` to `high`; `y(value)` maps a value to its pixel row."""

    def __init__(
        self,
        width: int,
        height: int,
        title: str,
        *,
        low: float,
        high: float,
        left: int = 60,
        top: int = 40,
        bottom: int = 60,
        ticks: int = 4,
    ):
        from PIL import Image, ImageDraw

        self.image = Image.new("RGB", (width, height), "white")
        self.draw = ImageDraw.Draw(self.image)
        self.width, self.left, self.top, self.base = width, left, top, height - bottom
        self.low, self.high = low, high if high > low else low + 1.0
        self.draw.text((left, 8), title, fill="black")
        self.draw.line([(left, top), (left, self.base), (width - 10, self.base)], fill="black")
        for tick in range(ticks + 1):
            value = low + (self.high - low) * tick / ticks
            self.draw.text((4, self.y(value) - 6), f"{value:.2f}", fill="black")

    def y(self, value: float) -> float:
        return self.base - (self.base - self.top) * (value - self.low) / (self.high - self.low)

    def whisker(self, x: float, low: float, high: float) -> None:
        self.draw.line([(x, self.y(low)), (x, self.y(high))], fill="black", width=2)
        for value in (low, high):
            self.draw.line([(x - 4, self.y(value)), (x + 4, self.y(value))], fill="black", width=2)

    def legend(self, index: int, label: str, colour: tuple[int, int, int], *, width: int = 260) -> None:
        x, y = self.left + width * index, self.base + 30
        self.draw.rectangle([x, y, x + 12, y + 10], fill=colour)
        self.draw.text((x + 16, y), label, fill="black")

    def save(self, path: str) -> None:
        self.image.save(path, format="PNG")


def ratio_picture(
    path: str, *, title: str, x_label: str, series: Mapping[str, Sequence[tuple[int, Mapping[str, float]]]]
) -> None:
    """One line per series through (x, ratio median) points, min-max whiskers, a dashed line at 1.0 (parity).

    `series`: label -> [(x, {"min", "median", "max"}), ...]; x values are placed evenly, in sorted order.
    """
    xs = sorted({x for points in series.values() for x, _ in points})
    values = [v for points in series.values() for _, s in points for v in (s["min"], s["max"])]
    low, high = min([*values, 1.0]), max([*values, 1.0])
    pad = max(0.05, (high - low) * 0.1)
    chart = Chart(
        max(420, 140 + 90 * len(xs), 80 + 6 * len(title)), 380, title, low=max(0.0, low - pad), high=high + pad
    )
    span = chart.width - chart.left - 110
    step = span / (len(xs) - 1) if len(xs) > 1 else 0
    first = chart.left + 40 if len(xs) > 1 else chart.left + 40 + span / 2  # a single point: mid-axis
    column = {x: first + i * step for i, x in enumerate(xs)}
    for x0 in range(chart.left, chart.width - 10, 12):  # parity: on as fast as off
        chart.draw.line([(x0, chart.y(1.0)), (x0 + 6, chart.y(1.0))], fill=(120, 120, 120))
    chart.draw.text((chart.left + 4, chart.y(1.0) - 14), "1.0", fill=(120, 120, 120))
    for x in xs:
        chart.draw.text((column[x] - 6, chart.base + 6), str(x), fill="black")
    chart.draw.text((chart.width - 10 - 8 * len(x_label), chart.base + 16), x_label, fill="black")
    for index, (label, points) in enumerate(series.items()):
        colour = COLOURS[index % len(COLOURS)]
        offset = (index - (len(series) - 1) / 2) * 8  # whiskers of several series side by side, not on top
        placed = [(column[x] + offset, s) for x, s in sorted(points)]
        chart.draw.line([(px, chart.y(s["median"])) for px, s in placed], fill=colour, width=2)
        for px, s in placed:
            chart.whisker(px, s["min"], s["max"])
            chart.draw.ellipse([px - 4, chart.y(s["median"]) - 4, px + 4, chart.y(s["median"]) + 4], fill=colour)
            chart.draw.text((px + 6, chart.y(s["median"]) - 14), f"{s['median']:.2f}", fill=colour)
        chart.legend(index, label, colour, width=max(160, (chart.width - chart.left) // max(1, len(series))))
    chart.save(path)
