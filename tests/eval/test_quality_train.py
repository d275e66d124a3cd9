"""CPU smoke test of benchmarks/quality/quality_train.py: every arm trains a few steps and
evaluates (pisa through the torch backend), and the launcher merges its runs into the result
schema."""
import importlib.util
import itertools
import json
import math
import os
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "benchmarks" / "quality" / "quality_train.py"
TABLES = REPO / "benchmarks" / "quality" / "quality_tables.py"
ROW_KEYS = {"task", "arm", "K", "seed", "train_T", "test_T", "metric", "value", "steps",
            "schedule", "query_tile", "beam_leaf"}
TASK_ROWS = {"needle_single", "needle_multi", "assoc_recall", "var_track", "aggregate"}
# (query_tile, beam_leaf) each arm's rows carry: the defaults' 16-token tiles and level-2 beam
KNOBS = {"dense": (None, None), "pisa": (16, 32), "pisa_qt1": (1, None), "flat_mean": (1, None),
         "flat_lse": (1, None), "pisa_cmp": (16, 32), "pisa_cmp_win": (16, 32)}
TINY = ["--train-T", "512", "--test-T", "512", "--block-size", "16", "--width", "32", "--depth",
        "2", "--heads", "2", "--kv-heads", "1", "--mlp", "64", "--eval-examples", "2",
        "--lm-windows", "1", "--lm-past", "256", "--log-every", "1", "--threads", "1",
        "--device", "cpu", "--curriculum"]  # no curriculum: its default lengths exceed 512


