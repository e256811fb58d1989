"""bench/bench_sglang.py with ``--candidate kvcached`` (bench/_sglang_reference.py), on the CPU.

Its arguments, a kvcached engine's environment, the probe of what kvcached patched, kvcached's
segment as the driver reads it, and, end to end in real processes, an engine child whose "SGLang"
spawns its "scheduler" the way SGLang does (multiprocessing's spawn): kvcached's site must be
added, and its .pth hook run, in both. SGLang and kvcached are stood in for by small packages this
test writes (a ``sglang`` whose ``Engine`` spawns a process, a ``kvcached_autopatch.pth`` whose
hook binds ``Elastic*`` classes to SGLang's names, and the few lines of ``wrapt.importer`` it
uses), so nothing here needs either installed.
"""

from __future__ import annotations

import json
import pathlib
import struct
import subprocess
import sys
import textwrap
import time
import types

import pytest

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "bench"))

import _sglang_reference as ref
import _vllm_reference as vllm_reference
import bench_sglang


def test_arguments_default_to_kvasync(tmp_path: pathlib.Path) -> None:
    args = bench_sglang.parse_args(["--out", str(tmp_path)])
    assert args.candidate == "kvasync"
    assert args.modes == ["identity", "release"]
    assert args.two_variants == ["shared", "static-kvasync", "static-stock"]
    assert not bench_sglang.plans_kvcached(args)


def test_stock_capacity_is_sglangs_cell_size_per_model(tmp_path: pathlib.Path) -> None:
    """Stock's ``max_total_tokens`` is the KV budget in SGLang's bytes a token of the model run:
    the 1B's 32 KiB, the 8B's 128 KiB (K and V of 8 heads, 32 layers), and MLA's one latent row
    of 576 bf16 a layer, 27 layers (SGLang's configurator's MLA cell size)."""
    from _vllm_child import TOKEN_KV_BYTES

    assert bench_sglang.token_kv_bytes("1b") == TOKEN_KV_BYTES == 32 * 1024
    assert bench_sglang.token_kv_bytes("8b") == 128 * 1024
    assert bench_sglang.token_kv_bytes("mla") == (512 + 64) * 2 * 27
    args = bench_sglang.parse_args(["--out", str(tmp_path), "--model", "mla"])
    assert args.model == "mla"


def test_arguments_for_kvcached(tmp_path: pathlib.Path) -> None:
    args = bench_sglang.parse_args(
        ["--out", str(tmp_path), "--candidate", "kvcached", "--modes", "identity", "two"]
    )
    assert args.two_variants == ["kvcached", "static-stock"]
    assert bench_sglang.parse_args(["--out", "o", "--candidate", "kvcached"]).modes == [
        "identity",
        "two",
    ]
    assert args.kvcached_pack == vllm_reference.DEFAULT_PACK  # as bench_vllm.py's
    assert args.kvcached_site == vllm_reference.DEFAULT_SITE
    assert args.kvcached_max_cached_tokens is None
    assert bench_sglang.plans_kvcached(args)
    args = bench_sglang.parse_args(
        ["--out", str(tmp_path), "--modes", "two", "--two-variants", "kvcached", "shared"]
    )
    assert bench_sglang.plans_kvcached(args)


@pytest.mark.parametrize("mode", ["release", "seed-a", "mixed"])
def test_kvcached_refuses_kvasync_only_modes(tmp_path: pathlib.Path, mode: str) -> None:
    with pytest.raises(SystemExit):
        bench_sglang.parse_args(
            ["--out", str(tmp_path), "--candidate", "kvcached", "--modes", mode]
        )


def test_engine_env(tmp_path: pathlib.Path) -> None:
    env = ref.engine_env("two A/1", "42", site="/s", probe_prefix="/p", max_cached_tokens=-1)
    assert env["ENABLE_KVCACHED"] == "true" and env["KVCACHED_AUTOPATCH"] == "1"
    assert env["KVASYNC_SGLANG"] == "0"  # kvasync's plugin inert
    assert env["KVCACHED_IPC_NAME"] == "kvcached_sgl_42_two_A_1"
    assert env[ref.SITE_ENV] == "/s" and env[ref.PROBE_ENV] == "/p"
    assert env["KVCACHED_MAX_CACHED_TOKENS"] == "-1"
    assert "KVCACHED_MAX_CACHED_TOKENS" not in ref.engine_env(
        "a", "1", site="/s", probe_prefix="/p"
    )
    # Every key is one the engine launcher gives to this engine alone (kept out of the others).
    assert all(vllm_reference.is_reference_key(k) or k.startswith("KVASYNC_") for k in env)


