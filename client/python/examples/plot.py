"""A reward curve for a terminal (text) and for a file (PNG), with nothing but the standard library."""

import struct
import zlib


def text_plot(values, height=10, lo=0.0, hi=1.0) -> str:
    """One column per value, `height` rows from hi (top) to lo (bottom)."""
    rows = []
    for r in range(height, -1, -1):
        level = lo + (hi - lo) * r / height
        cells = "".join("*" if round((v - lo) / (hi - lo) * height) == r else " " for v in values)
        rows.append(f"{level:5.2f} |{cells}")
    rows.append("      +" + "-" * len(values))
    last = f"step {len(values)}"
    rows.append("       1" + last.rjust(max(len(last) + 1, len(values) - 1)))
    return "\n".join(rows)


def write_png(path, values, width=640, height=360, lo=0.0, hi=1.0) -> None:
    """A line chart of `values` (dark blue on white, grey grid at every 0.1) as an RGB PNG."""
    pixels = [[(255, 255, 255)] * width for _ in range(height)]
    margin = 20

    def xy(i, v):
        x = margin + (width - 2 * margin) * i / max(1, len(values) - 1)
        y = height - margin - (height - 2 * margin) * (v - lo) / (hi - lo)
        return x, y

    for tenth in range(11):
        _, y = xy(0, lo + (hi - lo) * tenth / 10)
        for x in range(margin, width - margin):
            pixels[int(round(y))][x] = (210, 210, 210)
    for i in range(len(values) - 1):
        (x0, y0), (x1, y1) = xy(i, values[i]), xy(i + 1, values[i + 1])
        n = int(max(abs(x1 - x0), abs(y1 - y0))) + 1
        for k in range(n + 1):
            x, y = x0 + (x1 - x0) * k / n, y0 + (y1 - y0) * k / n
            for dx in (-1, 0, 1):
                for dy in (-1, 0, 1):
                    px, py = int(round(x)) + dx, int(round(y)) + dy
                    if 0 <= px < width and 0 <= py < height:
                        pixels[py][px] = (20, 60, 160)
    raw = b"".join(b"\x00" + bytes(c for p in row for c in p) for row in pixels)

    def chunk(kind, data):
        body = kind + data
        return struct.pack(">I", len(data)) + body + struct.pack(">I", zlib.crc32(body))

    with open(path, "wb") as f:
        f.write(b"\x89PNG\r\n\x1a\n")
        f.write(chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)))
        f.write(chunk(b"IDAT", zlib.compress(raw, 9)))
        f.write(chunk(b"IEND", b""))
