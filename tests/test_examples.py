"""The examples run as a user runs them (a subprocess each, at a tiny size) and do what their
docstrings say: ``train.py`` learns (its loss falls well under chance), ``train_cp.py`` learns with
the loss of single-process training at every step, ``serve.py``'s cached decode matches its
references. The three start together (two CPU cores): each test waits for its own."""
import importlib.util
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
# C = 4, topk = 6 (three forced blocks + three selected), T = 64 (16 blocks), period 10 > 2C:
# every copied token's source lies outside the forced previous / current blocks. Learns by
# step ~40 (37, 41, 39 for seeds 0, 1, 2).
TINY = ["--seqlen", "64", "--block-size", "4", "--topk", "6", "--period", "10", "--vocab", "16",
        "--batch", "8", "--width", "32", "--heads", "2", "--lr", "1e-2", "--steps", "50",
        "--log-every", "10", "--json"]
RUNS = {"train": ["train.py", *TINY],
        "train_cp": ["train_cp.py", *TINY, "--nproc", "2", "--cp", "2"],
        "serve": ["serve.py", "--prompt", "96", "--new", "8", "--chunk", "32", "--device", "cpu",
                  "--json"]}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """name -> (its started process, its output file): one torch thread each, as they share the
    cores; output to files, so that no pipe fills while another example is awaited."""
    out = tmp_path_factory.mktemp("examples")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    procs = {}
    for name, argv in RUNS.items():
        with open(out / f"{name}.log", "w") as log:
            procs[name] = (subprocess.Popen([sys.executable, str(EXAMPLES / argv[0]), *argv[1:]],
                                            stdout=log, stderr=subprocess.STDOUT, env=env),
                           out / f"{name}.log")
    yield procs
    for proc, _ in procs.values():
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def result(runs, name: str) -> dict:
    """The example's final JSON line, after checking that it exited cleanly."""
    proc, log = runs[name]
    proc.wait(timeout=300)
    text = log.read_text()
    assert proc.returncode == 0, f"{name} failed:\n{text}"
    return json.loads(text.strip().splitlines()[-1])


def test_train_learns_the_copy_through_selected_blocks(runs):
    r = result(runs, "train")
    chance = math.log(16)
    assert r["example"] == "train" and r["chance"] == pytest.approx(chance)
    assert r["losses"][0] > 0.9 * chance  # it starts at chance...
    assert r["learned_at"] is not None and r["final_loss"] < chance / 3  # ...and learns
    assert r["final_accuracy"] > 0.8
    assert r["found"] > 0.9  # the selection holds the source block (not forced: P > 2C)


def test_train_cp_learns_with_the_loss_of_single_process_training(runs):
    cp, single = result(runs, "train_cp"), result(runs, "train")
    assert cp["world"] == 2 and cp["cp"] == 2
    assert len(cp["losses"]) == len(single["losses"]) == 50
    for step, (a, b) in enumerate(zip(cp["losses"], single["losses"]), 1):
        assert a == pytest.approx(b, rel=1e-3), f"step {step}: cp {a} vs single {b}"
    assert cp["final_loss"] < math.log(16) / 3


def test_serve_decode_matches_prefill_and_the_default_cache(runs):
    r = result(runs, "serve")
    assert r["device"] == "cpu" and r["ok"]
    assert r["kernel_rel_err"] < 1e-5
    hf = importlib.util.find_spec("transformers") is not None  # the test extra has it
    assert r["hf"] == ({"tokens": 8, "same_tokens": 8} if hf else None)
