"""Small inline-SVG charts for the HTML run report: no plotting library, no external files.

Each function returns one `<svg>` element as a string. Coordinates: a plot area of `W` x `H`
pixels inside margins that hold the axes' labels.
"""
from __future__ import annotations

from collections.abc import Sequence
from html import escape

W, H = 760, 150  # plot area
ML, MR, MT, MB = 56, 16, 14, 30  # margins: left (y labels), right, top, bottom (x labels)
COLORS = {"running": "#2f6fb0", "waiting": "#f2a541", "held": "#9b59b6", "idle": "#d9d9d9", "loading": "#f1ecd9",
          "export": "#c0392b", "import": "#27ae60", "bar": "#2f6fb0", "error": "#c0392b",
          "line": "#16a085"}


def _frame(height: int, body: str, title: str, y_max: float, x_max: float, x_unit: str,
           y_label: str) -> str:
    w, h = ML + W + MR, MT + height + MB
    ticks = []
    for i in range(5):  # four gridlines plus the axis, labelled with their values
        y = MT + height - height * i / 4
        ticks.append(f'<line x1="{ML}" y1="{y:.1f}" x2="{ML + W}" y2="{y:.1f}" stroke="#ddd"/>'
                     f'<text x="{ML - 6}" y="{y + 4:.1f}" text-anchor="end">'
                     f'{_num(y_max * i / 4)}</text>')
        x = ML + W * i / 4
        ticks.append(f'<text x="{x:.1f}" y="{MT + height + 18}" text-anchor="middle">'
                     f'{_num(x_max * i / 4)}{x_unit}</text>')
    return (f'<svg xmlns="http://www.w3.org/2000/svg" width="{w}" height="{h}" '
            f'viewBox="0 0 {w} {h}" font-family="sans-serif" font-size="11">'
            f'<title>{escape(title)}</title>{"".join(ticks)}{body}'
            f'<text x="12" y="{MT + height / 2:.1f}" transform="rotate(-90 12 '
            f'{MT + height / 2:.1f})" text-anchor="middle">{escape(y_label)}</text></svg>')


def _num(v: float) -> str:
    if v >= 1000:
        return f"{v / 1000:.1f}k"
    return f"{v:.0f}" if v >= 10 or v == int(v) else f"{v:.1f}"


def timeline(series: Sequence[tuple[float, int, int, int]], idle: Sequence[tuple[float, float]],
             migrations: Sequence[tuple[float, str]], t_max: float, title: str,
             loading: float = 0.0) -> str:
    """One actor: stacked steps of running / waiting / held sequences over time (seconds from
    the start), a band until its first step (`loading`: building the engine), grey bands where
    it had nothing to do, a marker per migration."""
    t_max = max(t_max, 1e-6)
    y_max = max([r + w + h for _, r, w, h in series] + [1])

    def x(t: float) -> float:
        return ML + W * min(max(t / t_max, 0.0), 1.0)

    def y(v: float) -> float:
        return MT + H - H * v / y_max

    parts = [f'<rect x="{ML}" y="{MT}" width="{x(loading) - ML:.1f}" height="{H}" '
             f'fill="{COLORS["loading"]}"><title>starting {loading:.1f}s</title></rect>']
    parts += [f'<rect x="{x(a):.1f}" y="{MT}" width="{max(x(b) - x(a), 0.5):.1f}" height="{H}" '
              f'fill="{COLORS["idle"]}"><title>idle {b - a:.1f}s</title></rect>' for a, b in idle]
    for layer, color in (("held", COLORS["held"]), ("waiting", COLORS["waiting"]),
                         ("running", COLORS["running"])):
        top = {"running": lambda s: s[1], "waiting": lambda s: s[1] + s[2],
               "held": lambda s: s[1] + s[2] + s[3]}[layer]
        if not series:
            break
        pts = [f"{x(series[0][0]):.1f},{y(0):.1f}"]
        for i, s in enumerate(series):  # a step plot: each value holds until the next sample
            pts.append(f"{x(s[0]):.1f},{y(top(s)):.1f}")
            nxt = series[i + 1][0] if i + 1 < len(series) else s[0]
            pts.append(f"{x(nxt):.1f},{y(top(s)):.1f}")
        pts.append(f"{x(series[-1][0]):.1f},{y(0):.1f}")
        parts.append(f'<polygon points="{" ".join(pts)}" fill="{color}" fill-opacity="0.85">'
                     f'<title>{layer}</title></polygon>')
    for t, kind in migrations:
        cx, color = x(t), COLORS["export" if kind == "export" else "import"]
        tip, base = (MT + 10, MT) if kind == "export" else (MT, MT + 10)
        parts.append(f'<polygon points="{cx - 5:.1f},{base} {cx + 5:.1f},{base} {cx:.1f},{tip}" '
                     f'fill="{color}"><title>{kind} at {t:.1f}s</title></polygon>')
    return _frame(H, "".join(parts), title, y_max, t_max, "s", "sequences")


