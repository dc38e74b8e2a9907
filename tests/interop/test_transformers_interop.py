#!/usr/bin/env python3
"""Checkpoints travel between kmamba and Hugging Face transformers with the same logits.

    python3 tests/interop/test_transformers_interop.py --bin DIR   # DIR holds kmamba-train, kmamba-eval

For Mamba-1 and Mamba-2 at two small shapes each, both ways:
  transformers -> kmamba: a transformers model (random weights, every parameter perturbed so that no
      tensor keeps its structured initial value) saved with save_pretrained, evaluated by kmamba-eval;
  kmamba -> transformers: a model created and trained a few steps by kmamba-train (its own
      initialisation, rescale_prenorm_residual on), and the transformers model above fine-tuned a
      few steps by kmamba-train, each loaded with AutoModelForCausalLM.
Each pair of logits must agree to 2e-4 relative L2 (float32; transformers runs on the CPU, its
PyTorch path, kmamba on the build's default device). The Mamba-2 shapes have one B/C group: the
PyTorch path of some transformers versions normalises the gated norm over all channels, the official
kernels and kmamba per group (docs/algorithms.md §9).

Exits 77 (ctest's skip code) with a message when torch or transformers cannot be imported.
"""
import argparse
import os
import subprocess
import sys
import tempfile

TOLERANCE = 2e-4
SKIP = 77

# (mixer, kmamba-train options, the transformers config of the same shape)
SHAPES = [
    ("mamba1", {"d-model": 32, "n-layer": 2, "d-state": 8}, {"hidden_size": 32, "num_hidden_layers": 2, "state_size": 8}),
    ("mamba1", {"d-model": 48, "n-layer": 3, "d-state": 16, "expand": 1},
     {"hidden_size": 48, "num_hidden_layers": 3, "state_size": 16, "expand": 1}),
    ("mamba2", {"d-model": 64, "n-layer": 2, "d-state": 16, "headdim": 16, "chunk-size": 16},
     {"hidden_size": 64, "num_hidden_layers": 2, "state_size": 16, "head_dim": 16, "num_heads": 8, "n_groups": 1,
      "chunk_size": 16}),
    ("mamba2", {"d-model": 32, "n-layer": 3, "d-state": 32, "headdim": 8, "chunk-size": 8},
     {"hidden_size": 32, "num_hidden_layers": 3, "state_size": 32, "head_dim": 8, "num_heads": 8, "n_groups": 1,
      "chunk_size": 8}),
]
VOCAB = 64  # kmamba-train's recall vocabulary
BATCH, SEQLEN = 2, 40


def run(*command):
    result = subprocess.run(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    if result.returncode != 0:
        sys.exit(f"FAILED: {' '.join(command)} exited with {result.returncode}:\n{result.stdout}")


def kmamba_logits(bin_dir, model_dir, ids, work):
    save_file({"input_ids": ids}, os.path.join(work, "ids.safetensors"))
    out = os.path.join(work, "kmamba_logits.safetensors")
    run(os.path.join(bin_dir, "kmamba-eval"), "--model", model_dir, "--input", os.path.join(work, "ids.safetensors"),
        "--output", out)
    return load_file(out)["logits"]


def transformers_logits(model_dir, ids):
    model = AutoModelForCausalLM.from_pretrained(model_dir).float().eval()
    with torch.no_grad():
        return model(input_ids=ids, use_cache=False).logits


def compare(label, ours, theirs):
    theirs = theirs[..., : ours.shape[-1]]  # transformers also scores the padding rows of the vocabulary
    rel = ((ours.double() - theirs.double()).norm() / theirs.double().norm()).item()
    ok = rel <= TOLERANCE
    print(f"{label:<48} relative L2 {rel:.2e}  {'ok' if ok else 'FAIL'}")
    return ok


def transformers_to_kmamba(bin_dir, mixer, hf_shape, work):
    config_class = MambaConfig if mixer == "mamba1" else Mamba2Config
    torch.manual_seed(0)
    model = (MambaForCausalLM if mixer == "mamba1" else Mamba2ForCausalLM)(config_class(vocab_size=VOCAB, **hf_shape))
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    model.save_pretrained(work)  # model.safetensors and config.json
    ids = torch.randint(0, VOCAB, (BATCH, SEQLEN), dtype=torch.int64)
    return compare(f"transformers -> kmamba  {mixer} {hf_shape['hidden_size']}x{hf_shape['num_hidden_layers']}",
                   kmamba_logits(bin_dir, work, ids, work), transformers_logits(work, ids))


def kmamba_to_transformers(bin_dir, label, arguments, work):
    run(os.path.join(bin_dir, "kmamba-train"), "--steps", "20", "--batch-size", "4", "--seqlen", "32",
        "--eval-interval", "0", "--checkpoint-interval", "0", "--out", work, *arguments)
    checkpoint = os.path.join(work, "checkpoint")
    ids = torch.randint(0, VOCAB, (BATCH, SEQLEN), dtype=torch.int64)
    return compare(f"kmamba -> transformers  {label}", kmamba_logits(bin_dir, checkpoint, ids, work),
                   transformers_logits(checkpoint, ids))


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--bin", required=True, help="the directory holding kmamba-train and kmamba-eval")
    bin_dir = parser.parse_args().bin
    ok = True
    for mixer, options, hf_shape in SHAPES:
        shape = f"{mixer} {options['d-model']}x{options['n-layer']}"
        new_model = ["--mixer", mixer] + [f"--{name}={value}" for name, value in options.items()]
        with tempfile.TemporaryDirectory() as a, tempfile.TemporaryDirectory() as b, \
                tempfile.TemporaryDirectory() as c:
            ok = transformers_to_kmamba(bin_dir, mixer, hf_shape, a) and ok
            ok = kmamba_to_transformers(bin_dir, f"{shape} (new)", new_model, b) and ok
            ok = kmamba_to_transformers(bin_dir, f"{mixer} (the first one fine-tuned)", ["--model", a], c) and ok
    print(f"transformers {transformers.__version__}, torch {torch.__version__}: {'all within' if ok else 'FAILED'} "
          f"{TOLERANCE:.0e}")
    return 0 if ok else 1


if __name__ == "__main__":
    try:
        import torch
        import transformers
        from safetensors.torch import load_file, save_file
        from transformers import AutoModelForCausalLM, Mamba2Config, Mamba2ForCausalLM, MambaConfig, MambaForCausalLM
    except ImportError as error:
        print(f"SKIPPED: the transformers interop test needs torch, transformers and safetensors ({error})")
        sys.exit(SKIP)
    sys.exit(main())
