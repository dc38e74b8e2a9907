#!/usr/bin/env python3
"""kmamba against the official mamba_ssm kernels, on one GPU, in one run.

    perf/side_by_side.py --kmamba-perf BUILD/perf/kmamba-perf [--mamba-ssm DIR] [--json FILE] [--kernels ssd,mamba3_siso]
                         [--kmamba-perf-train BUILD/perf/kmamba-perf-train [--train-mixers mamba2,mamba3]]

Times the official Triton SSD (`mamba_chunk_scan_combined`: bf16 x, z, B, C; fp32 dt, A, D,
dt_bias; chunk 256, its default for Mamba-2) with `triton.testing.do_bench` medians, then runs
`kmamba-perf --case ssd` for the same shapes (its bf16 rows; --kmamba-precision all adds fp32 and tf32), and prints one table:
case, shape, official time, kmamba time, kmamba / official. --mamba-ssm names a directory holding
the `mamba_ssm` package (a source checkout or an unpacked copy) when it is not installed. It also
times the official Mamba-3 SISO op (`mamba3_siso_combined`, with D and z) against
`kmamba-perf --case mamba3_siso` at that case's shape. Needs
PyTorch, Triton and a CUDA GPU; the official package's compiled extensions are not needed.

With --kmamba-perf-train it also times one training step of the 130m shape (d_model 768, 24
layers, vocabulary 50277, tied head; batch 8 x 2048 tokens) both ways: the official
`MambaLMHeadModel` (Mamba2 or Mamba3 SISO layers, fp32 weights under bf16 autocast, fused
add+norm, AdamW with fused=True, gradient clipping at 1.0), median of CUDA-event-timed steps, and
`kmamba-perf-train --precision bf16` (Mamba-2 at chunk 64, the chunk of its fused bf16 kernels;
Mamba-3 at its preset's 64).
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile

SHAPES = [(8, 4096), (1, 32768)]  # (batch, seqlen); 32 heads, headdim 64, d_state 128, 1 group
NHEADS, HEADDIM, DSTATE, NGROUPS, OFFICIAL_CHUNK = 32, 64, 128, 1, 256


def time_forward_backward(forward, inputs, dout):
    """do_bench medians (µs) of forward() without gradients and of forward().backward(dout) with
    gradients of `inputs`."""
    import torch
    from triton.testing import do_bench

    with torch.no_grad():
        fwd_ms = do_bench(forward, warmup=25, rep=100)
    leaves = [t.requires_grad_() for t in inputs]

    def forward_backward():
        for t in leaves:
            t.grad = None
        forward().backward(dout)

    both_ms = do_bench(forward_backward, warmup=25, rep=100)
    return {"fwd": fwd_ms * 1e3, "fwd+bwd": both_ms * 1e3}


def official_ssd(batch, seqlen):
    import torch
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

    return time_forward_backward(forward, (x, z, B, C, dt), dout)


# kmamba-perf's Mamba-3 SISO case: 32 heads, headdim 64, d_state 128, 16 angles, 1 group, chunk 64.
M3_BATCH, M3_SEQLEN, M3_NHEADS, M3_HEADDIM, M3_DSTATE, M3_NANGLES, M3_CHUNK = 8, 4096, 32, 64, 128, 16, 64


def official_mamba3_siso():
    """The official mamba3_siso_combined (Triton) at kmamba-perf's shape, with D and z: bf16 q, k, v,
    z (as the module passes them), fp32 adt, dt, trap, biases, angles and D."""
    import torch
    from mamba_ssm.ops.triton.mamba3.mamba3_siso_combined import mamba3_siso_combined

    torch.manual_seed(0)
    dev, bf = "cuda", torch.bfloat16
    b, L, H, P, N, S = M3_BATCH, M3_SEQLEN, M3_NHEADS, M3_HEADDIM, M3_DSTATE, M3_NANGLES
    q = torch.randn(b, L, 1, N, device=dev, dtype=bf) * 0.1
    k = torch.randn(b, L, 1, N, device=dev, dtype=bf) * 0.1
    v = torch.randn(b, L, H, P, device=dev, dtype=bf)
    z = torch.randn(b, L, H, P, device=dev, dtype=bf)
    adt = -torch.empty(b, H, L, device=dev).uniform_(0.001, 0.2)
    dt = torch.empty(b, H, L, device=dev).uniform_(0.001, 0.1)
    trap = torch.randn(b, H, L, device=dev)
    q_bias = torch.randn(H, N, device=dev) * 0.1
    k_bias = torch.randn(H, N, device=dev) * 0.1
    angles = torch.randn(b, L, H, S, device=dev)
    D = torch.randn(H, device=dev) * 0.1 + 1.0
    dout = torch.randn_like(v)

    def forward():
        return mamba3_siso_combined(q, k, v, adt, dt, trap, q_bias, k_bias, angles, D=D, Z=z, chunk_size=M3_CHUNK)

    return time_forward_backward(forward, (q, k, v, z, adt, dt, trap, q_bias, k_bias, angles, D), dout)


TRAIN_BATCH, TRAIN_SEQLEN, TRAIN_STEPS = 8, 2048, 10


def official_train_step(mixer):
    import torch
    from mamba_ssm.models.config_mamba import MambaConfig
    from mamba_ssm.models.mixer_seq_simple import MambaLMHeadModel

    torch.manual_seed(0)
    layer = {"mamba2": {"layer": "Mamba2", "use_mem_eff_path": False},
             "mamba3": {"layer": "Mamba3"}}[mixer]
    config = MambaConfig(d_model=768, n_layer=24, vocab_size=50277, ssm_cfg=layer, rms_norm=True,
                         residual_in_fp32=True, fused_add_norm=True, pad_vocab_size_multiple=16)
    model = MambaLMHeadModel(config, device="cuda", dtype=torch.float32)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    tokens = torch.randint(0, 50277, (TRAIN_BATCH, TRAIN_SEQLEN + 1), device="cuda")

    def step():
        optimizer.zero_grad(set_to_none=True)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            logits = model(tokens[:, :-1]).logits
        loss = torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), tokens[:, 1:].flatten())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()

    for _ in range(3):
        step()
    times = []
    for _ in range(TRAIN_STEPS):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        step()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    times.sort()
    del model, optimizer
    torch.cuda.empty_cache()
    return times[len(times) // 2] * 1e3


def kmamba_train_step(train_binary, mixer):
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "train.json")
        command = [train_binary, "--space", "Cuda", "--mixer", mixer, "--precision", "bf16",
                   "--batch", str(TRAIN_BATCH), "--seqlen", str(TRAIN_SEQLEN), "--json", path]
        if mixer == "mamba2":
            command += ["--chunk", "64"]
        run = subprocess.run(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        print(run.stdout)
        if run.returncode != 0:
            sys.exit(f"side_by_side.py: {train_binary} exited with {run.returncode}")
        with open(path) as f:
            return json.load(f)["step_ms"] * 1e3


def kmamba_rows(perf_binary, case, precision):
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "kmamba.json")
        run = subprocess.run([perf_binary, "--space", "Cuda", "--case", case, "--precision", precision, "--json", path],
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
    parser.add_argument("--kmamba-perf-train", help="path of kmamba-perf-train: also compare a training step")
    parser.add_argument("--train-mixers", default="mamba2,mamba3", help="the training steps' mixers (comma-separated)")
    parser.add_argument("--kernels", default="ssd,mamba3_siso",
                        help="the kernel comparisons to run (comma-separated, of ssd and mamba3_siso; empty: none). "
                             "The official Mamba-3 kernel's first Triton compile takes minutes on a fresh machine")
    parser.add_argument("--kmamba-precision", default="bf16",
                        help="kmamba-perf's --precision for the kernel rows: bf16 (the official kernels' operands; "
                             "default), fp32, tf32 or all")
    opts = parser.parse_args()
    if opts.mamba_ssm:
        sys.path.insert(0, opts.mamba_ssm)
    if not os.access(opts.kmamba_perf, os.X_OK):
        sys.exit(f"side_by_side.py: --kmamba-perf '{opts.kmamba_perf}' is not an executable file")

    kernels = [k for k in opts.kernels.split(",") if k]
    unknown = [k for k in kernels if k not in ("ssd", "mamba3_siso")]
    if unknown:
        sys.exit(f"side_by_side.py: --kernels '{opts.kernels}': unknown {', '.join(unknown)} (expected ssd, mamba3_siso)")
    table = []
    if "ssd" in kernels:
        official = {}
        for shape in SHAPES:
            official[shape] = official_ssd(*shape)
            print(f"official SSD b{shape[0]} L{shape[1]}: fwd {official[shape]['fwd']:.1f} us, "
                  f"fwd+bwd {official[shape]['fwd+bwd']:.1f} us", flush=True)
        rows = kmamba_rows(opts.kmamba_perf, "ssd", opts.kmamba_precision)
        for (batch, seqlen), times in official.items():
            for case in ("fwd", "fwd+bwd"):
                for precision in ("", " bf16"):
                    ours, shape = kmamba_time(rows, f"ssd {case}{precision}", batch, seqlen)
                    if ours is None:
                        continue
                    table.append({"case": f"ssd {case}{precision}", "shape": shape,
                                  "official_us": times[case], "kmamba_us": ours, "ratio": ours / times[case]})
    if "mamba3_siso" in kernels:
        official_m3 = official_mamba3_siso()
        print(f"official Mamba-3 SISO: fwd {official_m3['fwd']:.1f} us, fwd+bwd {official_m3['fwd+bwd']:.1f} us", flush=True)
        rows = kmamba_rows(opts.kmamba_perf, "mamba3_siso", opts.kmamba_precision)
        for case in ("fwd", "fwd+bwd"):
            for precision in ("", " bf16"):
                ours, shape = kmamba_time(rows, f"mamba3 siso {case}{precision}", M3_BATCH, M3_SEQLEN)
                if ours is not None:
                    table.append({"case": f"mamba3 siso {case}{precision}", "shape": shape,
                                  "official_us": official_m3[case], "kmamba_us": ours,
                                  "ratio": ours / official_m3[case]})
    if opts.kmamba_perf_train:
        for mixer in opts.train_mixers.split(","):
            try:
                official_us = official_train_step(mixer)
            except Exception as error:  # an official module that cannot run here (a missing extension)
                print(f"side_by_side.py: the official {mixer} training step failed: {error!r}")
                official_us = float("nan")
            print(f"official training step {mixer}: {official_us / 1e3:.1f} ms", flush=True)
            ours = kmamba_train_step(opts.kmamba_perf_train, mixer)
            table.append({"case": f"train step {mixer}", "shape": f"130m b{TRAIN_BATCH} L{TRAIN_SEQLEN} bf16",
                          "official_us": official_us, "kmamba_us": ours, "ratio": ours / official_us})
    print(f"{'case':<24} {'kmamba shape':<40} {'official':>12} {'kmamba':>12} {'kmamba/official':>16}")
    for r in table:
        print(f"{r['case']:<24} {r['shape']:<40} {r['official_us']:>9.1f} us {r['kmamba_us']:>9.1f} us {r['ratio']:>15.2f}x")
    print(f"official: mamba_chunk_scan_combined, chunk {OFFICIAL_CHUNK}, bf16 x/z/B/C, fp32 dt/A; do_bench medians")
    print(f"official: mamba3_siso_combined, chunk {M3_CHUNK}, bf16 q/k/v/z, fp32 adt/dt/trap/angles; do_bench medians")
    if opts.kmamba_perf_train:
        print("official training steps: MambaLMHeadModel under bf16 autocast + fused AdamW; medians of "
              f"{TRAIN_STEPS} CUDA-event-timed steps")
    if opts.json:
        with open(opts.json, "w") as f:
            json.dump({"official_chunk": OFFICIAL_CHUNK, "rows": table}, f, indent=1)


if __name__ == "__main__":
    main()