def _script():
    spec = importlib.util.spec_from_file_location("quality_train", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def site(tmp_path_factory):
    """A small site-packages: a few torch and triton sources (the real ones take seconds)."""
    root = tmp_path_factory.mktemp("site")
    real = Path(torch.__file__).resolve().parent
    for pkg, n in (("torch", 6), ("triton", 2)):
        (root / pkg).mkdir()
        for i, f in enumerate(sorted(real.glob("*.py"))[:n]):
            (root / pkg / f"m{i}.py").write_bytes(f.read_bytes())
    return root


def check_rows(rows, arms, lengths, steps):
    assert rows
    for r in rows:
        assert set(r) == ROW_KEYS
        assert r["arm"] in arms and r["arm"] in KNOBS
        assert r["schedule"] in ("sparse", "warmup") and r["test_T"] in lengths
        assert r["metric"] == ("loss" if r["task"].startswith("lm") else "accuracy")
        assert math.isfinite(r["value"]) and r["steps"] == (steps or r["steps"]) > 0
        assert (r["K"] is None) == (r["arm"] == "dense")
        assert (r["query_tile"], r["beam_leaf"]) == KNOBS[r["arm"]]
        if r["metric"] == "accuracy":
            assert 0.0 <= r["value"] <= 1.0
        else:
            assert 0.0 < r["value"] < 10.0
    assert {r["task"] for r in rows} == TASK_ROWS | {"lm", "lm_past256"}


def check_beam_rows(result, beams, lengths):
    """pisa runs (both walks): every task re-evaluated at each wider beam, and past the training
    length with beams grown from it (``W`` None, ``beam_ref_len`` = train_T); other arms:
    none."""
    got = [r for r in result["beam_rows"] if r["W"] is not None]
    grown = [r for r in result["beam_rows"] if r["W"] is None]
    pisa = [r for r in result["rows"]
            if r["arm"].startswith("pisa") and r["metric"] == "accuracy"]
    assert len(got) == len(beams) * len(pisa)
    for r in got:
        assert set(r) == ROW_KEYS | {"W"} and r["arm"].startswith("pisa") and r["W"] in beams
        assert r["beam_leaf"] == (None if r["arm"] == "pisa_qt1" else 2 * r["W"])
        assert r["metric"] == "accuracy" and 0.0 <= r["value"] <= 1.0 and r["test_T"] in lengths
    assert {(r["task"], r["test_T"], r["seed"]) for r in got} == \
        {(r["task"], r["test_T"], r["seed"]) for r in pisa}
    for r in grown:
        assert set(r) == ROW_KEYS | {"W", "beam_ref_len"} and r["beam_ref_len"] == r["train_T"]
        assert r["metric"] == "accuracy" and 0.0 <= r["value"] <= 1.0
    assert {(r["task"], r["test_T"], r["seed"]) for r in grown} == \
        {(r["task"], r["test_T"], r["seed"]) for r in pisa if r["test_T"] > r["train_T"]}


@pytest.mark.parametrize("arm,schedule", [("dense", "sparse"), ("pisa", "sparse"),
                                          ("pisa", "warmup"), ("pisa_qt1", "sparse"),
                                          ("flat_mean", "sparse"), ("flat_lse", "sparse"),
                                          ("pisa_cmp", "sparse"), ("pisa_cmp_win", "warmup")])
def test_every_arm_trains_and_evaluates(arm, schedule, site, tmp_path):
    threads = torch.get_num_threads()
    try:
        rec = _script().main(["--run", "r", "--arm", arm, "--topk", "4", "--schedule", schedule,
                              "--steps", "3", "--site", str(site), "--out", str(tmp_path)]
                             + TINY)
    finally:
        torch.set_num_threads(threads)
    assert rec["status"] == "done" and rec["steps"] == 3 and len(rec["curve"]) == 3
    assert all(math.isfinite(p["loss"]) for p in rec["curve"])
    check_rows(rec["rows"], {arm}, {512}, 3)
    check_beam_rows(rec, {8, 16}, {512})
    assert json.loads((tmp_path / "r.json").read_text())["rows"] == rec["rows"]


def test_pisa_past_the_training_length_is_also_evaluated_with_grown_beams(site, tmp_path):
    """A test length past train_T: the pisa run's tasks there again with ``beam_ref_len`` =
    train_T (``--eval-grown``, the default), as beam rows with ``W`` None; ``--no-eval-grown``
    leaves them out."""
    threads = torch.get_num_threads()
    try:
        args = ["--run", "r", "--arm", "pisa", "--topk", "4", "--steps", "2", "--site",
                str(site), "--out", str(tmp_path)] + TINY + ["--test-T", "512", "1024",
                                                             "--eval-beams", "2"]
        rec = _script().main(args)
        off = _script().main(args + ["--no-eval-grown", "--run", "r2"])
    finally:
        torch.set_num_threads(threads)
    assert rec["status"] == "done"
    check_beam_rows(rec, {8}, {512, 1024})
    assert {r["test_T"] for r in rec["beam_rows"] if r["W"] is None} == {1024}
    assert all(r["W"] is not None for r in off["beam_rows"])


def test_a_curriculum_run_trains_at_each_length_then_evaluates(site, tmp_path):
    threads = torch.get_num_threads()
    try:
        rec = _script().main(["--run", "r", "--arm", "pisa", "--topk", "4", "--steps", "4",
                              "--site", str(site), "--out", str(tmp_path)]
                             + TINY + ["--curriculum", "256:0.5"])
    finally:
        torch.set_num_threads(threads)
    assert rec["status"] == "done" and rec["steps"] == 4
    assert [p["T"] for p in rec["curve"]] == [256, 256, 512, 512]
    assert all(math.isfinite(p["loss"]) for p in rec["curve"])
    check_rows(rec["rows"], {"pisa"}, {512}, 4)


def test_a_run_resumed_from_a_dense_stem_equals_the_run_trained_straight(site, tmp_path):
    """``--share-start``'s premise: while ``T <= K * C`` a sparse arm computes what the dense arm
    does, so training those steps with the dense arm, saving the state and resuming it with the
    sparse arm gives the run trained straight through, bitwise (CPU)."""
    threads = torch.get_num_threads()
    base = ["--topk", "16", "--steps", "4", "--site", str(site), "--out", str(tmp_path)] + \
        TINY + ["--curriculum", "256:0.5"]  # 16 * 16 = 256: the first half is dense
    state = tmp_path / "stem.pt"
    try:
        straight = _script().main(["--run", "straight", "--arm", "pisa"] + base)
        stem = _script().main(["--run", "stem", "--arm", "dense", "--stop-at", "2",
                               "--save-state", str(state)] + base)
        resumed = _script().main(["--run", "resumed", "--arm", "pisa", "--resume", str(state)]
                                 + base)
    finally:
        torch.set_num_threads(threads)
    assert stem["status"] == "stem saved" and stem["steps"] == 2 and not stem["rows"]
    assert resumed["status"] == "done" and resumed["steps"] == 4
    assert resumed["stem"]["steps"] == 2 and resumed["stem"]["file"] == "stem.pt"

    def strip(curve):
        return [{k: v for k, v in p.items() if k != "sec"} for p in curve]
    assert strip(resumed["curve"]) == strip(straight["curve"])
    assert [p["T"] for p in resumed["curve"]] == [256, 256, 512, 512]
    assert resumed["rows"] == straight["rows"] and resumed["beam_rows"] == straight["beam_rows"]


def test_stem_all_warm_starts_a_branch_arm_from_the_dense_stem(site, tmp_path):
    """``--stem-all``: an arm with parameters the dense stem lacks (pisa_cmp_win's gates) resumes
    it: the shared weights and their Adam moments are the stem's, the gates start fresh."""
    qt = _script()
    base = ["--topk", "16", "--steps", "4", "--site", str(site), "--out", str(tmp_path)] + \
        TINY + ["--curriculum", "256:0.5"]
    state = tmp_path / "stem.pt"
    threads = torch.get_num_threads()
    try:
        qt.main(["--run", "stem", "--arm", "dense", "--stop-at", "2", "--save-state",
                 str(state)] + base)
        resumed = qt.main(["--run", "resumed", "--arm", "pisa_cmp_win", "--resume", str(state)]
                          + base)
    finally:
        torch.set_num_threads(threads)
    assert resumed["status"] == "done" and resumed["steps"] == 4 and resumed["stem"]["steps"] == 2
    saved = torch.load(state, weights_only=False)
    args = qt.parse_args(["--arm", "pisa_cmp_win"] + base)
    model = qt._model(args)
    opt = qt._optimizer(model, args)
    qt.load_state(str(state), model, opt, torch.Generator(), {})
    stem_names = {n for group in saved["opt_names"] for n in group}
    fresh = [n for n, _ in model.named_parameters() if n not in stem_names]
    assert fresh and all("gate" in n for n in fresh)
    for name, p in model.named_parameters():
        if name in stem_names:
            assert torch.equal(p, saved["model"][name])
            i = [n for g in saved["opt_names"] for n in g].index(name)
            assert torch.equal(opt.state[p]["exp_avg"], saved["opt"]["state"][i]["exp_avg"])
        else:
            assert p not in opt.state
    assert [g["weight_decay"] for g in opt.param_groups] == [args.wd, 0.0]


def test_stem_flags_go_together(site):
    with pytest.raises(SystemExit):
        _script().parse_args(["--stop-at", "2", "--device", "cpu"])


def test_stem_steps_end_where_the_first_run_turns_sparse():
    qt = _script()
    args = qt.parse_args(["--train-T", "4096", "--curriculum", "256:0.6", "2048:0.2", "--steps",
                          "1000", "--device", "cpu"])
    runs = [{"K": None, "from_stem": True}, {"K": 16, "from_stem": True},
            {"K": 8, "from_stem": True}]
    assert qt.stem_steps(args, runs) == 600  # 2048 > 8 * 64 and > 16 * 64
    assert qt.stem_steps(args, runs[:1]) == 0  # no sparse run: nothing to share
    args.block_size = 128  # 16 * 128 = 2048: K = 8 (1024) still turns sparse at 2048
    assert qt.stem_steps(args, runs[:2]) == 800 and qt.stem_steps(args, runs) == 600
    args.share_start = False
    assert qt.stem_steps(args, runs) == 0
    args.share_start, args.steps = True, None  # steps set by calibration: no stem
    assert qt.stem_steps(args, runs) == 0
    args.steps = 1000  # a run that does not resume the stem (nsa) does not bound it
    assert qt.stem_steps(args, runs[:2] + [{"K": 8, "from_stem": False}]) == 800


@pytest.mark.slow  # ~25 s of subprocess launches: the benchmark launcher, not the library
def test_launcher_trains_the_shared_start_once_per_seed(site, tmp_path):
    """``--steps`` fixed: one dense stem per seed trains the dense start, every run of that
    seed resumes it; the merged result says so (``meta.stems``, each run's ``stem``). A second
    launch with the same settings and ``--stem-dir`` reuses the saved stem."""
    env = dict(os.environ, PYTHONPATH=str(REPO))
    stems = tmp_path / "stems"
    metas, rows = [], []
    for i in range(2):
        out = tmp_path / f"o{i}"
        cmd = [sys.executable, str(SCRIPT), "--launch", "--out", str(out), "--work",
               str(tmp_path / f"w{i}"), "--stem-dir", str(stems), "--arms", "dense", "pisa:16",
               "--warmup-arms", "--seeds", "0", "--sweep", "--steps", "4", "--site", str(site),
               "--time-budget", "100", "--eval-reserve", "30", "--merge-reserve", "5"] \
            + TINY + ["--curriculum", "256:0.5"]
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=150)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        result = json.loads((out / "quality_trained.json").read_text())
        metas.append(result["meta"])
        rows.append(result["rows"])
    meta = metas[0]
    assert [(s["name"], s["status"], s["steps"]) for s in meta["stems"]] == \
        [("stem_s0", "stem saved", 2)]
    for run in meta["runs"]:
        assert run["status"] == "done" and run["steps"] == 4 and run["stem"]["steps"] == 2
    assert meta["config"]["share_start"] is True
    assert metas[1]["stems"][0]["status"] == f"reused {stems / 'stem_s0.pt'}"
    assert rows[0] == rows[1]  # CPU: the reused stem gives the same runs


