"""Kernel manifests (``pisa.ops.utils.kernel_cache``), ``pisa warmup``, the parallel first call."""
import inspect
import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from pisa.cli import main
from pisa.ops.utils import kernel_cache as kc
from pisa.warmup import parse_shape, warmup

CUDA = torch.cuda.is_available()


def test_call_key_names_what_decides_the_variants():
    q = torch.empty(2, 5, 32, 128, dtype=torch.bfloat16)
    assert kc.call_key("pisa_attn", q, 8, True) == "pisa_attn|bfloat16|32/8/128|grad"
    assert kc.call_key("kvcache", q.half(), 4, False) == "kvcache|float16|32/4/128|nograd"


def test_call_key_digests_the_knobs_but_not_the_scale():
    from dataclasses import replace

    from pisa.ops.utils.config import SelectConfig
    q = torch.empty(1, 1, 32, 128, dtype=torch.bfloat16)
    cfg = SelectConfig(scale=0.1)
    key = kc.call_key("pisa_attn", q, 8, True, cfg)
    assert key.startswith("pisa_attn|bfloat16|32/8/128|grad|") and key.count("|") == 4
    assert kc.call_key("pisa_attn", q, 8, True, replace(cfg, scale=0.3)) == key
    assert kc.call_key("pisa_attn", q, 8, True, replace(cfg, scorer="lse")) != key