def test_enter_does_nothing_without_kvcached(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(ref.SITE_ENV, raising=False)
    assert ref.enter_if_kvcached(spawned=False) is False


def test_enter_refuses_an_unbuilt_site(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(ref.SITE_ENV, str(tmp_path))
    with pytest.raises(RuntimeError, match="not built"):
        ref.enter_if_kvcached(spawned=False)


def _module(name: str, **names: object) -> types.ModuleType:
    module = types.ModuleType(name)
    for key, value in names.items():
        setattr(module, key, value)
    return module


def test_probe_reads_bindings_wrappers_and_stale_names() -> None:
    pool_mod = "sglang.srt.mem_cache.memory_pool"
    alloc_mod = "sglang.srt.mem_cache.allocator"
    theirs = "kvcached.integration.sglang.patches"
    stock_pool = type("MHATokenToKVPool", (), {"__module__": pool_mod})
    elastic_pool = type("ElasticMHATokenToKVPool", (stock_pool,), {"__module__": theirs})
    stock_alloc = type("PagedTokenToKVPoolAllocator", (), {"__module__": f"{alloc_mod}.paged"})
    elastic_alloc = type(
        "ElasticPagedTokenToKVPoolAllocator", (stock_alloc,), {"__module__": theirs}
    )
    # SGLang's own class whose name starts alike (elastic expert parallelism): not kvcached's
    sglang_elastic = type("ElasticEPStateManager", (), {"__module__": "sglang.srt.elastic_ep"})
    wrapper: dict[str, object] = {}
    source = "def check(self):\n    pass\n"
    exec(compile(source, "/site/kvcached/integration/sglang/patches.py", "exec"), wrapper)
    check = wrapper["check"]
    check.__kvcached_patched_scheduler_memory_leak__ = True  # type: ignore[attr-defined]
    own: dict[str, object] = {}
    exec(compile(source, "/site/sglang/srt/managers/scheduler.py", "exec"), own)
    scheduler = type(
        "Scheduler",
        (),
        {"__module__": "sglang.srt.managers.scheduler", "check": check, "run": own["check"]},
    )
    modules: dict[str, object] = {
        "sglang": _module("sglang", __version__="0.5.15.post1"),
        pool_mod: _module(
            pool_mod, MHATokenToKVPool=elastic_pool, ElasticMHATokenToKVPool=elastic_pool
        ),
        alloc_mod: _module(
            alloc_mod,
            PagedTokenToKVPoolAllocator=elastic_alloc,
            __kvcached_allocator_aliased__=True,
        ),
        # where SGLang's class is defined: its own binding is not stale
        f"{alloc_mod}.paged": _module(
            f"{alloc_mod}.paged", PagedTokenToKVPoolAllocator=stock_alloc
        ),
        # took SGLang's class before kvcached bound its own
        "sglang.srt.model_executor.model_runner": _module(
            "sglang.srt.model_executor.model_runner",
            MHATokenToKVPool=stock_pool,
            ElasticEPStateManager=sglang_elastic,
        ),
        "sglang.srt.managers.scheduler": _module(
            "sglang.srt.managers.scheduler", Scheduler=scheduler
        ),
        "other": _module("other", MHATokenToKVPool=stock_pool),
    }
    found = ref.probe(modules)
    assert found["sglang"] == "0.5.15.post1"
    assert found["patched"] is True
    assert found["bound"] == {
        pool_mod: {
            "MHATokenToKVPool": "ElasticMHATokenToKVPool",
            "ElasticMHATokenToKVPool": "ElasticMHATokenToKVPool",
        },
        alloc_mod: {"PagedTokenToKVPoolAllocator": "ElasticPagedTokenToKVPoolAllocator"},
    }
    assert found["stale"] == {"sglang.srt.model_executor.model_runner": ["MHATokenToKVPool"]}
    assert found["marked"] == {alloc_mod: ["__kvcached_allocator_aliased__"]}
    assert found["replaced"] == {
        "sglang.srt.managers.scheduler.Scheduler.check": [
            "__kvcached_patched_scheduler_memory_leak__"
        ]
    }
    del modules[alloc_mod]
    assert ref.probe(modules)["patched"] is False


def test_summary_needs_the_scheduler_process() -> None:
    engine = {"pid": 1, "role": "engine", "patched": True, "stale": {}}
    early = {"pid": 2, "role": "spawned", "patched": True, "stale": {}}
    assert ref.summarize([engine, early])["scheduler_patched"] is False
    scheduler = dict(early, role="sglang.srt.managers.scheduler.run_scheduler_process")
    summary = ref.summarize([engine, early, scheduler])
    assert summary["scheduler_patched"] and summary["engine_patched"]
    assert summary["processes"] == 2
    unpatched = dict(scheduler, patched=False, stale={"m": ["X"]})
    summary = ref.summarize([engine, unpatched])
    assert not summary["scheduler_patched"] and summary["stale"] == ["m.X"]


def test_segment_and_sampler(tmp_path: pathlib.Path) -> None:
    gib = 2**30
    (tmp_path / "seg").write_bytes(struct.pack("<qqq", 6 * gib, gib, gib // 2))
    (tmp_path / "seg_g1").write_bytes(struct.pack("<qqq", gib, gib // 2, 0))
    assert ref.read_segment("seg", tmp_path) == {
        "total": 7 * gib,
        "used": gib + gib // 2,
        "prealloc": gib // 2,
    }
    assert ref.read_segment("absent", tmp_path) is None
    (tmp_path / "short").write_bytes(b"\0" * 8)
    assert ref.read_segment("short", tmp_path) is None


def test_log_lines(tmp_path: pathlib.Path) -> None:
    log = tmp_path / "e.log"
    line = "[kvcached][INFO] Successfully patched sglang: elastic_allocator, elastic_memory_pool"
    log.write_text(f"{line}\nother\n{line}\n[kvcached] ElasticPagedTokenToKVPoolAllocator in use\n")
    assert ref.log_lines(log) == [line, "[kvcached] ElasticPagedTokenToKVPoolAllocator in use"]
    assert ref.log_lines(tmp_path / "absent.log") == []


# -- end to end: an engine child and its spawned "scheduler" ------------------------------------

FAKE_WRAPT = '''
"""The part of wrapt.importer that kvcached's .pth uses: hooks run after a module's import."""
import importlib.abc
import importlib.util
import sys

_hooks = {}


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name not in _hooks:
            return None
        sys.meta_path.remove(self)
        try:
            spec = importlib.util.find_spec(name)
        finally:
            sys.meta_path.insert(0, self)
        if spec is None or spec.loader is None:
            return spec
        run = spec.loader.exec_module

        def exec_module(module):
            run(module)
            for hook in _hooks.pop(name, []):
                hook(module)

        spec.loader.exec_module = exec_module
        return spec


def when_imported(name):
    def register(hook):
        if name in sys.modules:
            hook(sys.modules[name])
        else:
            if not any(isinstance(f, _Finder) for f in sys.meta_path):
                sys.meta_path.insert(0, _Finder())
            _hooks.setdefault(name, []).append(hook)
        return hook

    return register
'''

# A stand-in for kvcached's hook: on sglang's import, where enabled, bind Elastic* classes.
FAKE_HOOK = """
import os

from wrapt.importer import when_imported


@when_imported("sglang")
def _patch(_sglang):
    if os.environ.get("KVCACHED_AUTOPATCH") != "1":
        return
    from sglang.srt.mem_cache import allocator, memory_pool

    memory_pool.ElasticMHATokenToKVPool = type(
        "ElasticMHATokenToKVPool", (memory_pool.MHATokenToKVPool,), {}
    )
    memory_pool.MHATokenToKVPool = memory_pool.ElasticMHATokenToKVPool
    allocator.PagedTokenToKVPoolAllocator = type(
        "ElasticPagedTokenToKVPoolAllocator", (allocator.PagedTokenToKVPoolAllocator,), {}
    )
    print("[kvcached] Successfully patched sglang: stand-in", flush=True)
"""

# A stand-in for SGLang: its Engine spawns the scheduler's process as SGLang does.
FAKE_SGLANG = {
    "sglang/__init__.py": """
        import multiprocessing

        __version__ = "0.0.test"


        class Engine:
            def __init__(self, **kwargs):
                from sglang.srt.managers import scheduler

                context = multiprocessing.get_context("spawn")
                process = context.Process(target=scheduler.run_scheduler_process)
                process.start()
                process.join(120)
                if process.exitcode != 0:
                    raise RuntimeError(f"scheduler exit {process.exitcode}")

            def shutdown(self):
                pass
        """,
    "sglang/srt/__init__.py": "",
    "sglang/srt/managers/__init__.py": "",
    "sglang/srt/managers/scheduler.py": """
        import time

        from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool


        def run_scheduler_process():
            time.sleep(1.0)  # the probe's thread writes once the process has started
        """,
    "sglang/srt/mem_cache/__init__.py": "",
    "sglang/srt/mem_cache/memory_pool.py": "class MHATokenToKVPool:\n    pass\n",
    "sglang/srt/mem_cache/allocator.py": "class PagedTokenToKVPoolAllocator:\n    pass\n",
}


def _write(root: pathlib.Path, files: dict[str, str]) -> None:
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text))


def test_kvcached_is_in_the_spawned_scheduler_process(tmp_path: pathlib.Path) -> None:
    site = tmp_path / "kvcached-site"
    _stand_in_kvcached(site)
    sglang_site = tmp_path / "sglang-site"
    _write(sglang_site, FAKE_SGLANG)
    out = tmp_path / "out"
    args = bench_sglang.parse_args(
        [
            "--out",
            str(out),
            "--candidate",
            "kvcached",
            "--kvcached-site",
            str(site),
            "--sglang-site",
            str(sglang_site),
        ]
    )
    bench = bench_sglang.Bench(args)
    folder = bench.work / "identity"
    env = bench.kvcached_env(folder, "kvcached")
    engine = bench.spawn(folder, "kvcached", "prompts", env, prompts=[], rounds=0)
    try:
        engine.wait("imported", time.monotonic() + 60)
        engine.go()
        engine.wait("done", time.monotonic() + 120)
        assert engine.wait_exit(time.monotonic() + 30) is not None
    finally:
        engine.kill()
    report = bench.kvcached_report(engine)
    roles = {p["role"]: p for p in report["probes"]}
    assert roles["engine"]["patched"], report
    assert roles["engine"]["bound"]["sglang.srt.mem_cache.memory_pool"] == {
        "ElasticMHATokenToKVPool": "ElasticMHATokenToKVPool",
        "MHATokenToKVPool": "ElasticMHATokenToKVPool",
    }
    scheduler = roles["sglang.srt.managers.scheduler.run_scheduler_process"]
    assert scheduler["patched"] and scheduler["pid"] != roles["engine"]["pid"]
    assert scheduler["sglang"] == "0.0.test"
    # The scheduler module took the pool class after the hook had bound kvcached's: not stale.
    assert scheduler["stale"] == {}
    assert report["summary"]["scheduler_patched"] is True
    assert report["log"] == ["[kvcached] Successfully patched sglang: stand-in"]
    assert json.loads(engine.result_path.read_text()) == {"rounds": [], "outputs": []}


def _stand_in_kvcached(site: pathlib.Path) -> None:
    _write(
        site,
        {
            "wrapt/__init__.py": "",
            "wrapt/importer.py": FAKE_WRAPT,
            "kvcached/__init__.py": "",
            "kvcached/stand_in.py": FAKE_HOOK,
            "kvcached_autopatch.pth": "import kvcached.stand_in\n",
        },
    )


def test_mode_two_runs_kvcached_engines_and_records_their_probes(tmp_path: pathlib.Path) -> None:
    """``two`` with the stand-ins, whose Engine cannot serve: each variant's failure is recorded
    (at the warm-up), and each kvcached engine's probes are in the record."""
    _stand_in_kvcached(tmp_path / "kvcached-site")
    _write(tmp_path / "sglang-site", FAKE_SGLANG)
    args = bench_sglang.parse_args(
        [
            "--out",
            str(tmp_path / "out"),
            "--candidate",
            "kvcached",
            "--modes",
            "two",
            "--kvcached-site",
            str(tmp_path / "kvcached-site"),
            "--sglang-site",
            str(tmp_path / "sglang-site"),
            "--bursts",
            "1",
            "--burst-requests",
            "2",
        ]
    )
    bench = bench_sglang.Bench(args)
    bench.mode_two()
    record = bench.results["two"]
    assert set(record) >= {"kvcached", "static-stock"}
    assert "warm" in record["kvcached"]["failure"]
    reports = record["kvcached"]["kvcached"]
    assert sorted(reports) == ["kvcached_A", "kvcached_B"]
    assert all(r["summary"]["scheduler_patched"] for r in reports.values())
    assert "kvcached" not in record["static-stock"]
    spec = json.loads((bench.work / "two" / "kvcached_A.spec.json").read_text())
    assert spec["engine_args"]["max_total_tokens"] == 6 * 2**30 // (32 * 1024)  # all the budget
    assert spec["env"]["KVCACHED_IPC_NAME"].endswith("kvcached_A")


def test_a_stock_engine_never_sees_kvcached(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The same stand-ins, a stock engine: kvcached's variables left in the driver's environment
    do not reach it, so no process of it adds kvcached's site."""
    site = tmp_path / "kvcached-site"
    _write(site, {"kvcached_autopatch.pth": "import this_module_does_not_exist\n"})
    sglang_site = tmp_path / "sglang-site"
    _write(sglang_site, FAKE_SGLANG)
    args = bench_sglang.parse_args(
        ["--out", str(tmp_path / "out"), "--sglang-site", str(sglang_site)]
    )
    bench = bench_sglang.Bench(args)
    folder = bench.work / "identity"
    leaked = ref.engine_env("leak", "1", site=str(site), probe_prefix=str(folder / "leak"))
    for key, value in leaked.items():
        monkeypatch.setenv(key, value)
    engine = bench.spawn(folder, "stock", "prompts", {"KVASYNC_SGLANG": "0"}, prompts=[], rounds=0)
    try:
        engine.wait("imported", time.monotonic() + 60)
        engine.go()
        engine.wait("done", time.monotonic() + 120)
    finally:
        engine.kill()
    assert not list(folder.glob("leak.*"))
    assert "this_module_does_not_exist" not in engine.log_path.read_text()


class _Spawned:
    """What ``subprocess.Popen`` was given for an engine child; starts nothing."""

    def __init__(self, command: list[str], **options: object) -> None:
        self.command = command
        self.options = options
        self.pid = 0
        spawned.append(self)


spawned: list[_Spawned] = []


@pytest.mark.parametrize(
    ("option", "linger"), [([], None), (["--linger", "2"], "2"), (["--linger", "0.5"], "0.5")]
)
def test_linger_reaches_kvasync_engines_only(
    tmp_path: pathlib.Path,
    monkeypatch: pytest.MonkeyPatch,
    option: list[str],
    linger: str | None,
) -> None:
    """``--linger`` is in the environment every kvasync engine child is started with (and in its
    spec), in no stock engine's, and without ``--linger`` in none: a ``KVASYNC_LINGER`` left in
    the driver's environment never reaches an engine."""
    monkeypatch.setenv("KVASYNC_LINGER", "9")
    monkeypatch.setattr(subprocess, "Popen", _Spawned)
    spawned.clear()
    args = bench_sglang.parse_args(["--out", str(tmp_path / "out"), *option])
    bench = bench_sglang.Bench(args)
    folder = bench.work / "two"
    for name, env in (
        ("shared", bench.kvasync_env("a", share="s", budget=2**30, limit=None)),
        ("static", bench.kvasync_env("b", share=None, budget=None, limit=2**29)),
        ("stock", {"KVASYNC_SGLANG": "0"}),
    ):
        engine = bench.spawn(folder, name, "trace", env)
        engine._log.close()
        child_env = spawned[-1].options["env"]
        assert isinstance(child_env, dict)
        if name == "stock" or linger is None:
            assert "KVASYNC_LINGER" not in child_env
            assert "KVASYNC_LINGER" not in engine.spec["env"]
        else:
            assert child_env["KVASYNC_LINGER"] == linger
            assert engine.spec["env"]["KVASYNC_LINGER"] == linger
            assert child_env["KVASYNC_SGLANG"] == "1"
    assert len(spawned) == 3
    # mixed's vLLM engine: in the share it lingers alike; stock never gets the variable
    shared_vllm = bench.mixed_vllm_env("s", 2**30)
    assert shared_vllm.get("KVASYNC_LINGER") == linger
    assert shared_vllm["KVASYNC_SHARE"] == "s"
    assert "KVASYNC_LINGER" not in bench.mixed_vllm_env(None, 2**30)


def test_the_identity_memory_plot_has_each_engine_and_each_allocator(
    tmp_path: pathlib.Path,
) -> None:
    import _sglang_plot

    identity = {
        "memory": [
            {"wall": 100.0, "mib": {"stock": 0.0, "kvasync": 512.0}},
            {"wall": 101.0, "mib": {"stock": 1024.0, "kvasync": 2048.0}},
        ],
        "ledger": [{"wall": 100.5, "mapped_gib": {"sgl-id": 0.25}}],
    }
    series = _sglang_plot.memory_series(identity)
    assert series == {
        "stock: device": ([0.0, 1.0], [0.0, 1.0]),
        "kvasync: device": ([0.0, 1.0], [0.5, 2.0]),
        "sgl-id: mapped KV": ([0.5], [0.25]),
    }
    assert not _sglang_plot.plot_identity({"two": {}}, tmp_path / "none.png")
    assert _sglang_plot.plot_identity({"identity": identity}, tmp_path / "memory.png")
    assert (tmp_path / "memory.png").stat().st_size > 0