def test_train_batch_weights_each_part_equally(site):
    qt = _script()
    from pisa.eval.tasks import ByteCorpus
    data = ByteCorpus.from_site_packages(site).train
    tokens, weights, part = qt.train_batch(12, 512, torch.Generator().manual_seed(0), data)
    assert tokens.shape == (12, 512) and weights.shape == (12, 511)
    sums = torch.zeros(6, dtype=torch.float64).index_add_(0, part, weights.double().sum(1))
    torch.testing.assert_close(sums, torch.full((6,), 1 / 6, dtype=torch.float64))
    assert (weights[part > 0] > 0).sum() < (weights[part == 0] > 0).sum()  # answers only


def test_task_accuracy_is_exact_match_per_question(rng):
    qt = _script()
    args = qt.parse_args(["--device", "cpu", "--eval-examples", "3"])
    from pisa.eval.tasks import VOCAB_SIZE, make_task
    gen = torch.Generator().manual_seed(qt._eval_seed("assoc_recall", 1024))
    b = make_task("assoc_recall", 3, 1024, gen)

    class Oracle(torch.nn.Module):
        """Predicts every next token of the evaluation rows, but one answer token wrong."""
        def forward(self, ids):
            nxt = torch.cat([ids[:, 1:], ids[:, :1]], 1).clone()
            first = b.answer[0].nonzero()[0, 0]
            if torch.equal(ids[0], b.tokens[0]):
                nxt[0, first - 1] = (nxt[0, first - 1] + 1) % VOCAB_SIZE
            return torch.nn.functional.one_hot(nxt, VOCAB_SIZE).float()

    acc = qt.task_accuracy(Oracle(), "assoc_recall", 1024, args)
    assert acc == pytest.approx(1 - 1 / (3 * b.n_spans))