def test_manifest_entries_fall_back_to_the_key_without_knobs(tmp_path, monkeypatch):
    """A manifest recorded before keys named the knobs serves every knob setting of its shape."""
    monkeypatch.setenv("PISA_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(kc, "SHIPPED", tmp_path / "none.json")
    monkeypatch.setattr(kc, "target", lambda: "t")
    monkeypatch.setattr(kc, "_manifests", None)
    a, b = {"kernel": "m:a", "spec": "{}"}, {"kernel": "m:b", "spec": "{}"}
    kc.write_manifest(kc.user_manifest(), {"t": {"e|bf16|1/1/64|grad": [a],
                                                 "e|bf16|1/1/64|grad|abc": [b]}})
    assert kc.manifest_entries("e|bf16|1/1/64|grad|abc") == [b]
    assert kc.manifest_entries("e|bf16|1/1/64|grad|xyz") == [a]
    assert kc.manifest_entries("e|bf16|1/1/64|nograd|abc") == []


def test_record_files_compiles_under_the_latest_call(monkeypatch):
    """The post-compile hook files each pisa kernel under this thread's latest call key (a
    backward's kernels under their forward's call) and ignores other kernels."""
    import triton
    from types import SimpleNamespace
    monkeypatch.setattr(kc, "target", lambda: "t")
    monkeypatch.setattr(kc, "_forget_compiled", lambda: None)
    into = {}

    def compiled(module, name):
        triton.knobs.runtime.jit_post_compile_hook(
            key="k", repr="r", fn=SimpleNamespace(module=module, name=name),
            compile={"specialization_data": name, "constants": {(3,): 16}},
            is_manual_warmup=False, already_compiled=False)

    with kc.record(into):
        kc._current.key = "call-1"
        compiled("pisa.ops.x", "_fwd")
        compiled("other.lib", "_k")
        compiled("pisa.ops.x", "_fwd")  # again: kept once
        kc._current.key = "call-2"
        compiled("pisa.ops.x", "_bwd")
    assert triton.knobs.runtime.jit_post_compile_hook is None
    assert into == {"t": {"call-1": [{"kernel": "pisa.ops.x:_fwd", "spec": "_fwd",
                                      "constants": [[[3], 16]]}],
                          "call-2": [{"kernel": "pisa.ops.x:_bwd", "spec": "_bwd",
                                      "constants": [[[3], 16]]}]}}


def test_record_files_a_backward_thread_s_compiles_under_the_latest_call(monkeypatch):
    """Autograd runs a CUDA backward in a thread of its own, which makes no pisa call: its
    kernels go under the latest call of any thread (the forward's)."""
    import threading

    import triton
    from types import SimpleNamespace
    monkeypatch.setattr(kc, "target", lambda: "t")
    monkeypatch.setattr(kc, "_forget_compiled", lambda: None)
    monkeypatch.delenv("PISA_PRECOMPILE", raising=False)
    into = {}
    q = torch.randn(1, 4, 8, 16)
    with kc.record(into):
        kc.precompile("pisa_attn", q, 2, True)

        def backward():
            triton.knobs.runtime.jit_post_compile_hook(
                key="k", repr="r", fn=SimpleNamespace(module="pisa.ops.x", name="_bwd"),
                compile={"specialization_data": "_bwd", "constants": {}},
                is_manual_warmup=False, already_compiled=False)
        thread = threading.Thread(target=backward)
        thread.start()
        thread.join()
    assert list(into["t"]) == [kc.call_key("pisa_attn", q, 2, True)]
    assert [e["kernel"] for e in into["t"][kc.call_key("pisa_attn", q, 2, True)]] \
        == ["pisa.ops.x:_bwd"]


def test_record_recompiles_at_each_new_call(monkeypatch):
    """While recording, a call of another key than the thread's previous one drops the compiled
    kernels, so that a variant an earlier call compiled is filed under this call too."""
    forgets = []
    monkeypatch.setattr(kc._current, "key", None, raising=False)  # an earlier test's call
    monkeypatch.setattr(kc, "_forget_compiled", lambda: forgets.append(1))
    monkeypatch.setattr(kc, "target", lambda: "t")
    monkeypatch.delenv("PISA_PRECOMPILE", raising=False)
    q = torch.randn(1, 4, 8, 16)
    with kc.record({}):
        n = len(forgets)  # record's own
        for grad in (True, True, False, False, True):
            kc.precompile("pisa_attn", q, 2, grad)
        assert len(forgets) - n == 3  # the first call, then each change of key
    kc._done.clear()


def test_precompile_stands_aside_while_recording(monkeypatch):
    """Inside ``record`` a call's kernels must compile at its own launches, in the thread whose
    latest call the hook files them under: a preload from an older manifest would compile them
    on the pool, unseen (the first re-record kept only the calls no manifest had)."""
    monkeypatch.setattr(kc, "_forget_compiled", lambda: None)
    monkeypatch.setattr(kc, "target", lambda: "t")
    monkeypatch.delenv("PISA_PRECOMPILE", raising=False)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    looked = []
    monkeypatch.setattr(kc, "manifest_entries", lambda key: looked.append(key) or [])
    q = torch.randn(1, 4, 8, 16)
    with kc.record({}):
        kc.precompile("pisa_attn", q, 2, True)
        assert looked == [] and kc._current.key == kc.call_key("pisa_attn", q, 2, True)
    kc._done.clear()
    kc.precompile("pisa_attn", q, 2, True)
    assert looked == [kc.call_key("pisa_attn", q, 2, True)]
    kc._done.clear()


def test_write_manifest_merges_without_duplicates(tmp_path):
    path = tmp_path / "sub" / "kernels.json"
    a = {"kernel": "pisa.ops.x:_k", "spec": "{}"}
    b = {"kernel": "pisa.ops.x:_j", "spec": "{}"}
    kc.write_manifest(path, {"t": {"key": [a]}})
    kc.write_manifest(path, {"t": {"key": [a, b]}, "u": {"other": [b]}})
    data = json.loads(path.read_text())
    assert data["version"] == kc.VERSION
    assert data["targets"] == {"t": {"key": [a, b]}, "u": {"other": [b]}}


def test_unreadable_or_foreign_manifests_are_ignored(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    assert kc._read(bad) == {}
    old = tmp_path / "old.json"
    old.write_text(json.dumps({"version": kc.VERSION + 1, "targets": {"t": {}}}))
    assert kc._read(old) == {}
    assert kc._read(tmp_path / "missing.json") == {}


def test_user_manifest_follows_pisa_cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("PISA_CACHE_DIR", str(tmp_path))
    assert kc.user_manifest() == tmp_path / "kernels.json"


def test_shipped_manifest_fits_the_kernels():
    """Every shipped entry names a pisa Triton kernel whose parameters are the recorded
    signature's: a kernel whose parameters changed needs `pisa warmup` again on a GPU."""
    targets = kc._read(kc.SHIPPED)
    if not kc.SHIPPED.exists():
        pytest.skip("no manifest shipped")
    assert targets, "kernels.json is shipped but unreadable"
    for keys in targets.values():
        for key, entries in keys.items():
            assert entries, key
            for e in entries:
                fn = kc._kernel(e["kernel"])  # a JITFunction, or under TRITON_INTERPRET=1
                params = list(inspect.signature(fn.fn).parameters.values())  # the interpreter's
                spec = json.loads(e["spec"])
                assert spec["name"] == e["kernel"].replace(":", "."), e["kernel"]
                assert list(spec["signature"]) == [p.name for p in params], e["kernel"]
                paths = [tuple(path) for path, _ in e["constants"]]
                constexprs = {(i,) for i, p in enumerate(params)
                              if "constexpr" in str(p.annotation)}
                # every constexpr parameter recorded (others: arguments Triton specialised, 1)
                assert constexprs <= set(paths), e["kernel"]
                for _, value in e["constants"]:
                    kc.decode(value)  # a NamedTuple bundle whose fields changed raises


def test_constexprs_round_trip_with_their_types():
    import triton.language as tl

    from pisa.ops.select.triton import Rows
    rows = Rows(*range(len(Rows._fields)))
    values = [rows, tl.bfloat16, tl.constexpr(7), (1, (True, None)), 3, False, 0.5, "x"]
    back = [kc.decode(json.loads(json.dumps(kc.encode(v)))) for v in values]
    assert type(back[0]) is Rows and back[0] == rows
    assert back[1] == tl.bfloat16 and isinstance(back[1], tl.dtype)
    assert isinstance(back[2], tl.constexpr) and back[2].value == 7
    assert back[3:] == values[3:]


@pytest.mark.parametrize("text, ok", [("32/8/128", (32, 8, 128)), ("9/3/64", (9, 3, 64)),
                                      ("32/7/128", None), ("32/8", None), ("a/b/c", None),
                                      ("0/1/64", None)])
def test_parse_shape(text, ok):
    if ok:
        assert parse_shape(text) == ok
    else:
        with pytest.raises(ValueError, match="shape"):
            parse_shape(text)


def test_warmup_refuses_bad_ops_and_devices():
    with pytest.raises(ValueError, match="ops"):
        warmup([(4, 2, 64)], ops=("serve",))
    if not CUDA:
        with pytest.raises(ValueError, match="device must be CUDA"):
            warmup([(4, 2, 64)], device="cpu")


def test_cli_warmup_bad_shape_is_a_usage_error(capsys):
    with pytest.raises(SystemExit) as e:
        main(["warmup", "--shape", "32/7/128", "--device", "cuda" if CUDA else "cpu"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "shape" in err or "device" in err


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
def test_gpu_manifest_compiles_the_first_call_ahead(tmp_path):
    """A process with an empty Triton cache and a `pisa warmup` manifest compiles every kernel
    of its first call in `precompile`: its launches compile nothing more, and its output equals a
    process's without the manifest."""
    script = textwrap.dedent("""
        import sys, torch, pisa
        from pisa.bench import triton_variants
        from pisa.ops.utils import kernel_cache
        g = torch.Generator(device="cuda").manual_seed(0)
        q, k, v = (torch.randn(1, 3000, h, 64, device="cuda", dtype=torch.bfloat16, generator=g)
                   .requires_grad_() for h in (8, 2, 2))
        from pisa.ops.utils.config import resolve_config
        kernel_cache.precompile("pisa_attn", q, 2, True, resolve_config(q, k, "triton"))
        n = triton_variants()
        o = pisa.pisa_attn(q, k, v)
        o.backward(torch.ones_like(o))
        print("NEW", triton_variants() - n, "PRE", n)
        torch.save([o.detach().cpu(), q.grad.cpu()], sys.argv[1])
    """)
    env = dict(os.environ, PISA_CACHE_DIR=str(tmp_path / "pisa"))
    run = lambda name, **extra: subprocess.run(  # noqa: E731
        [sys.executable, "-c", script, str(tmp_path / f"{name}.pt")], check=True, text=True,
        stdout=subprocess.PIPE, env=dict(env, TRITON_CACHE_DIR=str(tmp_path / name / "t"),
                                         **extra)).stdout
    subprocess.run([sys.executable, "-m", "pisa.cli", "warmup", "--shape", "8/2/64", "--ops",
                    "train", "--lengths", "3000"], check=True,
                   env=dict(env, TRITON_CACHE_DIR=str(tmp_path / "warm")))
    with_manifest = run("a")
    without = run("b", PISA_PRECOMPILE="0")
    new, pre = (int(x) for x in with_manifest.split()[1::2])
    assert pre > 0 and new == 0, with_manifest
    assert without.split()[1] != "0" and without.split()[3] == "0", without
    a, b = torch.load(tmp_path / "a.pt"), torch.load(tmp_path / "b.pt")
    assert all(torch.equal(x, y) for x, y in zip(a, b))


@pytest.mark.parametrize("op", ["train", "prefill", "decode", "varlen"])
def test_each_warmup_op_runs_its_calls(op, monkeypatch):
    """Each op's calls run (here on the CPU, torch backend) and reach the public function whose
    key ``warmup`` records them under."""
    import pisa.warmup as pw
    seen = []
    name, grad = {"train": ("pisa_attn", True), "prefill": ("pisa_attn", False),
                  "decode": ("pisa_attn_with_kvcache", None),
                  "varlen": ("pisa_attn_varlen", True)}[op]
    real = getattr(pw, name)
    monkeypatch.setattr(pw, name, lambda *a, **kw: seen.append(torch.is_grad_enabled())
                        or real(*a, **kw))
    pw.RUN[op](700, (4, 2, 32), torch.float32, "cpu", {"block_size": 16, "topk": 4})
    assert seen and all(g == grad or grad is None for g in seen)