def line_chart(points: Sequence[tuple[float, float]], t_max: float, title: str,
               y_label: str) -> str:
    t_max = max(t_max, 1e-6)
    y_max = max([v for _, v in points] + [1e-6])
    pts = " ".join(f"{ML + W * t / t_max:.1f},{MT + H - H * v / y_max:.1f}" for t, v in points)
    body = f'<polyline points="{pts}" fill="none" stroke="{COLORS["line"]}" stroke-width="2"/>'
    return _frame(H, body, title, y_max, t_max, "s", y_label)


def histogram(values: Sequence[int], title: str, bins: int = 20) -> str:
    """Bars of how many values fall in each of `bins` equal ranges from 0 to the largest."""
    top = max(list(values) + [1])
    width = max(1, -(-(top + 1) // bins))
    counts = [0] * (top // width + 1)
    for v in values:
        counts[v // width] += 1
    y_max = max(counts + [1])
    bw = W / len(counts)
    body = "".join(
        f'<rect x="{ML + i * bw + 1:.1f}" y="{MT + H - H * c / y_max:.1f}" '
        f'width="{max(bw - 2, 1):.1f}" height="{H * c / y_max:.1f}" fill="{COLORS["bar"]}">'
        f'<title>{i * width}-{(i + 1) * width - 1} tokens: {c} rows</title></rect>'
        for i, c in enumerate(counts))
    return _frame(H, body, title, y_max, len(counts) * width, "", "rows")


def bars(items: Sequence[tuple[str, int]], title: str) -> str:
    """Horizontal bars with their labels (errors by kind); a note when there are none."""
    if not items:
        return (f'<svg xmlns="http://www.w3.org/2000/svg" width="{ML + W + MR}" height="40" '
                f'font-family="sans-serif" font-size="12"><title>{escape(title)}</title>'
                f'<text x="{ML}" y="24">no errors</text></svg>')
    row, label_w = 22, 330
    top = max(c for _, c in items)
    height = row * len(items) + 10
    body = "".join(
        f'<text x="{label_w - 6}" y="{5 + i * row + 15}" text-anchor="end">'
        f'{escape(k[:52])}</text><rect x="{label_w}" y="{5 + i * row + 4}" '
        f'width="{max((W + ML - label_w) * c / top, 2):.1f}" height="{row - 8}" '
        f'fill="{COLORS["error"]}"/><text x="{label_w + (W + ML - label_w) * c / top + 4:.1f}" '
        f'y="{5 + i * row + 15}">{c}</text>' for i, (k, c) in enumerate(items))
    return (f'<svg xmlns="http://www.w3.org/2000/svg" width="{ML + W + MR + 40}" '
            f'height="{height}" font-family="sans-serif" font-size="11">'
            f'<title>{escape(title)}</title>{body}</svg>')