def test_plan_steps_shares_the_gpu_and_costs_each_phase_by_what_it_computes():
    qt = _script()
    runs = [{"name": n, "arm": n.split("_")[0], "schedule": n.split("_")[1], "dense_frac": f}
            for n, f in (("dense_sparse_s0", 1.0), ("b_sparse_s0", 0.5), ("b_warmup_s0", 0.75),
                         ("c_sparse_s0", 0.0))]
    paces = {"dense_sparse_s0": 1.0, "b_sparse_s0": 3.0, "b_warmup_s0": 1.5}  # c did not report
    # GPU cost per step = pace / 3 runs timed: dense 1/3; b half dense (1/3), half its own 1;
    # b warm-up 3/4 its own dense 1/2, 1/4 its sparse twin's 1; c the costliest, 1
    total = 1 / 3 + (0.5 / 3 + 0.5) + (0.75 * 0.5 + 0.25) + 1
    want = qt.CALIB_TO + int(qt.SAFETY * 100 / total)
    assert qt.plan_steps(runs, paces, 100.0) == want


def test_plan_steps_on_two_gpus_is_set_by_the_busier_one():
    qt = _script()
    runs = [{"name": n, "arm": "pisa", "schedule": "sparse", "dense_frac": 0.0}
            for n in ("a", "b", "c")]  # GPU 0: a, c; 1: b
    paces = {"a": 1.0, "b": 1.0, "c": 3.0}
    # costs: a 1/2, c 3/2 on GPU 0 (total 2); b 1/1 on GPU 1 (total 1)
    assert qt.plan_steps(runs, paces, 100.0, gpus=2) == qt.CALIB_TO + int(qt.SAFETY * 50)


