#!/usr/bin/env python3
"""Golden vectors for kvtier-kernels, from an independent reference: ml_dtypes + numpy (float32).

Usage: gen_golden.py --out DIR

Writes into DIR (all little-endian):

  scalar.f32      N f32 inputs: every fp16 and every bf16 bit pattern (as f32), every E4M3 and
                  E2M1 value and rounding midpoint and their f32 neighbours (±1 ulp), subnormals,
                  ±0, saturation edges, Inf/NaN, and random values over a wide exponent range.
  scalar.e4m3     N u8: float8_e4m3fn(clip(x, -448, 448))   (ml_dtypes' e4m3 cast does not saturate)
  scalar.e2m1     N u8: float4_e2m1fn(x)                     (saturating, round to nearest even)
  e4m3_values.f32 256 f32: every E4M3 code decoded
  e2m1_values.f32 16 f32: every E2M1 code decoded
  blocks.txt      one line per block case:
                  name dtype layers tokens heads head_dim order format scaling
  NAME.in         the input block in its dtype
  NAME.scales     expected f32 scales section
  NAME.bs         expected NVFP4 block scales (empty for FP8)
  NAME.codes      expected codes section
  NAME.out_{bf16,f16,f32}  expected decoded block in each dtype

The block cases re-implement, in numpy float32, the scale arithmetic written in
kernels/src/codec.rs; ml_dtypes does every narrow-format rounding.
"""

import argparse
import os
import re
import sys

HERE = os.path.dirname(os.path.abspath(__file__))


def check_versions():
    try:
        import ml_dtypes
        import numpy
    except ImportError as e:
        sys.exit(f"gen_golden.py: {e}. Install the pinned reference: "
                 f"python3 -m venv .venv && .venv/bin/pip install -r kernels/tests/golden/requirements.txt")
    pins = {}
    with open(os.path.join(HERE, "requirements.txt")) as f:
        for line in f:
            m = re.match(r"^\s*([A-Za-z0-9_.-]+)==([^\s#]+)", line)
            if m:
                pins[m.group(1).lower().replace("-", "_")] = m.group(2)
    have = {"ml_dtypes": ml_dtypes.__version__, "numpy": numpy.__version__}
    for name, want in pins.items():
        if have.get(name) != want:
            sys.exit(f"gen_golden.py: {name} {have.get(name)} is installed, requirements.txt pins {want}. "
                     f"Run: .venv/bin/pip install -r kernels/tests/golden/requirements.txt")


check_versions()

import ml_dtypes  # noqa: E402
import numpy as np  # noqa: E402

F8 = ml_dtypes.float8_e4m3fn
F4 = ml_dtypes.float4_e2m1fn
BF16 = ml_dtypes.bfloat16
f32 = np.float32
FLUSH = f32(2.0 ** -100)


def neighbours(v):
    v = np.asarray(v, dtype=np.float32)
    return np.concatenate([v, np.nextafter(v, f32(np.inf)), np.nextafter(v, f32(-np.inf))])


def scalar_cases():
    parts = []
    parts.append(np.arange(65536, dtype=np.uint16).view(np.float16).astype(np.float32))
    parts.append((np.arange(65536, dtype=np.uint32) << 16).view(np.float32))
    e4 = np.arange(256, dtype=np.uint8).view(F8).astype(np.float32)
    e4 = np.unique(np.abs(e4[np.isfinite(e4)]))
    mids = (e4[:-1] + e4[1:]) / f32(2)  # exact: neighbours differ in their last bit only
    parts += [neighbours(e4), neighbours(mids)]
    e2 = np.unique(np.abs(np.arange(16, dtype=np.uint8).view(F4).astype(np.float32)))
    parts += [neighbours(e2), neighbours((e2[:-1] + e2[1:]) / f32(2))]
    edges = np.array([448, 464, 480, 496, 1e6, 3.4028235e38, 6, 7, 2.0 ** -9, 2.0 ** -10, 2.0 ** -11,
                      3 * 2.0 ** -10, 2.0 ** -6, 1e-45, 1.1754942e-38, 0.0], dtype=np.float32)
    parts.append(neighbours(edges))
    rng = np.random.default_rng(20261101)
    mant = rng.random(200_000, dtype=np.float32) + f32(1)
    exp = rng.integers(-24, 12, 200_000).astype(np.float32)
    parts.append(mant * np.exp2(exp))
    pos = np.concatenate(parts).astype(np.float32)
    special = np.array([np.inf, np.nan], dtype=np.float32)
    return np.concatenate([pos, -pos, special, -special]).astype(np.float32)


