"""Fixtures: a real `kvtier serve` process per test module, and a small Llama built from a config
with a fixed seed (no weights can be downloaded here; it is still transformers' real attention)."""

import os
import pathlib
import subprocess
import sys

import pytest

os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["TRANSFORMERS_OFFLINE"] = "1"

HERE = pathlib.Path(__file__).resolve().parent


@pytest.fixture(scope="module")
def server():
    from kvtier.server import LocalServer

    with LocalServer(dram_capacity="1GiB") as srv:
        yield srv


def build_model(path, seed=0):
    """A 4-layer Llama (GQA: 8 query heads, 2 KV heads of 32) with a fixed seed, saved to `path`."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(
        vocab_size=512,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=2,
        head_dim=32,
        max_position_embeddings=4096,
        # A wider init than the default 0.02 gives peaked next-token distributions, so greedy
        # choices are not decided by rounding.
        initializer_range=0.1,
        tie_word_embeddings=False,
    )
    model = LlamaForCausalLM(cfg).eval()
    model.save_pretrained(path)
    return model


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("llama")
    build_model(path)
    return path


def run_engine(*args, timeout=300):
    """Runs `engine_proc.py` in a fresh interpreter; returns its stdout."""
    env = dict(os.environ)
    out = subprocess.run(
        [sys.executable, str(HERE / "engine_proc.py"), *map(str, args)],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
    )
    assert out.returncode == 0, f"engine process failed:\n{out.stdout}\n{out.stderr}"
    return out.stdout