def test_curriculum_keeps_tokens_per_step_and_ends_at_the_training_length():
    qt = _script()
    args = qt.parse_args(["--train-T", "4096", "--batch", "6", "--curriculum", "512:0.3",
                          "2048:0.2", "--device", "cpu"])
    assert args.phases == [(512, 0.3), (2048, 0.2)]
    got = [qt.length_at(step, 100, args) for step in (0, 29, 30, 49, 50, 99)]
    assert got == [(48, 512), (48, 512), (12, 2048), (12, 2048), (6, 4096), (6, 4096)]
    assert qt.length_at(0, None, args) == (6, 4096)  # step count not set yet: full length
    for bad in (["3000:0.3"], ["512:1.2"], ["512:0.6", "2048:0.5"], ["512"]):
        with pytest.raises(SystemExit):
            qt.parse_args(["--train-T", "4096", "--curriculum", *bad, "--device", "cpu"])


def test_warmup_runs_must_outlast_the_curriculum_phases_where_every_block_fits():
    qt = _script()
    args = qt.parse_args(["--train-T", "4096", "--curriculum", "256:0.6", "2048:0.2",
                          "--device", "cpu"])
    assert qt.dense_share(args.phases, 4096, 16 * 64) == 0.6  # 256 fits, 2048 does not
    assert qt.dense_share(args.phases, 4096, 4 * 64) == 0.6
    assert qt.dense_share(args.phases, 4096, 2 * 64) == 0.0
    assert qt.dense_share(args.phases, 4096, 64 * 64) == 1.0
    runs = {r["name"]: r for r in qt.plan(args)}  # default --warmup-frac 0.7 > 0.6
    assert {r["schedule"] for r in runs.values()} == {"sparse", "warmup"}
    assert runs["pisa16_sparse_s0"]["dense_frac"] == 0.6  # costed at the dense pace there
    assert runs["pisa16_warmup_s0"]["dense_frac"] == 0.7
    assert runs["pisa8_sparse_s0"]["dense_frac"] == 0.6  # 256 <= 8 * 64
    assert runs["dense_sparse_s0"]["dense_frac"] == 1.0
    args.warmup_frac = 0.5
    with pytest.raises(ValueError, match="would equal its sparse twin"):
        qt.plan(args)