def canon(s, bits):
    u = np.ascontiguousarray(s, dtype=np.float32).view(np.uint32).copy()
    mask = np.uint32((1 << (24 - bits)) - 1)
    nz = (u & mask) != 0
    u[nz] = (u[nz] | mask) + np.uint32(1)
    return u.view(np.float32)


def plane_of_rows(layers, tokens, heads, order):
    r = np.arange(2 * layers * tokens * heads)
    if order == "layer":
        return r // (tokens * heads)
    return (r // heads) % (2 * layers)


def encode_fp8(x, planes, nplanes, scaling):
    """x: [rows, hd] f32. Returns (scales f32 array, codes u8 [rows, hd], decoded f32)."""
    if scaling == "row":
        amax = np.abs(x).max(axis=1)
        s = np.where(amax < FLUSH, f32(0), canon(amax / f32(448), 20)).astype(np.float32)
        row_s = s
    else:
        amax = np.zeros(nplanes, dtype=np.float32)
        np.maximum.at(amax, planes, np.abs(x).max(axis=1))
        s = np.where(amax < FLUSH, f32(0), canon(amax / f32(448), 20)).astype(np.float32)
        row_s = s[planes]
    div = np.where(row_s == 0, f32(1), row_s).astype(np.float32)
    q = (x / div[:, None]).astype(np.float32)
    codes = np.clip(q, -448, 448).astype(F8).view(np.uint8)
    dec = (codes.view(F8).astype(np.float32) * row_s[:, None]).astype(np.float32)
    return s, codes, dec


def encode_nvfp4(x, planes, nplanes):
    rows, hd = x.shape
    nb = -(-hd // 16)
    amax = np.zeros(nplanes, dtype=np.float32)
    np.maximum.at(amax, planes, np.abs(x).max(axis=1))
    zero = amax < FLUSH
    safe = np.where(zero, f32(1), amax).astype(np.float32)
    g = np.where(zero, f32(0), canon(safe / f32(2688), 18)).astype(np.float32)
    enc = np.where(zero, f32(0), f32(2688) / safe).astype(np.float32)
    xp = np.zeros((rows, nb * 16), dtype=np.float32)
    xp[:, :hd] = x
    xb = xp.reshape(rows, nb, 16)
    amax_b = np.abs(xb).max(axis=2)
    t = ((amax_b / f32(6)).astype(np.float32) * enc[planes][:, None]).astype(np.float32)
    bs = np.clip(t, -448, 448).astype(F8).view(np.uint8)
    d = (bs.view(F8).astype(np.float32) * g[planes][:, None]).astype(np.float32)
    inv = np.where(d == 0, f32(0), f32(1) / np.where(d == 0, f32(1), d)).astype(np.float32)
    c = (xb * inv[:, :, None]).astype(np.float32).astype(F4).view(np.uint8).reshape(rows, nb * 16) & 0xF
    packed = (c[:, 0::2] | (c[:, 1::2] << 4)).astype(np.uint8)[:, : -(-hd // 2)]
    cdec = c[:, :hd].view(F4).astype(np.float32)
    dec = (cdec * np.repeat(d, 16, axis=1)[:, :hd]).astype(np.float32)
    return g, bs, packed, dec


def make_block(rng, dtype, layers, tokens, heads, hd, flavour):
    rows = 2 * layers * tokens * heads
    x = rng.standard_normal((rows, hd)).astype(np.float32)
    # 1% (at least one) outlier channels ×20, and rows spread over a wide range of magnitudes.
    ch = rng.choice(hd, max(1, hd // 100), replace=False)
    x[:, ch] *= f32(20)
    x *= np.exp2(rng.integers(-8, 8, rows)).astype(np.float32)[:, None]
    if flavour == "wide":
        x *= np.exp2(rng.integers(-60, 60, rows)).astype(np.float32)[:, None]
    x[3] = 0.0
    x[4] = -0.0
    x[5, : hd // 2] = 0.0
    x[6] *= f32(1e-3)
    if flavour == "zeroplane":
        x[: tokens * heads] = 0.0  # plane 0 in layer-first order
    if dtype == "bf16":
        x = x.astype(BF16)
        raw = x.view(np.uint16).tobytes()
        x = x.astype(np.float32)
    elif dtype == "fp16":
        x = np.clip(x, -60000, 60000).astype(np.float16)
        raw = x.view(np.uint16).tobytes()
        x = x.astype(np.float32)
    else:
        raw = x.tobytes()
    return x, raw


def outputs(dec):
    return {
        "bf16": dec.astype(BF16).view(np.uint16).tobytes(),
        "f16": np.clip(dec, -65504, 65504).astype(np.float16).view(np.uint16).tobytes(),
        "f32": dec.astype(np.float32).tobytes(),
    }


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    out = ap.parse_args().out
    os.makedirs(out, exist_ok=True)

    def write(name, data):
        with open(os.path.join(out, name), "wb") as f:
            f.write(data if isinstance(data, bytes) else np.ascontiguousarray(data).tobytes())

    with np.errstate(invalid="ignore", over="ignore"):
        xs = scalar_cases()
        write("scalar.f32", xs.astype("<f4"))
        write("scalar.e4m3", np.clip(xs, -448, 448).astype(F8).view(np.uint8))
        write("scalar.e2m1", xs.astype(F4).view(np.uint8))
    write("e4m3_values.f32", np.arange(256, dtype=np.uint8).view(F8).astype("<f4"))
    write("e2m1_values.f32", np.arange(16, dtype=np.uint8).view(F4).astype("<f4"))

    rng = np.random.default_rng(7)
    shapes = [
        # name, dtype, layers, tokens, heads, hd, order, flavour
        ("bf16_hd64", "bf16", 2, 7, 3, 64, "layer", "plain"),
        ("fp16_hd20_blockfirst", "fp16", 2, 5, 2, 20, "block", "plain"),
        ("fp32_hd128_wide", "fp32", 1, 9, 2, 128, "layer", "wide"),
        ("bf16_hd128_zeroplane", "bf16", 2, 4, 2, 128, "layer", "zeroplane"),
        ("fp32_hd7", "fp32", 1, 6, 2, 7, "block", "plain"),
    ]
    lines = []
    for name, dtype, layers, tokens, heads, hd, order, flavour in shapes:
        x, raw = make_block(rng, dtype, layers, tokens, heads, hd, flavour)
        planes = plane_of_rows(layers, tokens, heads, order)
        for fmt, scaling in [("fp8", "row"), ("fp8", "tensor"), ("nvfp4", "-")]:
            case = f"{name}_{fmt}_{scaling}".replace("_-", "")
            if fmt == "fp8":
                s, codes, dec = encode_fp8(x, planes, 2 * layers, scaling)
                bs = np.zeros(0, dtype=np.uint8)
            else:
                s, bs, codes, dec = encode_nvfp4(x, planes, 2 * layers)
            write(case + ".in", raw)
            write(case + ".scales", s.astype("<f4"))
            write(case + ".bs", bs)
            write(case + ".codes", codes)
            for k, v in outputs(dec).items():
                write(f"{case}.out_{k}", v)
            lines.append(f"{case} {dtype} {layers} {tokens} {heads} {hd} {order} {fmt} {scaling}")
    with open(os.path.join(out, "blocks.txt"), "w") as f:
        f.write("\n".join(lines) + "\n")
    print(f"wrote {len(xs)} scalar cases and {len(lines)} block cases to {out}")


if __name__ == "__main__":
    main()
