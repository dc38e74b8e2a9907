#!/usr/bin/env python3
"""kmamba against the official mamba_ssm kernels, on one GPU, in one run.

    perf/side_by_side.py --kmamba-perf BUILD/perf/kmamba-perf [--mamba-ssm DIR] [--json FILE]

Times the official Triton SSD (`mamba_chunk_scan_combined`: bf16 x, z, B, C; fp32 dt, A, D,
dt_bias; chunk 256, its default for Mamba-2) with `triton.testing.do_bench` medians, then runs
`kmamba-perf --case ssd` for the same shapes (its fp32 and bf16 rows), and prints one table:
case, shape, official time, kmamba time, kmamba / official. --mamba-ssm names a directory holding
the `mamba_ssm` package (a source checkout or an unpacked copy) when it is not installed. Needs
PyTorch, Triton and a CUDA GPU; the official package's compiled extensions are not needed.
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile

SHAPES = [(8, 4096), (1, 32768)]  # (batch, seqlen); 32 heads, headdim 64, d_state 128, 1 group
NHEADS, HEADDIM, DSTATE, NGROUPS, OFFICIAL_CHUNK = 32, 64, 128, 1, 256


def official_ssd(batch, seqlen):
    import torch
    from triton.testing import do_bench
    from mamba_ssm.ops.triton.ssd_combined import mamba_chunk_scan_combined

    torch.manual_seed(0)
    dev = "cuda"
    bf = torch.bfloat16
    x = torch.randn(batch, seqlen, NHEADS, HEADDIM, device=dev, dtype=bf)
    z = torch.randn(batch, seqlen, NHEADS, HEADDIM, device=dev, dtype=bf)
    B = torch.randn(batch, seqlen, NGROUPS, DSTATE, device=dev, dtype=bf)
    C = torch.randn(batch, seqlen, NGROUPS, DSTATE, device=dev, dtype=bf)
    dt = torch.randn(batch, seqlen, NHEADS, device=dev) * 0.5 - 2.0
    A = -torch.empty(NHEADS, device=dev).uniform_(1.0, 8.0)
    D = torch.randn(NHEADS, device=dev) * 0.1 + 1.0
    dt_bias = torch.randn(NHEADS, device=dev) * 0.1
    dout = torch.randn_like(x)

    def forward():
        return mamba_chunk_scan_combined(x, dt, A, B, C, OFFICIAL_CHUNK, D=D, z=z, dt_bias=dt_bias, dt_softplus=True)

    with torch.no_grad():
        fwd_ms = do_bench(forward, warmup=25, rep=100)
    leaves = [t.requires_grad_() for t in (x, z, B, C, dt)]

    def forward_backward():
        for t in leaves:
            t.grad = None
        forward().backward(dout)

    both_ms = do_bench(forward_backward, warmup=25, rep=100)
    return {"fwd": fwd_ms * 1e3, "fwd+bwd": both_ms * 1e3}


def kmamba_ssd(perf_binary):
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "kmamba.json")
        run = subprocess.run([perf_binary, "--space", "Cuda", "--case", "ssd", "--json", path],
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        print(run.stdout)
        if run.returncode != 0:
            sys.exit(f"side_by_side.py: {perf_binary} exited with {run.returncode}")
        with open(path) as f:
            return json.load(f)["rows"]


def kmamba_time(rows, name, batch, seqlen):
    prefix = f"b{batch} L{seqlen} "
    for row in rows:
        if row["case"] == name and row["shape"].startswith(prefix):
            return row["seconds"] * 1e6, row["shape"]
    return None, None


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kmamba-perf", required=True, help="path of the kmamba-perf binary (a CUDA build)")
    parser.add_argument("--mamba-ssm", help="directory that holds the mamba_ssm package, if it is not installed")
    parser.add_argument("--json", help="also write the table to this file")
    opts = parser.parse_args()
    if opts.mamba_ssm:
        sys.path.insert(0, opts.mamba_ssm)
    if not os.access(opts.kmamba_perf, os.X_OK):
        sys.exit(f"side_by_side.py: --kmamba-perf '{opts.kmamba_perf}' is not an executable file")

    official = {shape: official_ssd(*shape) for shape in SHAPES}
    rows = kmamba_ssd(opts.kmamba_perf)
    table = []
    for (batch, seqlen), times in official.items():
        for case in ("fwd", "fwd+bwd"):
            for precision in ("", " bf16"):
                ours, shape = kmamba_time(rows, f"ssd {case}{precision}", batch, seqlen)
                if ours is None:
                    continue
                table.append({"case": f"ssd {case}{precision}", "shape": shape,
                              "official_us": times[case], "kmamba_us": ours, "ratio": ours / times[case]})
    print(f"{'case':<20} {'kmamba shape':<40} {'official':>12} {'kmamba':>12} {'kmamba/official':>16}")
    for r in table:
        print(f"{r['case']:<20} {r['shape']:<40} {r['official_us']:>9.1f} us {r['kmamba_us']:>9.1f} us {r['ratio']:>15.2f}x")
    print(f"official: mamba_chunk_scan_combined, chunk {OFFICIAL_CHUNK}, bf16 x/z/B/C, fp32 dt/A; do_bench medians")
    if opts.json:
        with open(opts.json, "w") as f:
            json.dump({"official_chunk": OFFICIAL_CHUNK, "rows": table}, f, indent=1)


if __name__ == "__main__":
    main()