@pytest.mark.slow  # ~70 s: the launcher runs on a wall-clock time budget
def test_launcher_calibrates_one_step_count_and_merges_runs_into_the_schema(site, tmp_path):
    """The GPU protocol on CPU: runs compile, wait for each other, time a few steps, get one
    step count from the launcher, train, evaluate; the launcher merges everything."""
    out, work = tmp_path / "out", tmp_path / "work"
    env = dict(os.environ, PYTHONPATH=str(REPO))
    cmd = [sys.executable, str(SCRIPT), "--launch", "--out", str(out), "--work", str(work),
           "--arms", "dense", "--warmup-arms", "pisa:4", "--seeds", "0", "--sweep", "2",
           "--site", str(site), "--time-budget", "70", "--eval-reserve", "12",
           "--merge-reserve", "5", "--lr", "2e-3"] + TINY
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert sorted(p.name for p in out.iterdir()) == ["quality_logs.tar.gz",
                                                     "quality_trained.json"]
    result = json.loads((out / "quality_trained.json").read_text())
    meta = result["meta"]
    assert {"device", "torch", "triton", "date", "command"} <= set(meta)
    steps = meta["calibration"]["steps"]  # how many depends on this machine's load
    assert steps > 10 and len(meta["calibration"]["sec_per_step"]) == 3
    for run in meta["runs"]:
        assert run["status"] == "done" and run["target_steps"] == steps
        assert 0 < run["steps"] <= steps
    check_rows(result["rows"], {"dense", "pisa"}, {512}, None)
    assert {(r["arm"], r["schedule"]) for r in result["rows"]} == {("dense", "sparse"),
                                                                   ("pisa", "warmup")}
    assert len(result["rows"]) == 2 * 7  # the sweep run stays out of the rows
    check_beam_rows(result, {8, 16}, {512})
    assert [s["lr"] for s in meta["lr_sweep"]] == [2e-3, 4e-3]
    with tarfile.open(out / "quality_logs.tar.gz") as tar:
        names = set(tar.getnames())
    assert {"quality_logs/launch.log", "quality_logs/pisa4_warmup_s0.log",
            "quality_logs/dense_lr0.004_s0.json"} <= names
    md, png = tmp_path / "q.md", tmp_path / "q.png"
    subprocess.run([sys.executable, str(TABLES),
                    str(out / "quality_trained.json"), "--md", str(md), "--png", str(png)],
                   check=True, capture_output=True, timeout=120)
    text = md.read_text()
    assert "## assoc_recall" in text and "## Where PISA loses" in text and "| 0.004 |" in text


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("arm,schedule", [("dense", "sparse"), ("pisa", "warmup"),
                                          ("flat_mean", "sparse"), ("flat_lse", "sparse"),
                                          ("pisa_cmp", "sparse"), ("pisa_cmp_win", "warmup")])
def test_every_arm_trains_on_gpu_at_the_suite_shapes(arm, schedule, tmp_path):
    """The suite's model and lengths on the GPU (bf16, Triton), a few steps: run this before
    spending the suite's minutes."""
    rec = _script().main(["--run", "g", "--arm", arm, "--topk", "16", "--schedule", schedule,
                          "--steps", "4", "--log-every", "2", "--test-T", "4096", "16384",
                          "--eval-examples", "4", "--lm-windows", "2", "--device", "cuda",
                          "--curriculum", "256:0.5", "--out", str(tmp_path)])
    assert rec["status"] == "done" and rec["steps"] == 4
    # a short phase (dense fast path: 4 blocks <= K), then the sparse kernels at 4096
    assert [p["T"] for p in rec["curve"]] == [256, 4096]
    assert all(math.isfinite(p["loss"]) for p in rec["curve"])
    for r in rec["rows"]:
        assert set(r) == ROW_KEYS and math.isfinite(r["value"])
    assert {r["test_T"] for r in rec["rows"]} == {4096, 16384}
    check_beam_rows(rec, {32, 64}, {4096, 16384})


def test_tables_pool_launches_and_show_wider_walks(tmp_path):
    """Two launches (different arms) render as one page; beam rows (wider and grown walks) get
    their own tables."""
    def launch(arms, date):
        rows, beam_rows = [], []
        for arm, seed, T in itertools.product(arms, (0, 1), (512, 1024)):
            base = {"arm": arm, "K": None if arm == "dense" else 4, "seed": seed,
                    "train_T": 512, "test_T": T, "steps": 10, "schedule": "sparse"}
            rows += [{"task": t, **base, "metric": "accuracy", "value": 0.5} for t in TASK_ROWS]
            rows.append({"task": "lm", **base, "metric": "loss", "value": 2.0})
            if arm == "pisa":
                beam_rows += [{"task": t, **base, "W": 8, "metric": "accuracy",
                               "value": 0.75} for t in TASK_ROWS]
                if T > 512:  # grown beams past the training length (--eval-grown)
                    beam_rows += [{"task": t, **base, "W": None, "beam_ref_len": 512,
                                   "metric": "accuracy", "value": 0.625} for t in TASK_ROWS]
        meta = {"device": "cpu", "torch": "x", "triton": "y", "date": date,
                "command": f"launch {date}", "config": {"train_T": 512},
                "runs": [{"name": a, "lr": 1e-3} for a in arms],
                "lr_sweep": [{"lr": 1e-3, "steps": 10, "lm_loss": 2.0,
                              "mean_task_accuracy": 0.5}]}
        return {"meta": meta, "rows": rows, "beam_rows": beam_rows}

    paths = []
    for i, arms in enumerate((["dense", "pisa"], ["flat_mean"])):
        paths.append(tmp_path / f"l{i}.json")
        paths[-1].write_text(json.dumps(launch(arms, f"d{i}")))
    md = tmp_path / "q.md"
    subprocess.run([sys.executable, str(TABLES),
                    *map(str, paths), "--md", str(md), "--png", ""],
                   check=True, capture_output=True, timeout=120)
    text = md.read_text()
    assert "Launches pooled on this page: `launch d0` (d0); `launch d1` (d1)" in text
    assert "## PISA with wider walks (same weights)" in text
    assert "| pisa K=4 W=8 | 0.750 ± 0.000 (n=2) | 0.750 ± 0.000 (n=2) |" in text
    assert "| pisa K=4 W=grown | - | 0.625 ± 0.000 (n=2) |" in text
    assert "| flat_mean K=4 | 0.500 ± 0.000 (n=2) | 0.500 ± 0.000 (n=2) |" in text
    assert "pisa K=4 W=8 ≥ flat_mean K=4 on every retrieval task beyond the training length: " \
           "PASS" in text
    assert "No sweep runs in this launch" in text


def _tables():
    spec = importlib.util.spec_from_file_location("quality_tables", TABLES)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_tables_pair_seeds_and_check_the_issue_bars():
    """LM gaps are also paired per seed (the runs of a seed share their start); the checks flag a
    learned task where pisa falls below dense's seed spread and a retrieval task at the training
    length where it falls below flat_mean."""
    qt = _tables()
    values = {  # (arm, task) -> value per seed 0, 1
        ("dense", "lm"): (2.0, 3.0), ("pisa", "lm"): (2.02, 3.09),
        ("flat_mean", "lm"): (2.1, 3.1),
        ("dense", "needle_single"): (1.0, 0.9), ("pisa", "needle_single"): (0.9, 0.9),
        ("flat_mean", "needle_single"): (0.8, 0.8),
        ("dense", "var_track"): (0.3, 0.3), ("pisa", "var_track"): (0.2, 0.2),
        ("flat_mean", "var_track"): (0.25, 0.25)}
    rows = [{"task": task, "arm": arm, "K": None if arm == "dense" else 4, "seed": seed,
             "train_T": 512, "test_T": 512, "steps": 10, "schedule": "sparse",
             "metric": "loss" if task == "lm" else "accuracy", "value": v}
            for (arm, task), vs in values.items() for seed, v in enumerate(vs)]
    res = qt.Results({"meta": {"config": {"train_T": 512}}, "rows": rows})
    mean, std, n = res.paired_gap("lm", ("pisa", 4, "sparse"), 512)
    assert (round(mean, 6), round(std, 6), n) == (2.0, round(2 ** 0.5, 6), 2)  # 1% and 3%
    text = "\n".join(qt.checks(res))
    # needle_single: 0.9 >= 0.95 - 0.0707; var_track 0.2 < 0.3 - 0
    assert "pisa K=4 within dense's seed spread at T=512 on every task dense learns " \
           "(needle_single, var_track): FAIL (var_track)" in text
    assert "pisa K=4 ≥ flat_mean K=4 on every retrieval task at T=512: FAIL (var_track)" in text
    assert "within 1% of dense: +2.20% FAIL (per seed: +2.00% ± 1.41)" in text
    assert "| +2.00% ± 1.41 |" in qt.lm_table(res, "lm")


def test_tables_take_some_arms_of_a_launch(tmp_path):
    """``FILE:arm,arm`` pools only those arms of a file (rows, beam rows, runs), and the page
    names the arms taken from each launch."""
    qt = _tables()

    def launch(name, arms):
        rows = [{"task": "lm", "arm": arm, "K": None if arm == "dense" else 4, "seed": 0,
                 "train_T": 512, "test_T": 512, "steps": 10, "schedule": "sparse",
                 "metric": "loss", "value": 2.0} for arm in arms]
        meta = {"command": f"launch {name}", "date": name, "config": {"train_T": 512},
                "device": "cpu", "torch": "t", "triton": "tr",
                "runs": [{"arm": arm, "name": f"{arm}_s0", "lr": 1e-3, "steps": 10,
                          "target_steps": 10, "train_seconds": 1.0, "eval_seconds": 1.0,
                          "status": "done"} for arm in arms]}
        path = tmp_path / f"{name}.json"
        path.write_text(json.dumps({"meta": meta, "rows": rows, "beam_rows": [
            dict(rows[-1], W=8)]}))
        return str(path)
    a, b = launch("a", ["dense", "nsa"]), launch("b", ["nsa"])
    got = qt.read([f"{a}:dense", b])
    assert [[r["arm"] for r in x["rows"]] for x in got] == [["dense"], ["nsa"]]
    assert [len(x["beam_rows"]) for x in got] == [0, 1]
    assert [r["arm"] for r in got[0]["meta"]["runs"]] == ["dense"]
    pooled = qt.pool(got)
    assert [m.get("arms") for m in pooled["meta"]["launches"]] == [["dense"], None]
    text = qt.markdown(qt.Results(pooled), None)
    assert "(a; arms taken: dense)" in text and "(b)" in text


def test_tables_check_the_nsa_bar_on_lm_and_every_retrieval_cell():
    """Issue 26's peer bar: a PISA arm at least NSA's on LM loss at the training length and on
    every retrieval task at every length; the failing cells are named."""
    qt = _tables()
    values = {("dense", "lm", 512): 2.0, ("pisa", "lm", 512): 2.012, ("nsa", "lm", 512): 2.02,
              ("dense", "needle_single", 512): 0.9, ("pisa", "needle_single", 512): 0.8,
              ("nsa", "needle_single", 512): 0.7, ("pisa", "needle_single", 1024): 0.1,
              ("nsa", "needle_single", 1024): 0.3}
    rows = [{"task": task, "arm": arm, "K": None if arm == "dense" else 4, "seed": 0,
             "train_T": 512, "test_T": T, "steps": 10, "schedule": "sparse",
             "metric": "loss" if task == "lm" else "accuracy", "value": v}
            for (arm, task, T), v in values.items()]
    res = qt.Results({"meta": {"config": {"train_T": 512}}, "rows": rows})
    text = "\n".join(qt.checks(res))
    assert "pisa K=4 ≥ nsa K=4 on LM loss at T=512 and on every retrieval task at every " \
           "length (issue 26): FAIL (needle_single@1024)" in text
    assert "+0.60% PASS (per seed: +0.60% ± 0.00); within 0.5% (issue 26): FAIL" in text
    rows = [dict(r, value=2.03) if (r["arm"], r["task"]) == ("pisa", "lm") else r for r in rows
            if r["test_T"] == 512]
    text = "\n".join(qt.checks(qt.Results({"meta": {"config": {"train_T": 512}}, "rows": rows})))
    assert "(issue 26): FAIL (lm@512)" in text
